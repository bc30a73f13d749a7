"""The profile stage: measure every component x batch size x slice into an HDF5 profile.

:func:`profile_components` runs on one process; :func:`mpi_main` divides the missing cells
among MPI ranks (one per GPU), each rank writes a part file, and rank 0 merges them into
one profile (see ``docs/profile-format.md`` and [Note: profile crash safety] in
``profile_io.py``).

See [Note: profile measurement] in ``_profile_measure.py`` for what is measured and how.
"""

from __future__ import annotations

import datetime as _dt
import math
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcsplit._profile_measure import (
    GIB,
    CellAbandoned,
    Measurement,
    StopOnSignal,
    apply_slice,
    call_previous_handler,
    cores_here,
    device_meta,
    load_on_device,
    measure_callable,
)
from hpcsplit.errors import ConfigError, ProfileError
from hpcsplit.profile_io import (
    SCHEMA_VERSION,
    CellResult,
    ComponentLayout,
    ProfileMeta,
    ProfileWriter,
)

__all__ = [
    "Measurement",
    "ProfileJob",
    "ProfileSettings",
    "default_batch_sizes",
    "measure_callable",
    "mpi_main",
    "profile_components",
    "profile_components_mpi",
]


# ---------------------------------------------------------------------------------------------- settings


def default_batch_sizes(max_batch: int) -> tuple[int, ...]:
    """Powers of two up to ``max_batch`` (inclusive), plus ``max_batch`` itself.

    >>> default_batch_sizes(16)
    (1, 2, 4, 8, 16)
    >>> default_batch_sizes(6)
    (1, 2, 4, 6)
    """
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    out.append(max_batch)
    return tuple(out)


@dataclass(frozen=True, slots=True)
class ProfileSettings:
    """The profile stage's settings, resolved from ``cfg`` (``conf/profile/default.yaml``)."""

    batch_sizes: tuple[int, ...]
    slices: tuple[float, ...]
    device_kind: str  # "cuda" | "cpu"
    warmup: int
    iters: int
    util_window_ms: float
    util_sample_ms: float
    cores_per_node: int
    components: tuple[str, ...] | None
    progress: bool

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> ProfileSettings:
        """Read ``cfg["profile"]`` (and ``cfg["cluster"]`` for defaults); list every problem at once."""
        p = dict(cfg.get("profile") or {})
        cluster = dict(cfg.get("cluster") or {})
        problems: list[str] = []
        device = str(p.get("device") or "auto")
        if device not in {"auto", "cpu", "cuda"}:
            problems.append(f"profile.device={device!r}: use auto, cpu or cuda")
        kind = _device_kind(device)
        max_batch = int(p.get("max_batch") or 16)
        bs = p.get("batch_sizes")
        batch_sizes = tuple(int(b) for b in bs) if bs else default_batch_sizes(max_batch)
        if not batch_sizes or min(batch_sizes) < 1 or list(batch_sizes) != sorted(set(batch_sizes)):
            problems.append(f"profile.batch_sizes={bs!r}: need increasing positive integers")
        if kind == "cuda":
            sl = p.get("slices_gb") or cluster.get("slices_gb") or []
            if not sl:
                import torch

                sl = [round(torch.cuda.get_device_properties(0).total_memory / GIB, 3)]
        else:
            sl = p.get("threads") or cluster.get("cpu_threads") or [1]
        slices = tuple(float(s) for s in sl)
        if any(s <= 0 for s in slices) or list(slices) != sorted(set(slices)):
            problems.append(
                f"slices={list(sl)!r}: need increasing positive numbers (GB on GPU, threads on CPU)"
            )
        if kind == "cpu" and any(s != int(s) for s in slices):
            problems.append(f"profile.threads={list(sl)!r}: CPU slices are whole thread counts")
        warmup, iters = int(p.get("warmup", 2)), int(p.get("iters", 10))
        if warmup < 0 or iters < 1:
            problems.append(
                f"profile.warmup={warmup}, profile.iters={iters}: need warmup >= 0 and iters >= 1"
            )
        cores = cluster.get("cores_per_node") or cores_here()
        comps = p.get("components")
        if problems:
            raise ConfigError("invalid profile settings: " + "; ".join(problems))
        return cls(
            batch_sizes=batch_sizes,
            slices=slices,
            device_kind=kind,
            warmup=warmup,
            iters=iters,
            util_window_ms=float(p.get("util_window_ms", 500)),
            util_sample_ms=float(p.get("util_sample_ms", 20)),
            cores_per_node=int(cores),
            components=tuple(comps) if comps else None,
            progress=bool(p.get("progress", True)),
        )


