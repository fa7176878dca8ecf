"""Ctrl-C and SIGTERM end every command with one line (exit 130 or 143): SIGTERM is raised as
an exception like Ctrl-C, so the same clean-up runs, and both are held back while modules load,
since an extension module interrupted in its initialisation fails as a misleading ImportError."""
from __future__ import annotations

import contextlib
import signal
import threading

# runtime.launch.HELD_SIGNALS is the same set; not imported from there, since this module must load
# before anything but the standard library (held_while_loading guards the imports after it)
HELD = {signal.SIGINT, signal.SIGTERM}


class Terminated(BaseException):
    """SIGTERM, raised in the main thread."""


def _on_sigterm(signum, frame) -> None:
    raise Terminated()


@contextlib.contextmanager
def terminate_as_exception():
    """SIGTERM raises Terminated inside the block (main thread only; elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def held_while_loading():
    """Deliver Ctrl-C / SIGTERM after the block (imports), not inside a module's initialisation."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, HELD)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, HELD)
