"""How a tensor crosses from one pipeline stage to the next: every hop, in one package.

A boundary transfer, in the order it happens:

1. :mod:`ldt.boundary.sequence`: with sequence parallelism, the sending stage's leader gathers
   its TP group's sequence slices (and the receiving leader later scatters them); with
   variable sequence lengths, the shape crosses first.
2. :mod:`ldt.boundary.communicator`: the one leader-to-leader hop over the boundary's own
   group (host-staged through gloo between device types), then the receiving stage's TP
   broadcast; :class:`~ldt.boundary.communicator.VtpCommunicator` is megatron-core's
   ``P2PCommunicator`` with that ``_communicate``, and the reference implementation's
   functional API (``vtp_send_forward`` and its siblings, :mod:`ldt.boundary.functional`)
   sits on it. Where no slow link is in the way the sending stage sends straight to every
   TP rank across instead, its TP ranks sharing the copies (fan-out,
   ``cluster.boundary_fanout``).
   A large message crosses in pieces, relayed in the receiving stage (and gathered in a
   sequence-parallel sending one) piece by piece as they arrive: :mod:`ldt.boundary.relay`.
3. :mod:`ldt.boundary.work`: the handles a transfer returns (``wait()`` = leader receive, then
   the broadcast or scatter), the emulated link delay, and the error that names the boundary.
4. :mod:`ldt.boundary.lane_communicator`: with per-stage data parallelism, which replica of the
   neighbouring stage a message goes to or comes from (fan-in / fan-out).

The groups these hops run on are built by :mod:`ldt.groups.parallel_state` (with the collectives
that span stages in :mod:`ldt.groups.cross_stage`); nothing here creates a group.
"""
