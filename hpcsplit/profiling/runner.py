"""The profile stage's work: measure every component x batch size x slice into an HDF5 profile.

:func:`profile_components` runs on one process; :func:`profile_components_mpi` divides the missing
cells among MPI ranks (one per GPU), each rank writes a part file, and rank 0 merges them into one
profile (see ``docs/profile-format.md`` and [Note: profile crash safety] in
:mod:`hpcsplit.core.profile_writer`).  :mod:`hpcsplit.profiling.stage` reads the config and calls them.

See [Note: profile measurement] in :mod:`hpcsplit.profiling.measure` for what is measured and how.
"""

from __future__ import annotations

import datetime as _dt
import math
import os
import re
import signal
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch

from hpcsplit.core.device import CellAbandoned, apply_slice, cores_here, device_meta, load_on_device
from hpcsplit.core.profile_format import (
    SCHEMA_VERSION,
    CellResult,
    ComponentLayout,
    ProfileMeta,
)
from hpcsplit.core.profile_writer import ProfileWriter
from hpcsplit.errors import ProfileError, ProfileFormatError
from hpcsplit.profiling.measure import StopOnSignal, call_previous_handler, measure_callable
from hpcsplit.switchboard.reader import Switchboard

__all__ = ["ProfileOptions", "default_batch_sizes", "profile_components", "profile_components_mpi"]


def _package_version() -> str:
    """hpcsplit's version from the package metadata (recorded in every profile)."""
    try:
        return version("hpcsplit")
    except PackageNotFoundError:  # a source tree that was never installed
        return "0+unknown"


HPCSPLIT_VERSION = _package_version()


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
class ProfileOptions:
    """What one profile run measures and how: the grid (batch sizes x slices), the device kind and the
    runs per cell.

    The profile stage builds it from the config as :class:`hpcsplit.profiling.stage.ProfileSettings`
    (a subclass); :func:`profile_components` from its arguments.
    """

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


def _meta(sb: Any, s: ProfileOptions, dev: Any, names: Sequence[str]) -> ProfileMeta:
    info = device_meta(s.device_kind, dev)
    return ProfileMeta(
        schema_version=SCHEMA_VERSION,
        hpcsplit_version=HPCSPLIT_VERSION,
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
        A :class:`hpcsplit.switchboard.reader.Switchboard` or its directory.
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
    s = ProfileOptions(
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
    s: ProfileOptions,
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


def profile_components_mpi(
    switchboard: Any, s: ProfileOptions, out: str | Path, comm: Any, rank_silence_s: float
) -> dict[str, Any] | None:
    """:func:`hpcsplit.profiling.stage.mpi_main` without the config: profile ``switchboard`` on every
    rank of the MPI communicator ``comm``; a rank silent for ``rank_silence_s`` (``profile.rank_silence_s``)
    at the final gather is named and the job ends.

    Returns rank 0's summary (None on the other ranks).
    """
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
    unknown = [n for n in names if n not in sb.components]
    if unknown:
        raise ProfileError(f"profile.components names {unknown}, not components of {switchboard}; valid: "
                           f"{list(sb.components)} (or profile.components=null for all)")
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
    summaries = _gather_summaries(comm, summary, out, rank_silence_s)
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


_TAG_SUMMARY = 7301


def _gather_summaries(comm: Any, summary: dict[str, Any], out: Path,
                      silence_s: float) -> list[dict[str, Any]] | None:
    """Every rank's summary on rank 0 (None elsewhere), waiting without a spin and with a deadline.

    A rank still measuring flushes a cell into its part file at least every few minutes, so rank 0
    waits as long as each missing rank's part file keeps changing; one silent for ``silence_s``
    (``profile.rank_silence_s``: stopped, stuck) is named, with its host, in a :class:`ProfileError` and the
    job aborts.  The other ranks wait for rank 0 to take their summary twice as long, then give up themselves
    (rank 0 is gone: no rank outlives its job).
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    host = socket.gethostname()
    if rank != 0:
        req = comm.isend((summary, host), dest=0, tag=_TAG_SUMMARY)
        t_end = time.monotonic() + 2 * silence_s
        while not req.Test():
            if time.monotonic() > t_end:
                raise ProfileError(f"profile: rank {rank} on {host}: rank 0 did not take this rank's summary within "
                                   f"{2 * silence_s:g} s (profile.rank_silence_s x 2); it is stopped or gone. The "
                                   "finished cells are kept: run the profile again to measure the rest")
            time.sleep(0.05)  # rank 0 aborts the job if it gives up on us
        return None
    got: dict[int, dict[str, Any]] = {0: summary}
    since = {r: time.monotonic() for r in range(1, size)}
    seen: dict[int, float] = {}
    from hpcsplit.core.mpi import MPI

    st = MPI.Status()
    while len(got) < size:
        if comm.Iprobe(source=MPI.ANY_SOURCE, tag=_TAG_SUMMARY, status=st):
            src = st.Get_source()
            got[src] = comm.recv(source=src, tag=_TAG_SUMMARY)[0]
            continue
        now = time.monotonic()
        for r in range(1, size):
            if r in got:
                continue
            try:
                m = _part_path(out, r).stat().st_mtime
            except OSError:
                m = None
            if m is not None and m != seen.get(r):
                seen[r], since[r] = m, now
            if now - since[r] > silence_s:
                raise ProfileError(
                    f"profile: rank {r} wrote no cell to {_part_path(out, r).name} and sent no summary for "
                    f"{silence_s:g} s (profile.rank_silence_s; rank 0 on {host}); it is stopped or stuck. Its "
                    "finished cells are kept: run the profile again to measure the rest (raise "
                    "profile.rank_silence_s if one cell takes longer)"
                )
        time.sleep(0.05)
    return [got[r] for r in range(size)]


def _merge_parts(w: ProfileWriter, out: Path) -> int:
    """Fold every part file of ``out`` (``<out>.part<rank>``) into ``w`` and remove it (and its lock).

    Runs on rank 0 while no rank writes a part: before the cells are divided and after they are gathered.
    """
    n = 0
    part_name = re.compile(re.escape(out.name) + r"\.part\d+")
    for part in sorted(out.parent.glob(f"{out.name}.part*")):
        if part.name.endswith(".creating"):
            part.unlink(missing_ok=True)
            continue
        if not part_name.fullmatch(part.name):
            continue  # a part's lock file (removed with its part below)
        try:
            n += w.merge_from(part)
        except (OSError, ProfileFormatError) as e:  # a part never written whole: its cells are measured again
            print(f"[rank 0] ignoring unreadable part file {part}: {e}", file=sys.stderr, flush=True)
        part.unlink(missing_ok=True)
        part.with_name(part.name + ".lock").unlink(missing_ok=True)
    return n
