"""Device helpers every stage shares: out-of-memory detection, timing, slices, moving and freeing a
component's device copy, and the device attributes a profile records.

[Note: device timing]
Latency is timed with CUDA events on a GPU (synchronised once at the end) and ``time.perf_counter`` on
the CPU, ``warmup`` untimed runs first; the profile (:mod:`hpcsplit.profiling.measure`), the bench's
critical-path floor and serving's component checks all time through :func:`time_latency_ms` or the
same two timers, so their figures compare.
"""

from __future__ import annotations

import gc
import inspect
import math
import os
import platform
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Self

import numpy as np

from hpcsplit.core.cluster import slice_fraction
from hpcsplit.errors import ProfileError

__all__ = [
    "CellAbandoned",
    "apply_slice",
    "cores_here",
    "device_meta",
    "free_device_copy",
    "full_fp32_on_gpu",
    "is_oom",
    "load_on_device",
    "time_latency_ms",
]


class CellAbandoned(Exception):
    """The stop callback fired in the middle of a cell: it is not written (measured again on resume)."""


def is_oom(e: BaseException) -> bool:
    """Whether ``e`` is running out of memory (torch's OOM, or a CUDA library's failed allocation)."""
    import torch

    if isinstance(e, (MemoryError, torch.cuda.OutOfMemoryError)):
        return True
    msg = str(e).lower()
    return isinstance(e, RuntimeError) and ("out of memory" in msg or "can't allocate memory" in msg)


class NvmlSampler:
    """Sample NVML GPU utilization in a background thread; NaN when NVML is unavailable."""

    def __init__(self, torch_device_index: int, sample_ms: float) -> None:
        self._handle: Any = None
        self._nvml: Any = None
        self._samples: list[float] = []
        self._stop = threading.Event()
        self._period_s = max(sample_ms, 1.0) / 1e3
        self._thread: threading.Thread | None = None
        try:
            import pynvml  # nvidia-ml-py
            import torch

            pynvml.nvmlInit()
            self._nvml = pynvml
            props = torch.cuda.get_device_properties(torch_device_index)
            uuid = str(getattr(props, "uuid", "") or "")
            if uuid:
                # torch gives the bare UUID; NVML names a whole GPU "GPU-..." and a MIG instance "MIG-..."
                for name in ((uuid,) if uuid.startswith(("GPU-", "MIG-")) else (f"GPU-{uuid}", f"MIG-{uuid}")):
                    try:
                        self._handle = pynvml.nvmlDeviceGetHandleByUUID(name)
                        break
                    except pynvml.NVMLError:
                        continue
                if self._handle is None:
                    raise LookupError(f"NVML knows no device with UUID {uuid}")
            else:
                self._handle = pynvml.nvmlDeviceGetHandleByIndex(torch_device_index)
        except Exception:  # noqa: BLE001 - NVML missing or unsupported (MIG): utilization is NaN
            self._handle = None

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._samples.append(float(self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu))
            except Exception:  # noqa: BLE001
                return
            self._stop.wait(self._period_s)

    def __enter__(self) -> Self:
        if self._handle is not None:
            self._thread = threading.Thread(target=self._run, name="hpcsplit-nvml", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def mean_fraction(self) -> float:
        # NVML reports the share of the last sample period with a kernel running; the first
        # sample may cover time before the window, so drop it when there are others.
        s = self._samples[1:] if len(self._samples) > 1 else self._samples
        return float(np.mean(s)) / 100.0 if s else math.nan


def time_latency_ms(fn: Callable[..., Any], inputs: Sequence[Any], *, warmup: int = 2, iters: int = 10,
                    device: Any = "cpu") -> list[float]:
    """Latencies (ms) of ``iters`` runs of ``fn(*inputs)`` after ``warmup`` untimed ones, timed as
    :func:`measure_callable` times them (CUDA events on GPU), without its memory and utilization figures."""
    import torch

    dev = torch.device(device)
    never = lambda: False
    with torch.no_grad():
        for _ in range(warmup):
            fn(*inputs)
        if dev.type == "cuda":
            return time_cuda(fn, inputs, dev, iters, 0.0, 0.0, never)[0]
        return time_cpu(fn, inputs, iters, torch.get_num_threads(), never)[0]


def time_cpu(
    fn: Callable[..., Any], inputs: Sequence[Any], iters: int, threads: int, check: Callable[[], bool]
) -> tuple[list[float], float, Any]:
    lat = []
    out = None
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for _ in range(iters):
        if check():
            raise CellAbandoned
        t0 = time.perf_counter()
        out = fn(*inputs)
        lat.append((time.perf_counter() - t0) * 1e3)
    cpu1, wall1 = time.process_time(), time.perf_counter()
    busy = (cpu1 - cpu0) / max((wall1 - wall0) * threads, 1e-12)
    return lat, float(busy), out


def time_cuda(
    fn: Callable[..., Any],
    inputs: Sequence[Any],
    dev: Any,
    iters: int,
    util_window_ms: float,
    util_sample_ms: float,
    check: Callable[[], bool],
) -> tuple[list[float], float, float, Any]:
    import torch

    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    before = torch.cuda.memory_allocated(dev)  # parameters, inputs and anything else resident
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    out = None
    for start, end in ev:
        if check():
            raise CellAbandoned
        start.record()
        out = fn(*inputs)
        end.record()
    torch.cuda.synchronize(dev)
    lat = [start.elapsed_time(end) for start, end in ev]
    act_peak = float(torch.cuda.max_memory_allocated(dev) - before)
    util = math.nan
    if util_window_ms > 0:
        sampler = NvmlSampler(dev.index or 0, util_sample_ms)
        deadline = time.perf_counter() + util_window_ms / 1e3
        with sampler:
            while time.perf_counter() < deadline and not check():
                out = fn(*inputs)
                torch.cuda.synchronize(dev)
        util = sampler.mean_fraction()
    return lat, act_peak, util, out


def full_fp32_on_gpu() -> None:
    """Keep float32 convolutions in float32 on CUDA (cuDNN's default is TF32; matmuls already are).

    Profiling and serving both call it, so the profile times the kernels the plan serves, and served
    outputs match the eager model within ``runtime.verify_atol``/``verify_rtol`` (TF32 keeps 10 mantissa
    bits: errors of ~1e-3 that grow through the layers).
    """
    import torch

    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False


def apply_slice(kind: str, slice_value: float, dev: Any) -> None:
    import torch

    if kind == "cuda":
        full_fp32_on_gpu()
        frac = slice_fraction(slice_value, torch.cuda.get_device_properties(dev).total_memory)
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(frac, dev)
    else:
        torch.set_num_threads(int(slice_value))


def cores_here() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def device_meta(kind: str, dev: Any) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "torch_version": torch.__version__,
        "cuda_version": str(torch.version.cuda or ""),
        "driver_version": "",
        "mig_device": "",
        "mps_active_thread_percentage": os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", ""),
        "mps_pinned_device_mem_limit": os.environ.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", ""),
    }
    if kind == "cuda":
        props = torch.cuda.get_device_properties(dev)
        info["device_name"] = props.name
        info["device_mem_bytes"] = int(props.total_memory)
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        if "MIG-" in visible:
            info["mig_device"] = visible
        try:
            import pynvml

            pynvml.nvmlInit()
            drv = pynvml.nvmlSystemGetDriverVersion()
            info["driver_version"] = drv.decode() if isinstance(drv, bytes) else str(drv)
        except Exception:  # noqa: BLE001 - NVML missing: driver unknown
            info["driver_version"] = "unknown (NVML unavailable)"
        info["slice_semantics"] = (
            "slice = GPU memory in GB (GiB, 2**30 bytes) per process; soft cap via per-process memory fraction "
            "(torch.cuda.set_per_process_memory_fraction = slice / device memory): PyTorch's allocator raises "
            "out-of-memory beyond it, but compute is shared and memory outside PyTorch's allocator is not "
            "limited. Hard limits only come from MIG (mig_device) or MPS (mps_* attributes)."
        )
        info["latency_timer"] = "cuda_events"
        info["peak_mem_method"] = (
            "param_bytes + input bytes + (torch.cuda.max_memory_allocated over the timed runs - "
            "memory_allocated before them)"
        )
        info["utilization_method"] = "NVML utilization.gpu mean over a steady window (NaN without NVML)"
    else:
        info["device_name"] = _cpu_name()
        info["device_mem_bytes"] = 0
        info["slice_semantics"] = (
            "slice = CPU threads of the rank (torch.set_num_threads); utilization = threads / cores_per_node"
        )
        info["latency_timer"] = "time.perf_counter"
        info["peak_mem_method"] = (
            "param_bytes + input bytes + peak live bytes of op-allocated storages in one traced run "
            "(TorchDispatchMode); excludes kernel workspaces and malloc caching"
        )
        info["utilization_method"] = "threads / cores_per_node (measured busy share in cpu_busy_fraction)"
    return info


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return "cpu: " + line.split(":", 1)[1].strip()
    except OSError:
        pass
    return f"cpu: {platform.processor() or platform.machine()}"


