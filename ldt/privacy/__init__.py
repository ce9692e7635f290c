"""What the U-shape's cloud can learn from what crosses the edge's boundaries, measured.

:mod:`~ldt.privacy.capture` records the tensors the cloud receives in a real run,
:mod:`~ldt.privacy.attacks` recovers inputs and labels from them, :mod:`~ldt.boundary.noise`
is the opt-in noise the edge adds to what it sends, and :mod:`~ldt.privacy.audit` ties them
into ``ldt-audit`` (see docs/privacy.md).
"""