def _device_kind(device: str) -> str:
    if device == "cpu":
        return "cpu"
    import torch

    if torch.cuda.is_available():
        return "cuda"
    if device == "cuda":
        raise ConfigError(
            "profile.device=cuda but torch.cuda.is_available() is False (CPU-only torch build or no GPU "
            "visible; SLURM gres alone does not provide CUDA); use profile.device=auto or cpu."
        )
    return "cpu"


# ---------------------------------------------------------------------------------------------- the loop


def _get(obj: Any, key: str, default: Any = None) -> Any:
    if isinstance(obj, dict):
        return obj.get(key, default)
    return getattr(obj, key, default)


def _layouts(sb: Any, names: Sequence[str]) -> list[ComponentLayout]:
    out = []
    for n in names:
        spec = sb.components[n]

        def per_sample(key: str, spec: Any = spec) -> int:
            return int(sum(int(_get(x, "bytes_per_sample", 0) or 0) for x in (_get(spec, key) or [])))

        out.append(
            ComponentLayout(
                n, int(_get(spec, "param_bytes", 0) or 0), per_sample("inputs"), per_sample("outputs")
            )
        )
    return out


def _meta(sb: Any, s: ProfileSettings, dev: Any, names: Sequence[str]) -> ProfileMeta:
    from hpcsplit import __version__

    info = device_meta(s.device_kind, dev)
    return ProfileMeta(
        schema_version=SCHEMA_VERSION,
        hpcsplit_version=__version__,
        switchboard_sha256=str(_get(sb, "sha256", "") or ""),
        model=str(_get(sb, "model_name", "") or ""),
        host=socket.gethostname(),
        device_kind=s.device_kind,
        created_utc=_dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        slice_unit="gb" if s.device_kind == "cuda" else "threads",
        cores_per_node=s.cores_per_node,
        warmup=s.warmup,
        iters=s.iters,
        component_order=tuple(names),
        **info,
    )


def _fmt_s(sec: float) -> str:
    sec = round(sec)
    return f"{sec // 3600}h{sec % 3600 // 60:02d}m" if sec >= 3600 else f"{sec // 60}m{sec % 60:02d}s"


def _load_switchboard(switchboard: Any) -> Any:
    if isinstance(switchboard, (str, Path)):
        from hpcsplit.switchboard import Switchboard

        return Switchboard.load(switchboard)
    return switchboard


