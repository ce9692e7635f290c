"""Imported only by ldt's forkserver (first of :data:`ldt.launch.PRELOAD`): its signal dispositions.

The forkserver is a helper of the launcher and must end with it, not before: a SIGTERM or
SIGHUP sent to the whole process group (``timeout``, a batch system, a closed terminal) goes
to the launcher and the ranks, which stop at the next step boundary, and would otherwise kill
the forkserver first, whose death kills every rank at once (their parent-death signal). It
ends when the launcher does (EOF on its "alive" pipe). Ranks restore the default dispositions
(:func:`ldt.launch._child`). SIGINT the forkserver already ignores.
"""

import signal

for _sig in (signal.SIGTERM, signal.SIGHUP):
    signal.signal(_sig, signal.SIG_IGN)
