"""Imported by ldt's forkserver (first of :data:`ldt.launch.local.PRELOAD`): how it meets its end.

The forkserver is a helper of the launcher and must end with it, not before: a SIGTERM or
SIGHUP sent to the whole process group (``timeout``, a batch system, a closed terminal) goes
to the launcher and the ranks, which stop at the next step boundary, and would otherwise kill
the forkserver first, whose death kills every rank at once (their parent-death signal). It
ends when the launcher does (EOF on its "alive" pipe), with a SystemExit; tearing down an
interpreter that holds torch and megatron-core takes ~1.5 s for nothing (it has no state to
flush), so it leaves through ``os._exit``. Its children drop that atexit handler (a script a
rank runs may call the atexit handlers) and restore the default signal dispositions
(:func:`ldt.launch.local._child`).
Imported anywhere else, this module does nothing.
"""

import atexit
import os
import signal
import sys


def _in_forkserver() -> bool:
    frame = sys._getframe()
    while frame is not None:
        code = frame.f_code
        if code.co_name == "main" and code.co_filename.endswith(
                os.path.join("multiprocessing", "forkserver.py")):
            return True
        frame = frame.f_back
    return False


if _in_forkserver():
    # SIGINT too: CPython's forkserver ignores it only after its preload (~5 s of imports), and
    # a Ctrl-C then killed it with a traceback while the launcher was starting the ranks
    for _sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(_sig, signal.SIG_IGN)
    atexit.register(os._exit, 0)
