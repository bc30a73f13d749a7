"""The rank's heap before it serves (no torch here: the protocol workers use it too)."""

from __future__ import annotations

import gc

__all__ = ["settle_heap", "thaw_heap"]


def settle_heap() -> None:
    """Collect what loading left behind, then freeze every object alive (``gc.freeze``): the cyclic collector's full
    passes while serving scan only what was made since.

    [Note: frozen heap]
    A rank holds some 250,000 objects once torch and its programs are loaded, and a full pass of Python's cyclic
    collector over them took 56-67 ms on the development VM (one pass of generation 2; generations 0 and 1 take
    under 0.1 ms).  One comes each time the objects that outlived two younger passes reach a quarter of those,
    whenever that falls; in the toy's bench (160,000 requests) the frontend's came just after its last level (82
    ms), and a long-lived server meets them while it serves: every request then in flight, or arriving, waits for
    it.  Frozen objects are never scanned, so a full pass afterwards covers only the objects serving made: 0.02-1.3
    ms in the same bench, the frontend's after its levels 11 ms.  Called by every rank before each variant serves,
    by the bench before each level, and by a protocol worker once it listens (no torch there: 11 ms a full pass
    before).

    The collector never frees a frozen object either, even once nothing refers to it, and a loaded program is a
    cycle (a ``GraphModule`` and its graph point at each other).  So what a call froze is unfrozen first (what
    died since goes in this pass: 60-85 ms between variants and levels, not while serving), and
    :func:`thaw_heap` ends each variant, before its program is dropped: a GPU rank gives its slice back before
    the next variant loads (``core.device.free_device_copy`` unfreezes too).
    """
    gc.unfreeze()
    gc.collect()
    gc.freeze()


def thaw_heap() -> None:
    """Let the collector free again what :func:`settle_heap` froze (``[Note: frozen heap]``): a variant's end."""
    gc.unfreeze()