def free_device_copy(sb: Any, name: str, dev: Any) -> None:
    """Give back the GPU memory of ``name``'s program on ``dev`` once the caller has dropped it.

    A switchboard caches the programs it moved to a device (:meth:`~hpcsplit.switchboard.reader.Switchboard.unload`
    drops one); without this the parameters stay on the GPU and count against the next program's slice cap.
    """
    import torch

    forget = getattr(sb, "unload", None)
    if forget is not None:
        forget(name, dev)
    gc.unfreeze()  # a program frozen while it served is a cycle the collector skips ([Note: frozen heap])
    gc.collect()
    torch.cuda.empty_cache()


def load_on_device(sb: Any, name: str, dev: Any) -> tuple[Callable[..., Any], Callable[[], None]]:
    """``sb.load_component(name)`` on ``dev``; returns ``(fn, release)``.

    On GPU: ``load_component(name, device=...)`` when the switchboard supports it, else the
    returned module's ``.to(dev)``, else the modules the callable closes over are moved in
    place.  ``release()`` frees this component's device copy (drops the switchboard's cached program,
    or moves what we moved back to the CPU), so that the next component's memory figures and slice cap
    do not include this one's parameters.
    """
    if getattr(dev, "type", "cpu") != "cuda":
        return sb.load_component(name), lambda: None
    import torch

    try:
        by_device = "device" in inspect.signature(sb.load_component).parameters
    except (TypeError, ValueError):
        by_device = False
    if by_device:
        return sb.load_component(name, device=dev), lambda: free_device_copy(sb, name, dev)
    fn = sb.load_component(name)
    if isinstance(fn, torch.nn.Module):
        held = [fn]
    else:
        held = [v for v in (getattr(fn, "__defaults__", None) or ()) if isinstance(v, torch.nn.Module)]
        held += [
            c.cell_contents
            for c in (getattr(fn, "__closure__", None) or ())
            if isinstance(getattr(c, "cell_contents", None), torch.nn.Module)
        ]
    if not held:
        raise ProfileError(
            f"component {name!r}: cannot move it to {dev}: load_component returned a {type(fn).__name__} "
            "without modules to move; the switchboard needs load_component(name, device=...)."
        )
    for m in held:
        m.to(dev)

    def release() -> None:
        for m in held:
            m.to("cpu")
        torch.cuda.empty_cache()

    return fn, release
