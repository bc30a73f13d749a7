"""Measuring one profile cell, and the process around it (used by :mod:`hpcsplit.profiling.runner`).

Latency, peak memory and utilization of one cell, and SIGTERM/SIGUSR2 handling; the timers, slices,
device placement and device attributes are shared with serving in :mod:`hpcsplit.core.device`.

[Note: profile measurement]
- Latency: CUDA events around each timed run on GPU (synchronised once at the end),
  ``time.perf_counter`` on CPU.  ``warmup`` untimed runs come first.
- Peak memory = parameters + inputs + the activation peak.  On GPU the activation peak is
  ``torch.cuda.max_memory_allocated`` over the timed runs minus ``memory_allocated`` before
  them (allocator cache and CUDA context excluded).  On CPU there is no allocator statistic,
  so one extra untimed run is traced with a ``TorchDispatchMode`` that adds up the bytes of
  the storages the ops allocate while they are alive (kernel workspaces, malloc caching
  excluded).
- Utilization: on GPU the mean NVML ``utilization.gpu`` sampled by a background thread
  during a steady window of back-to-back runs (``util_window_ms``), NaN without NVML.  On
  CPU, per the profile contract, ``threads / cores_per_node``; the measured process CPU
  time / (wall x threads) of the timed runs is stored as ``cpu_busy_fraction``.
- Slices: GB on GPU (GiB, 2**30 bytes) enforced with
  ``torch.cuda.set_per_process_memory_fraction`` (a soft cap on PyTorch's allocator, not a
  hardware partition); CPU threads via ``torch.set_num_threads`` on CPU.
- Batch sizes grow within a (component, slice) row; after the first out-of-memory the larger
  batch sizes of that row are not run and are marked ``oom`` and ``oom_inferred``.
"""

from __future__ import annotations

import gc
import math
import signal
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Self

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from hpcsplit.core.device import CellAbandoned, is_oom, time_cpu, time_cuda

__all__ = [
    "Measurement",
    "StopOnSignal",
    "call_previous_handler",
    "measure_callable",
]


@dataclass(frozen=True, slots=True)
class Measurement:
    """What :func:`measure_callable` measured for one cell."""

    latency_ms: tuple[float, ...]  # empty when oom
    peak_mem_bytes: float
    utilization: float
    cpu_busy_fraction: float
    oom: bool
    input_bytes: int
    output_bytes: int
    error: str = ""


def _tensor_bytes(xs: Any) -> int:
    return int(sum(t.numel() * t.element_size() for t in tree_leaves(xs) if isinstance(t, torch.Tensor)))


class _LiveBytes(TorchDispatchMode):
    """A dispatch mode that tracks the peak of live bytes allocated by ops (CPU peak memory)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._ptrs: set[int] = set()

    def _free(self, ptr: int, n: int) -> None:
        if ptr in self._ptrs:
            self._ptrs.discard(ptr)
            self.live -= n

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        in_ptrs = {
            t.untyped_storage().data_ptr()
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            ptr, n = st.data_ptr(), st.nbytes()
            if n == 0 or ptr in in_ptrs or ptr in self._ptrs:
                continue  # a view / in-place result, or already counted
            self._ptrs.add(ptr)
            self.live += n
            self.peak = max(self.peak, self.live)
            weakref.finalize(st, self._free, ptr, n)
        return out


def measure_callable(
    fn: Callable[..., Any],
    inputs: Sequence[Any],
    *,
    warmup: int = 2,
    iters: int = 10,
    device: Any = "cpu",
    param_bytes: int = 0,
    threads: int | None = None,
    cores_per_node: int | None = None,
    util_window_ms: float = 500.0,
    util_sample_ms: float = 20.0,
    stop: Callable[[], bool] | None = None,
) -> Measurement:
    """Measure one cell: ``warmup`` runs, then ``iters`` timed runs of ``fn(*inputs)``.

    Parameters
    ----------
    fn, inputs
        The component and its positional input tensors (already on ``device``).
    device
        ``"cpu"`` or a CUDA device; selects the timer and the memory statistic.
    param_bytes
        Bytes of the component's parameters (added to the CPU peak-memory figure).
    threads, cores_per_node
        CPU only: the slice, giving ``utilization = threads / cores_per_node``.
    stop
        Checked before every run; when it returns True the cell is abandoned.

    Returns
    -------
    Measurement
        ``oom=True`` with empty latencies when the runs ran out of memory.

    Raises
    ------
    CellAbandoned
        ``stop()`` became True (a signal asked the profiler to stop).
    """
    dev = torch.device(device)
    check = stop or (lambda: False)
    in_bytes = _tensor_bytes(inputs)
    out_bytes = -1
    try:
        with torch.no_grad():
            for _ in range(warmup):
                if check():
                    raise CellAbandoned
                out = fn(*inputs)
            out = None
            if dev.type == "cuda":
                lat, act_peak, util, out = time_cuda(
                    fn, inputs, dev, iters, util_window_ms, util_sample_ms, check
                )
                peak = float(param_bytes + in_bytes + act_peak)
                busy = math.nan
            else:
                lat, busy, out = time_cpu(fn, inputs, iters, threads or torch.get_num_threads(), check)
                mode = _LiveBytes()
                with mode:
                    out = fn(*inputs)
                peak = float(param_bytes + in_bytes + mode.peak)
                util = (threads or torch.get_num_threads()) / cores_per_node if cores_per_node else math.nan
            out_bytes = _tensor_bytes(out)
            del out
    except Exception as e:
        if not is_oom(e):
            raise
        peak = math.nan
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        return Measurement(
            (), peak, math.nan, math.nan, True, in_bytes, out_bytes, f"{type(e).__name__}: {e}"
        )
    return Measurement(tuple(lat), peak, util, busy, False, in_bytes, out_bytes)


class StopOnSignal:
    """Turn SIGTERM / SIGUSR2 (SLURM's pre-timeout signal) into a flag checked between cells."""

    SIGNALS = ("SIGTERM", "SIGUSR2")

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> Self:
        if threading.current_thread() is threading.main_thread():
            for name in self.SIGNALS:
                sig = getattr(signal, name, None)
                if sig is not None:
                    self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        self.signum = signum
        print(
            f"[hpcsplit.profile] got {signal.Signals(signum).name}: stopping after the current run "
            "(cells written so far are kept; run the profile stage again to resume)",
            file=sys.stderr,
            flush=True,
        )

    @property
    def stopped(self) -> bool:
        return self.signum is not None

    def __exit__(self, *exc: object) -> None:
        for sig, prev in self._previous.items():
            signal.signal(sig, prev)


def call_previous_handler(signum: int) -> None:
    """Call the handler that was installed before ours (e.g. submitit's checkpoint-and-requeue)."""
    prev = signal.getsignal(signum)
    if callable(prev):
        prev(signum, None)
