"""Chrome-trace (Perfetto) spans of receive, compute and send per rank, for a window of requests.

``runtime.trace.start_step`` / ``end_step`` select requests by id (``start <= id < end``); a span is kept
when any of its requests is in the window.  Each rank writes ``rank<r>.json`` into the run folder's
``trace/`` (``RunPaths.trace_dir``); open
them together in https://ui.perfetto.dev (timestamps are the node's monotonic clock, so ranks of one
node line up; each file names its host).  ``python -m hpcsplit.bench hops RUN_DIR`` reads every hop of the
traced requests from them, against the calibration.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["Tracer"]


class Tracer:
    """Collect complete-event spans (``ph: "X"``) for requests ``start_step <= id < end_step``.

    Examples
    --------
    >>> t = Tracer(rank=1, start_step=10, end_step=12, label="text")
    >>> t.span("compute", 0.0, 0.002, [9, 10]); t.span("compute", 0.0, 0.001, [12])
    >>> [e["name"] for e in t.events if e["ph"] == "X"]
    ['compute']
    """

    def __init__(self, rank: int, start_step: int | None, end_step: int | None, label: str = "") -> None:
        self.rank = rank
        self.start = start_step
        self.end = end_step
        self.enabled = start_step is not None and end_step is not None and end_step > start_step
        self.events: list[dict[str, Any]] = []
        if self.enabled:
            self.events.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                                "args": {"name": f"rank {rank} {label}".strip()}})

    def wants(self, request_ids: Iterable[int]) -> bool:
        if not self.enabled:
            return False
        return any(self.start <= r < self.end for r in request_ids)  # type: ignore[operator]

    def cpu(self) -> float:
        """This thread's CPU time now (``time.thread_time``) when tracing is on, else 0: a span's ``cpu0``."""
        return time.thread_time() if self.enabled else 0.0

    def span(self, name: str, t0: float, t1: float, request_ids: Iterable[int], cpu0: float | None = None,
             **args: Any) -> None:
        """Record ``name`` from ``t0`` to ``t1`` (``time.perf_counter`` seconds) if in the window; with ``cpu0``
        (:meth:`cpu` at ``t0``) also the calling thread's CPU over the span, ``cpu_us``: on a CPU rank of one
        thread, a span longer than its CPU waited (for a core, for the GIL, in a system call); torch's other
        threads and a GPU's work are not this thread's CPU."""
        if not self.enabled:
            return
        ids = list(request_ids)
        if not self.wants(ids):
            return
        if cpu0 is not None:
            args["cpu_us"] = round((time.thread_time() - cpu0) * 1e6, 1)
        self.events.append({
            "name": name, "ph": "X", "pid": self.rank, "tid": 0,
            "ts": t0 * 1e6, "dur": max(0.0, (t1 - t0) * 1e6),
            "args": {"requests": ids[:64], "n": len(ids), **args},
        })

    def write(self, trace_dir: str | Path) -> Path | None:
        """Write ``<trace_dir>/rank<r>.json`` when tracing is on (returns the path)."""
        if not self.enabled:
            return None
        path = Path(trace_dir) / f"rank{self.rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"traceEvents": self.events, "displayTimeUnit": "ms",
                                    "otherData": {"clock": "perf_counter", "host": socket.gethostname(),
                                                  "written": time.time()}}))
        return path
