"""Helper processes that must not outlive the process that made them (Linux: ``PR_SET_PDEATHSIG``)."""

from __future__ import annotations

import ctypes
import os
import signal

__all__ = ["die_with_parent"]

PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> None:
    """Ask the kernel for SIGKILL when this process's parent ends; end now if ``parent`` (its pid, read before
    this process was made) has already gone."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # pragma: no cover - not Linux: the caller's own end still stops it
        pass
    if os.getppid() != parent:  # the parent died before the request above
        os._exit(1)
