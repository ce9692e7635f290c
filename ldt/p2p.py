"""The boundary transport's public names where users import them (``ldt.p2p.vtp_send_forward``,
``ldt.p2p.VtpCommunicator``, as in the reference implementation); the code lives in
:mod:`ldt.boundary`."""

from ldt.boundary.communicator import (BACKWARD, FORWARD, BoundaryObserver,  # noqa: F401
                                       VtpCommunicator, check_boundary_config)
from ldt.boundary.functional import (vtp_recv_backward, vtp_recv_forward,  # noqa: F401
                                     vtp_send_backward, vtp_send_forward)
from ldt.boundary.work import BoundaryError, LinkDelay, RecvWork, SendWork  # noqa: F401

__all__ = ["BoundaryError", "BoundaryObserver", "VtpCommunicator", "vtp_recv_backward",
           "vtp_recv_forward", "vtp_send_backward", "vtp_send_forward"]