def profile_components(
    switchboard: Any,
    *,
    batch_sizes: Sequence[int],
    slices: Sequence[float],
    warmup: int = 2,
    iters: int = 10,
    out: str | Path,
    device_kind: str | None = None,
    cores_per_node: int | None = None,
    util_window_ms: float = 500.0,
    util_sample_ms: float = 20.0,
    components: Sequence[str] | None = None,
    cells: Sequence[tuple[str, int, int]] | None = None,
    rank: int = 0,
    progress: bool = True,
    chain_signal: bool = True,
) -> dict[str, Any]:
    """Profile a switchboard's components into the HDF5 file ``out`` (created, or resumed).

    Parameters
    ----------
    switchboard
        A :class:`hpcsplit.switchboard.Switchboard` or its directory.
    batch_sizes, slices
        The grid: batch sizes (increasing) and slices (GB on GPU, threads on CPU).
    warmup, iters
        Untimed and timed runs per cell.
    out
        The profile file.  If it exists with the same grid it is resumed: measured cells are
        kept unchanged and only missing ones are measured.
    cells
        Only these ``(component, b_idx, s_idx)`` cells (MPI ranks get a share); default all.
    rank
        Recorded per cell in ``measured_by_rank`` and used in progress lines.
    chain_signal
        After stopping on SIGTERM/SIGUSR2 and flushing, call the handler installed before
        ours (submitit's checkpoint-and-requeue, if any).

    Returns
    -------
    dict
        ``path``, ``cells_measured`` (now), ``cells_requested``, ``cells_missing`` (in the file),
        ``complete``, ``interrupted``, ``signal`` (name of the signal that stopped it), ``wall_s``.

    Raises
    ------
    ProfileError
        ``out`` exists for another grid/switchboard, or a component failed (not by OOM).
    """
    import torch

    sb = _load_switchboard(switchboard)
    names = list(components) if components else list(sb.components)
    unknown = [n for n in names if n not in sb.components]
    if unknown:
        raise ProfileError(f"unknown component(s) {unknown}; the switchboard has {list(sb.components)}")
    bad = []
    if not batch_sizes or min(batch_sizes) < 1 or list(batch_sizes) != sorted(set(batch_sizes)):
        bad.append(f"batch_sizes={list(batch_sizes)} (need increasing positive integers)")
    if not slices or min(slices) <= 0 or list(slices) != sorted(set(slices)):
        bad.append(f"slices={list(slices)} (need increasing positive numbers)")
    if iters < 1 or warmup < 0:
        bad.append(f"iters={iters}, warmup={warmup} (need iters >= 1, warmup >= 0)")
    if bad:
        raise ProfileError("cannot profile with " + "; ".join(bad))
    kind = device_kind or ("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device("cpu")
    s = ProfileSettings(
        batch_sizes=tuple(int(b) for b in batch_sizes),
        slices=tuple(float(x) for x in slices),
        device_kind=kind,
        warmup=warmup,
        iters=iters,
        util_window_ms=util_window_ms,
        util_sample_ms=util_sample_ms,
        cores_per_node=int(cores_per_node or cores_here()),
        components=tuple(names),
        progress=progress,
    )
    layouts = _layouts(sb, names)
    t_start = time.perf_counter()
    threads_before = torch.get_num_threads()
    writer = ProfileWriter.open(
        out, meta=_meta(sb, s, dev, names), components=layouts, batch_sizes=s.batch_sizes, slices=s.slices
    )
    try:
        missing = set(writer.missing_cells())
        todo = [c for c in (cells if cells is not None else sorted(missing)) if c in missing]
        n_total, n_done = len(todo), 0
        inputs: dict[int, dict[str, Any]] = {}
        interrupted = False
        with StopOnSignal() as stop:
            for name in names:
                rows = sorted({(si) for (n, _b, si) in todo if n == name})
                if not rows:
                    continue
                fn, release = load_on_device(sb, name, dev)
                pbytes = next(lay.param_bytes for lay in layouts if lay.name == name)
                for si in rows:
                    apply_slice(kind, s.slices[si], dev)
                    row_todo = sorted(b for (n, b, x) in todo if n == name and x == si)
                    oom_at = writer.first_oom(name, si)
                    for bi in row_todo:
                        if stop.stopped:
                            break
                        if oom_at is not None and bi > oom_at:
                            writer.write_cell(_inferred_oom(name, bi, si, rank))
                        else:
                            try:
                                cell = _measure_cell(sb, fn, name, bi, si, s, dev, pbytes, rank, inputs, stop)
                            except CellAbandoned:
                                break  # a signal came mid-cell: leave it unmeasured and stop soon
                            writer.write_cell(cell)
                            if cell.oom:
                                oom_at = bi if oom_at is None else min(oom_at, bi)
                        n_done += 1
                        if progress:
                            _progress(rank, n_done, n_total, t_start, name, s.batch_sizes[bi], s.slices[si])
                    if stop.stopped:
                        break
                del fn
                release()
                if stop.stopped:
                    interrupted = True
                    break
            complete = writer.finish()
            signum = stop.signum
            interrupted = stop.stopped and not complete
        left = len(writer.missing_cells())
    finally:
        writer.close()
        torch.set_num_threads(threads_before)
    summary = {
        "path": str(out),
        "cells_measured": n_done,
        "cells_requested": n_total,
        "cells_missing": left,
        "complete": complete,
        "interrupted": interrupted,
        "signal": signal.Signals(signum).name if signum else None,
        "wall_s": round(time.perf_counter() - t_start, 3),
    }
    if interrupted and chain_signal and signum:
        call_previous_handler(signum)
    return summary


def _inferred_oom(name: str, bi: int, si: int, rank: int) -> CellResult:
    return CellResult(name, bi, si, (), math.nan, math.nan, math.nan, True, True, -1, -1, rank, time.time())


def _measure_cell(
    sb: Any,
    fn: Callable[..., Any],
    name: str,
    bi: int,
    si: int,
    s: ProfileSettings,
    dev: Any,
    pbytes: int,
    rank: int,
    cache: dict[int, dict[str, Any]],
    stop: StopOnSignal,
) -> CellResult:
    b = s.batch_sizes[bi]
    if b not in cache:  # activations of every component at this batch size, kept for the run
        cache[b] = sb.component_example_inputs(b)
    inputs = tuple(cache[b][name])
    if dev.type == "cuda":
        inputs = tuple(x.to(dev) if hasattr(x, "to") else x for x in inputs)
    m = measure_callable(
        fn,
        inputs,
        warmup=s.warmup,
        iters=s.iters,
        device=dev,
        param_bytes=pbytes,
        threads=int(s.slices[si]) if s.device_kind == "cpu" else None,
        cores_per_node=s.cores_per_node,
        util_window_ms=s.util_window_ms,
        util_sample_ms=s.util_sample_ms,
        stop=lambda: stop.stopped,
    )
    if m.oom:
        print(
            f"[rank {rank}] {name} batch {b} slice {s.slices[si]:g}: out of memory ({m.error[:200]})",
            flush=True,
        )
    return CellResult(
        component=name,
        b_idx=bi,
        s_idx=si,
        latency_ms=m.latency_ms,
        peak_mem_bytes=m.peak_mem_bytes,
        utilization=m.utilization,
        cpu_busy_fraction=m.cpu_busy_fraction,
        oom=m.oom,
        oom_inferred=False,
        input_bytes=m.input_bytes,
        output_bytes=m.output_bytes,
        rank=rank,
        measured_unix_s=time.time(),
    )


def _progress(rank: int, done: int, total: int, t0: float, name: str, b: int, sl: float) -> None:
    el = time.perf_counter() - t0
    eta = el / done * (total - done) if done else math.nan
    print(
        f"[rank {rank}] profile {done}/{total} cells ({100 * done / max(total, 1):.0f}%) "
        f"{name} b={b} slice={sl:g} elapsed {_fmt_s(el)} ETA {_fmt_s(eta) if done else '?'}",
        flush=True,
    )


# ---------------------------------------------------------------------------------------------- MPI stage


def _stage_paths(cfg: dict[str, Any], run_dir: Path) -> tuple[Path, Path]:
    paths = dict(cfg.get("paths") or {})
    sb = cfg.get("switchboard") or run_dir / str(paths.get("switchboard_dirname") or "switchboard")
    out = (cfg.get("profile") or {}).get("path") or run_dir / str(
        paths.get("profile_filename") or "profile.h5"
    )
    return Path(sb), Path(out)


def _part_path(out: Path, rank: int) -> Path:
    return out.with_name(f"{out.name}.part{rank}")


def _assign_rows(
    missing: Sequence[tuple[str, int, int]],
    size: int,
    weight: dict[str, float],
    slices: Sequence[float],
    kind: str,
) -> list[list[tuple[str, int, int]]]:
    """Give whole (component, slice) rows to ranks, heaviest first to the least loaded (LPT)."""
    rows: dict[tuple[str, int], list[tuple[str, int, int]]] = {}
    for c in missing:
        rows.setdefault((c[0], c[2]), []).append(c)

    def cost(key: tuple[str, int]) -> float:
        per_slice = 1.0 / slices[key[1]] if kind == "cpu" else 1.0
        return weight.get(key[0], 1.0) * len(rows[key]) * per_slice

    load = [0.0] * size
    share: list[list[tuple[str, int, int]]] = [[] for _ in range(size)]
    for key in sorted(rows, key=lambda k: (-cost(k), k)):
        r = min(range(size), key=lambda i: (load[i], i))
        load[r] += cost(key)
        share[r] += rows[key]
    return share


def mpi_main(cfg: dict[str, Any], run_dir: str, comm: Any | None = None) -> dict[str, Any] | None:
    """The profile stage on MPI ranks: divide the missing cells, profile, merge on rank 0.

    Rank 0 opens (or resumes) the profile, folds in part files left by an interrupted run and
    broadcasts the missing cells; every rank measures whole (component, slice) rows into its
    own part file (flushed per cell); rank 0 merges the parts into the profile and marks it
    complete when nothing is missing.  See [Note: stage entry points] (docs/architecture.md).

    Returns
    -------
    dict or None
        On rank 0 a summary (path, cells, complete, interrupted, wall time); None elsewhere.
    """
    s = ProfileSettings.from_config(cfg)
    sb_path, out = _stage_paths(cfg, Path(run_dir))
    return profile_components_mpi(sb_path, s, out, comm=comm)


def profile_components_mpi(
    switchboard: Any, s: ProfileSettings, out: str | Path, comm: Any | None = None
) -> dict[str, Any] | None:
    """:func:`mpi_main` without the config: profile ``switchboard`` on every rank of ``comm``.

    Returns rank 0's summary (None on the other ranks).
    """
    import torch

    from hpcsplit import _mpi

    comm = _mpi.get_comm(comm)
    rank, size = comm.Get_rank(), comm.Get_size()
    t0 = time.perf_counter()
    out = Path(out)
    if s.device_kind == "cuda":
        local = int(os.environ.get("SLURM_LOCALID", os.environ.get("MPI_LOCALRANKID", rank)))
        torch.cuda.set_device(local % torch.cuda.device_count())
        dev = torch.device("cuda", torch.cuda.current_device())
    else:
        dev = torch.device("cpu")
    sb = _load_switchboard(switchboard)
    names = list(s.components or sb.components)
    layouts = _layouts(sb, names)
    grid: dict[str, Any] = {
        "meta": _meta(sb, s, dev, names),
        "components": layouts,
        "batch_sizes": s.batch_sizes,
        "slices": s.slices,
    }
    missing: list[tuple[str, int, int]] | None = None
    if rank == 0:
        with ProfileWriter.open(out, **grid) as w:
            merged = _merge_parts(w, out)
            missing = w.missing_cells()
            if not missing:
                w.finish()
        n_cells = len(names) * len(s.batch_sizes) * len(s.slices)
        print(
            f"[rank 0] profile {out}: {n_cells - len(missing)}/{n_cells} cells already measured"
            f"{f' ({merged} merged from part files)' if merged else ''}; {size} rank(s)",
            flush=True,
        )
    missing = comm.bcast(missing, root=0)
    # cost of a row: the export's measured work_ms when known, else the parameter bytes
    weight = {
        lay.name: float(_get(sb.components[lay.name], "work_ms", 0) or 0) or float(lay.param_bytes + 1)
        for lay in layouts
    }
    mine = _assign_rows(missing, size, weight, s.slices, s.device_kind)[rank]
    summary: dict[str, Any] = {"cells_measured": 0, "interrupted": False, "signal": None}
    if mine:
        target = out if size == 1 else _part_path(out, rank)
        summary = profile_components(
            sb,
            batch_sizes=s.batch_sizes,
            slices=s.slices,
            warmup=s.warmup,
            iters=s.iters,
            out=target,
            device_kind=s.device_kind,
            cores_per_node=s.cores_per_node,
            util_window_ms=s.util_window_ms,
            util_sample_ms=s.util_sample_ms,
            components=names,
            cells=mine,
            rank=rank,
            progress=s.progress,
            chain_signal=False,
        )
    summaries = comm.gather(summary, root=0)
    result = None
    if rank == 0:
        assert summaries is not None
        with ProfileWriter.open(out, **grid) as w:
            _merge_parts(w, out)
            complete = w.finish()
            left = len(w.missing_cells())
        result = {
            "stage": "profile",
            "path": str(out),
            "ranks": size,
            "cells_total": len(names) * len(s.batch_sizes) * len(s.slices),
            "cells_measured_now": sum(int(x["cells_measured"]) for x in summaries),
            "cells_missing": left,
            "complete": complete,
            "interrupted": any(x["interrupted"] for x in summaries),
            "wall_s": round(time.perf_counter() - t0, 3),
            "device_kind": s.device_kind,
        }
        print(
            f"[rank 0] profile {'complete' if complete else 'INCOMPLETE'}: {out} "
            f"({result['cells_total'] - left}/{result['cells_total']} cells, {_fmt_s(result['wall_s'])})",
            flush=True,
        )
    signum = summary.get("signal")
    if signum and summary.get("interrupted"):
        # rank 0 merged and flushed above; a requeue handler (submitit's) acts on rank 0 only
        call_previous_handler(int(getattr(signal, signum)))
    return result


class ProfileJob:
    """A checkpointable submitit job function for the profile stage.

    Submit ``ProfileJob()(entry, cfg, run_dir)`` instead of ``hpcsplit._slurm.job_main`` (with
    ``max_num_timeout > 0``): on SLURM's USR2 warning or a preemption the ranks stop after their current run
    and flush, then submitit calls :meth:`checkpoint` and requeues the same call, which resumes
    the profile file.
    """

    def __init__(self, job_fn: str = "hpcsplit._slurm:job_main") -> None:
        self.job_fn = job_fn

    def __call__(self, entry: str, cfg: dict[str, Any], run_dir: str) -> Any:
        from hpcsplit._rank import resolve

        return resolve(self.job_fn)(entry, cfg, run_dir)

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        """Resubmit the same call (the profile file keeps what was measured)."""
        from submitit.helpers import DelayedSubmission

        return DelayedSubmission(self, *args, **kwargs)


def _merge_parts(w: ProfileWriter, out: Path) -> int:
    n = 0
    for part in sorted(out.parent.glob(f"{out.name}.part*")):
        if part.name.endswith(".creating"):
            part.unlink(missing_ok=True)
            continue
        try:
            n += w.merge_from(part)
        except OSError as e:  # a part file that never got written whole: its cells are measured again
            print(f"[rank 0] ignoring unreadable part file {part}: {e}", file=sys.stderr, flush=True)
        part.unlink(missing_ok=True)
    return n
