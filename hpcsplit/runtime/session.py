"""What each rank does once set up (``[Note: serve rank lifecycle]`` in :mod:`worker`).

Frontend: per variant, wait for the component ranks, check end-to-end outputs against the reference,
then run batch mode (inputs file -> outputs file) or the benchmark levels; STOP; collect counters.
Component ranks: per variant, load their callable, check it, serve until STOP.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hpcsplit._profile_measure import free_device_copy, is_oom, time_latency_ms
from hpcsplit.errors import RequestTimeoutError, RuntimeStageError, VerificationError
from hpcsplit.runtime import transport as tp
from hpcsplit.runtime.frontend import STATUS_OK, Frontend
from hpcsplit.runtime.routing import WHOLE, Dataflow
from hpcsplit.runtime.trace import Tracer

__all__ = ["Context", "read_inputs", "run_component_rank", "run_frontend", "write_outputs"]

_TAG_STATS = 7201
_FLOOR_WAIT_SLEEP_S = 0.02  # ranks waiting for another's floor timing wake at most 50 times a second


@dataclass(frozen=True, slots=True)
class Context:
    """Everything a rank set up in :func:`worker.mpi_main`."""

    comm: Any
    cfg: dict[str, Any]
    rt: dict[str, Any]
    plan: Any
    sb: Any
    run_dir: Path
    device: Any
    threads: Any


def _say(rank: int, msg: str) -> None:
    print(f"[rank {rank}] {msg}", file=sys.stderr, flush=True)


def _barrier(comm: Any, while_waiting: Any = None, max_sleep_s: float = 1e-3) -> None:
    """A barrier that waits without spinning (``Ibarrier`` + backoff polling to ``max_sleep_s``), calling
    ``while_waiting``."""
    req = comm.Ibarrier()

    def _done() -> bool:
        if while_waiting is not None:
            while_waiting()
        return bool(req.Test())

    tp.wait_polling(_done, max_sleep_s=max_sleep_s)


def _tracer(ctx: Context, label: str) -> Tracer:
    tr = ctx.rt.get("trace") or {}
    return Tracer(ctx.comm.Get_rank(), tr.get("start_step"), tr.get("end_step"), label)


# --------------------------------------------------------------------------------- component ranks
def _load_callable(ctx: Context, variant: str, name: str) -> Any:
    """This rank's callable; on CUDA placed on the rank's device (the loader's ``device=`` or ``.to``)."""
    import inspect

    loader = ctx.sb.load_whole if name == WHOLE else ctx.sb.load_component
    args = () if name == WHOLE else (name,)
    on_gpu = getattr(ctx.device, "type", "cpu") == "cuda"
    if on_gpu and "device" in inspect.signature(loader).parameters:
        return loader(*args, device=ctx.device)
    fn = loader(*args)
    if on_gpu:
        if not hasattr(fn, "to"):
            raise RuntimeStageError(
                f"rank {ctx.comm.Get_rank()}: the switchboard's loader returned a callable that cannot be "
                f"moved to {ctx.device} (no device= argument, no .to); this hpcsplit cannot serve "
                f"{name!r} on a GPU"
            )
        fn = fn.to(ctx.device)
    return fn


def _example_inputs(ctx: Context, name: str, batch: int) -> tuple[torch.Tensor, ...]:
    if name == WHOLE:
        return tuple(ctx.sb.example_inputs(batch))
    return tuple(ctx.sb.component_example_inputs(batch)[name])


def _check_component(ctx: Context, df: Dataflow, name: str, fn: Any, batch: int) -> float:
    """Run ``fn`` once on the switchboard's example activations; check output count, batch and finiteness."""
    from hpcsplit.runtime.worker import _as_tuple

    rank = ctx.comm.Get_rank()
    flow = df.component(name)
    args = tuple(a.to(ctx.device) for a in _example_inputs(ctx, name, batch))
    t0 = time.perf_counter()
    with torch.inference_mode():
        outs = _as_tuple(fn(*args))
    dt = time.perf_counter() - t0
    problems = []
    if len(outs) != len(flow.outputs):
        problems.append(f"returned {len(outs)} outputs, the switchboard lists {len(flow.outputs)}")
    for o, oname, bd in zip(outs, flow.outputs, flow.out_bdims, strict=False):
        if not isinstance(o, torch.Tensor) or any(o.ndim <= d or o.shape[d] != batch for d in bd):
            problems.append(f"output {oname!r} is {getattr(o, 'shape', type(o))}, needs {batch} in dims {bd}")
        elif o.is_floating_point() and not bool(torch.isfinite(o).all()):
            problems.append(f"output {oname!r} has non-finite values")
    if problems:
        raise VerificationError(f"rank {rank}: component {name!r} on its example inputs: " + "; ".join(problems))
    return dt


def floor_turns(ctx: Context, df: Dataflow, vname: str) -> list[int]:
    """Ranks that time their component before the split levels, in turn: the first replica of each.

    [Note: floor re-measured]
    The critical-path floor comes from the profile, measured in another process, minutes or hours earlier.
    On a shared or virtual machine the same batch-1 run can take 20% more or less from one minute to the
    next, which is as large as the target (within 10% of the floor).  So in bench mode, before the split
    levels, the first replica of every component runs ``bench.floor_runs`` batches of one back to back,
    one rank at a time (the others wait at a non-spinning barrier), as the profile times them; the bench
    prints the floor from these beside the profile's.  The waiting ranks poll their barrier at most every
    20 ms rather than every 1 ms, so as not to take the core from the rank being timed.  Empty unless
    bench mode, the split variant and
    ``bench.floor_runs`` > 0; every rank computes the same list.
    """
    from hpcsplit.runtime.bench import bench_settings

    if ctx.rt["mode"] != "bench" or vname != "split" or int(bench_settings(ctx.cfg)["floor_runs"]) <= 0:
        return []
    first: dict[str, int] = {}
    for r, c in sorted(df.rank_component.items()):
        first.setdefault(c, r)
    return sorted(first.values())


def _measure_floor(ctx: Context, df: Dataflow, vname: str, name: str, fn: Any) -> list[float]:
    """This rank's turn of ``[Note: floor re-measured]``: ms per batch of one, or [] if it has no turn."""
    from hpcsplit.runtime.bench import bench_settings

    comm = ctx.comm
    rank = comm.Get_rank()
    samples: list[float] = []
    turns = floor_turns(ctx, df, vname)
    for turn in turns:
        if turn == rank:
            n = int(bench_settings(ctx.cfg)["floor_runs"])
            args = tuple(a.to(ctx.device) for a in _example_inputs(ctx, name, 1))
            samples = time_latency_ms(fn, args, warmup=2, iters=n, device=ctx.device)  # the profile's timer
            _say(rank, f"{vname}: {name!r} batch of one, back to back: p50 {float(np.median(samples)):.2f} ms "
                       f"({n} runs)")
        _barrier(comm, max_sleep_s=_FLOOR_WAIT_SLEEP_S)
    return samples


def load_variant(ctx: Context, df: Dataflow, vname: str, name: str, slice_gb: float | None) -> Any:
    """This rank's program for one variant, checked on its example inputs (``runtime.verify``).

    On a GPU, running out of memory in the rank's slice stops the job with the slice and the fix.
    """
    rank = ctx.comm.Get_rank()
    try:
        fn = _load_callable(ctx, vname, name)
        if ctx.rt.get("verify", True):
            bs = df.batch_size_of(rank)
            dt = _check_component(ctx, df, name, fn, bs)
            _say(rank, f"{vname}: {name!r} runs on its example inputs (batch {bs}, {dt * 1e3:.1f} ms)")
    except Exception as e:
        if getattr(ctx.device, "type", "cpu") != "cuda" or not is_oom(e):
            raise
        what = ("the unsplit model (the benchmark's baseline runs it on the split's ranks, each in that "
                "rank's slice)" if name == WHOLE else f"component {name!r}")
        why = (str(e).splitlines() or [type(e).__name__])[0]
        raise RuntimeStageError(
            f"rank {rank}: {what} does not fit in this rank's GPU memory slice ({slice_gb} GB) at batch "
            f"{df.batch_size_of(rank)}: {why}. Give the cluster larger cluster.slices_gb and allocate again"
            + (", or serve without the baseline (stage=serve)." if name == WHOLE else
               "; if the profile measured it in this slice, other processes hold memory on this GPU.")
        ) from e
    return fn


def run_component_rank(ctx: Context, variants: list[tuple[str, Dataflow]], entry: Any) -> None:
    from hpcsplit.runtime.worker import _with_fault, serve_component

    comm, rt = ctx.comm, ctx.rt
    rank = comm.Get_rank()
    tracer = _tracer(ctx, str(entry.component))
    all_stats = []
    on_gpu = getattr(ctx.device, "type", "cpu") == "cuda"
    for vname, df in variants:
        name = df.rank_component[rank]
        fn = load_variant(ctx, df, vname, name, entry.slice_gb)
        floor = _measure_floor(ctx, df, vname, name, fn)
        fn = _with_fault(fn, rt.get("fault"), name)
        _barrier(comm)
        st = serve_component(comm, df, name, fn, df.batch_size_of(rank), float(rt["max_wait_ms"]) / 1e3,
                             float(rt["request_timeout_s"]), tracer, ctx.device, float(rt["abort_grace_s"]),
                             float(rt["idle_sleep_ms"]) / 1e3)
        st["variant"] = vname
        if floor:
            st["floor_samples_ms"] = floor
        all_stats.append(st)
        if on_gpu:  # the next variant's program gets this one's memory (the slice cap counts cached blocks)
            del fn
            free_device_copy(ctx.sb, name, ctx.device)
    tracer.write(ctx.run_dir)
    # counters and up to 2 x 20,000 batch-1 compute samples per variant (a few hundred KB; no tensors)
    req = comm.isend(all_stats, dest=0, tag=_TAG_STATS)
    tp.wait_polling(req.Test)
    _barrier(comm)


# --------------------------------------------------------------------------------------- frontend
def _reference(ctx: Context) -> tuple[list[torch.Tensor], list[torch.Tensor], str]:
    """Inputs and expected outputs for the end-to-end check: the switchboard's golden pair."""
    sb = ctx.sb
    ins = [torch.as_tensor(x) for x in sb.example_inputs()]
    outs = [torch.as_tensor(x) for x in sb.golden_outputs()]
    return ins, outs, f"golden outputs of the eager model, {len(outs)} output(s)"


def _getter(df: Dataflow, inputs: list[torch.Tensor], modulo: int | None = None) -> Any:
    """``idx -> [tensor per model input]`` selecting requests along each input's batch dim."""
    from hpcsplit.runtime.batching import take_requests

    bd = df.input_bdims

    def get(idx: np.ndarray) -> list[torch.Tensor]:
        pos = (idx % modulo if modulo else idx).tolist()
        return [take_requests(x, bd[i], pos) for i, x in enumerate(inputs)]

    return get


def _run_rows(fe: Frontend, inputs: list[torch.Tensor], rt: dict[str, Any],
              out: dict[int, list[torch.Tensor]] | None = None) -> Any:
    n = int(inputs[0].shape[fe.df.input_bdims[0][0]])
    get = _getter(fe.df, inputs)

    def done(i: int, rows: list[torch.Tensor]) -> None:
        if out is not None:
            out[i] = [r.clone() for r in rows]

    return fe.run(np.zeros(n), get, done if out is not None else None,
                  float(rt["request_timeout_s"]), int(rt["max_inflight"]))


def host_row(r: torch.Tensor, rdim: int) -> np.ndarray:
    """One request's output (size 1 along ``rdim``) as the numpy array batch mode writes.

    numpy has no bfloat16: those are written as float32, which holds every bfloat16 value exactly.

    Examples
    --------
    >>> host_row(torch.ones(3, 1, dtype=torch.bfloat16), 1).dtype
    dtype('float32')
    """
    row = r.movedim(rdim, 0)[0].cpu()
    if row.dtype == torch.bfloat16:
        row = row.float()
    return row.numpy()


def _check_end_to_end(ctx: Context, fe: Frontend, vname: str) -> dict[str, Any]:
    from hpcsplit.runtime.batching import take_requests

    rt = ctx.rt
    ins, ref, what = _reference(ctx)
    got: dict[int, list[torch.Tensor]] = {}
    res = _run_rows(fe, ins, rt, got)
    if not res.ok.all():
        raise RuntimeStageError(f"{vname}: end-to-end check: {int((~res.ok).sum())} of {len(res.ok)} requests "
                                "failed (timed out); see the log for the component that is stuck")
    worst = 0.0
    n = len(res.ok)
    for j, r0 in enumerate(ref):
        bd = fe.df.output_bdims[j]
        r = take_requests(r0, bd, list(range(n)))
        y = torch.cat([got[i][j] for i in range(n)], bd[0])
        if y.shape != r.shape or not torch.allclose(y.float(), r.float(), atol=float(rt["verify_atol"]),
                                                    rtol=float(rt["verify_rtol"])):
            diff = (y.float() - r.float()).abs().max().item() if y.shape == r.shape else float("inf")
            raise VerificationError(
                f"{vname}: served output {j} ({fe.df.outputs[j]}) differs from the reference ({what}): "
                f"max |diff| {diff:.3g}, shapes {tuple(y.shape)} vs {tuple(r.shape)}, tolerance "
                f"atol={rt['verify_atol']} rtol={rt['verify_rtol']}"
            )
        worst = max(worst, (y.float() - r.float()).abs().max().item())
    _say(0, f"{vname}: end-to-end outputs of {len(res.ok)} requests match the reference ({what}), "
            f"max |diff| {worst:.2e}")
    return {"samples": len(res.ok), "reference": what, "max_abs_diff": worst}


def _collect_stats(ctx: Context, fe: Frontend) -> list[dict[str, Any]]:
    from hpcsplit._mpi import MPI

    comm = ctx.comm
    out: list[dict[str, Any]] = []

    def _ready(st: Any) -> bool:
        fe.drop_strays()  # late outputs of timed-out requests: receive and drop them
        return bool(comm.Iprobe(source=MPI.ANY_SOURCE, tag=_TAG_STATS, status=st))

    for _ in range(comm.Get_size() - 1):
        st = MPI.Status()
        tp.wait_polling(lambda st=st: _ready(st))
        out.extend(comm.recv(source=st.Get_source(), tag=_TAG_STATS))
    return sorted(out, key=lambda s: (s.get("variant", ""), s["rank"]))


def run_frontend(ctx: Context, variants: list[tuple[str, Dataflow]]) -> dict[str, Any]:
    rt = ctx.rt
    comm = ctx.comm
    tracer = _tracer(ctx, "frontend")
    summary: dict[str, Any] = {"mode": rt["mode"], "world_size": comm.Get_size(), "model": ctx.plan.model,
                               "threads": ctx.threads.describe(), "variants": {}}
    next_id = 0
    bench_results: dict[str, Any] = {}
    fe: Frontend | None = None
    for vname, df in variants:
        prev = fe
        fe = Frontend(comm, df, tracer, float(rt["idle_sleep_ms"]) / 1e3)
        fe.next_id = next_id
        for _ in floor_turns(ctx, df, vname):  # the component ranks time their floor, in turn
            _barrier(comm, prev.drop_strays if prev is not None else None, _FLOOR_WAIT_SLEEP_S)
        # every component rank has loaded and checked its callable (and sent the last variant's strays)
        _barrier(comm, prev.drop_strays if prev is not None else None)
        try:
            vsum: dict[str, Any] = {}
            if rt.get("verify", True):
                vsum["end_to_end"] = _check_end_to_end(ctx, fe, vname)
            if rt["mode"] == "batch":
                vsum.update(_batch_mode(ctx, fe))
            else:
                from hpcsplit.runtime.bench import run_levels

                bench_results[vname] = run_levels(ctx, fe, vname)
            summary["variants"][vname] = vsum
        finally:
            next_id = fe.next_id
        fe.stop_all()
    assert fe is not None
    summary["ranks"] = _collect_stats(ctx, fe)
    batch1: dict[tuple[str, str], list[tuple[float, float]]] = {}  # (variant, component) -> (end, ms)
    floor_now: dict[str, list[float]] = {}  # split component -> ms, [Note: floor re-measured]
    for st in summary["ranks"]:
        if st.get("wall_s"):
            st["cpu_pct_of_core"] = 100.0 * st["cpu_s"] / st["wall_s"]
        at, ms = st.pop("batch1_samples", ((), ()))
        batch1.setdefault((st.get("variant", ""), st["component"]), []).extend(zip(at, ms, strict=True))
        if st.get("floor_samples_ms"):
            floor_now[st["component"]] = list(st.pop("floor_samples_ms"))
    tracer.write(ctx.run_dir)
    _barrier(comm)
    if rt["mode"] == "bench":
        from hpcsplit.runtime.bench import finish

        summary.update(finish(ctx, bench_results, batch1, floor_now))
    failed = summary["variants"].get("split", {}).get("failed", 0)
    if rt["mode"] == "batch" and failed:
        raise RequestTimeoutError(
            f"{failed} request(s) exceeded runtime.request_timeout_s={rt['request_timeout_s']} s and were "
            f"reported failed (ids {summary['variants']['split']['failed_ids'][:10]}); the outputs of the "
            f"others are in {summary['variants']['split']['output_path']} (see its 'done' mask). Raise "
            "runtime.request_timeout_s or find the slow component in the per-rank counters."
        )
    return summary


# ------------------------------------------------------------------------------------- batch mode
def read_inputs(path: str | Path, names: tuple[str, ...]) -> list[np.ndarray]:
    """Model inputs from an ``.npz`` or HDF5 file: one array per input name (positional ``arr_i`` too)."""
    path = Path(path)
    if not path.exists():
        raise RuntimeStageError(f"runtime.input_path={path} does not exist; give an .npz or .h5 file "
                                f"with arrays {list(names)} (samples first)")
    if path.suffix == ".npz":
        with np.load(path, allow_pickle=False) as z:
            data = {k: z[k] for k in z.files}
    else:
        import h5py

        try:
            with h5py.File(path, "r") as f:
                data = {k: f[k][()] for k in f if hasattr(f[k], "shape")}
        except OSError as e:
            raise RuntimeStageError(f"cannot read {path} as HDF5: {e}") from e
    out = []
    for i, n in enumerate(names):
        arr = data.get(n, data.get(f"arr_{i}"))
        if arr is None:
            raise RuntimeStageError(f"{path} has arrays {sorted(data)}; the model needs {list(names)}")
        out.append(arr)
    lens = {a.shape[0] for a in out}
    if len(lens) != 1:
        raise RuntimeStageError(f"{path}: the inputs have different sample counts {sorted(lens)}")
    return out


def write_outputs(path: str | Path, names: tuple[str, ...], arrays: list[np.ndarray | None],
                  done: np.ndarray, latency_ms: np.ndarray) -> Path:
    """Write outputs in input order plus a ``done`` mask (rows not done are zeros) to .npz or HDF5."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {n: a for n, a in zip(names, arrays, strict=True) if a is not None}
    data["done"] = done.astype(bool)
    data["latency_ms"] = latency_ms
    if path.suffix == ".npz":
        np.savez(path, **data)  # type: ignore[arg-type]
    else:
        import h5py

        with h5py.File(path, "w") as f:
            for k, v in data.items():
                f.create_dataset(k.replace("/", "_"), data=v)
            f.attrs["outputs"] = list(names)
    return path


def _batch_mode(ctx: Context, fe: Frontend) -> dict[str, Any]:
    rt = ctx.rt
    names = fe.df.inputs
    if rt.get("input_path"):
        arrays = read_inputs(rt["input_path"], names)
        inputs = [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
        src = str(rt["input_path"])
    else:
        inputs = [torch.as_tensor(x) for x in ctx.sb.example_inputs(int(rt["num_samples"]))]
        src = f"switchboard example inputs x{rt['num_samples']}"
    bdi = fe.df.input_bdims
    inputs = [x.movedim(0, bdi[i][0]) if bdi[i][0] else x for i, x in enumerate(inputs)]
    n = int(inputs[0].shape[bdi[0][0]])
    out_path = Path(rt.get("output_path") or ctx.run_dir / "outputs.h5")
    outs: list[np.ndarray | None] = [None] * len(fe.df.outputs)
    get = _getter(fe.df, inputs)
    bdo = fe.df.output_bdims

    def done(i: int, rows: list[torch.Tensor]) -> None:
        for j, r in enumerate(rows):
            row = host_row(r, bdo[j][0])
            if outs[j] is None:
                outs[j] = np.zeros((n, *row.shape), dtype=row.dtype)
            outs[j][i] = row  # type: ignore[index]

    _say(0, f"batch mode: {n} requests from {src} -> {out_path}")
    try:
        res = fe.run(np.zeros(n), get, done, float(rt["request_timeout_s"]), int(rt["max_inflight"]))
    except BaseException:
        p = fe.partial
        write_outputs(out_path, fe.df.outputs, outs, p.status == STATUS_OK, p.latency_ms)
        _say(0, f"stopping on error: wrote the {int((p.status == STATUS_OK).sum())} finished of {n} outputs "
                f"to {out_path}")
        raise
    write_outputs(out_path, fe.df.outputs, outs, res.ok, res.latency_ms)
    lat = res.latency_ms[res.ok]
    failed_ids = [int(i) for i in np.flatnonzero(~res.ok)]
    _say(0, f"batch mode: {int(res.ok.sum())}/{n} done in {res.wall_s:.2f} s "
            f"({res.ok.sum() / res.wall_s:.1f} req/s), outputs in {out_path}")
    return {
        "requests": n, "done": int(res.ok.sum()), "failed": len(failed_ids), "failed_ids": failed_ids,
        "output_path": str(out_path), "wall_s": res.wall_s,
        "throughput_rps": float(res.ok.sum() / res.wall_s) if res.wall_s else None,
        "p50_ms": float(np.percentile(lat, 50)) if lat.size else None,
        "p99_ms": float(np.percentile(lat, 99)) if lat.size else None,
    }
