"""The frontend rank (rank 0) of the serve/bench job: per variant, check end-to-end, then batch or bench.

Per variant (``[Note: serve rank lifecycle]`` in :mod:`~hpcsplit.runtime.stage`): wait while the
component ranks load and check their programs (and time the floor, bench mode), send the golden inputs
through and compare with the golden outputs (``runtime.verify``), then serve the batch file (batch mode,
files in :mod:`~hpcsplit.runtime.batch_files`) or the benchmark levels (:mod:`~hpcsplit.runtime.benchmark`);
STOP.  At the end collect every rank's counters and return the summary.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hpcsplit.core.mpi import MPI
from hpcsplit.errors import RequestTimeoutError, RuntimeStageError, VerificationError
from hpcsplit.runtime import benchmark
from hpcsplit.runtime import transport as tp
from hpcsplit.runtime.batch_files import OutputWriter, check_output_path, host_row, read_inputs
from hpcsplit.runtime.batching import take_requests
from hpcsplit.runtime.context import FLOOR_WAIT_SLEEP_S, TAG_STATS, RankContext, floor_turns, say
from hpcsplit.runtime.faults import JobInterrupted, RankSilentError
from hpcsplit.runtime.frontend import STATUS_OK, Frontend, SessionResult, request_getter
from hpcsplit.runtime.routing import Dataflow

__all__ = ["run_frontend"]


def _reference(ctx: RankContext) -> tuple[list[torch.Tensor], list[torch.Tensor], str]:
    """Inputs and expected outputs for the end-to-end check: the switchboard's golden pair."""
    sb = ctx.switchboard
    ins = [torch.as_tensor(x) for x in sb.example_inputs()]
    outs = [torch.as_tensor(x) for x in sb.golden_outputs()]
    return ins, outs, f"golden outputs of the eager model, {len(outs)} output(s)"


def _run_rows(ctx: RankContext, fe: Frontend, inputs: list[torch.Tensor],
              out: dict[int, list[torch.Tensor]] | None = None) -> SessionResult:
    n = int(inputs[0].shape[fe.df.input_bdims[0][0]])
    get = request_getter(fe.df, inputs)

    def done(i: int, rows: list[torch.Tensor]) -> None:
        if out is not None:
            out[i] = [r.clone() for r in rows]

    return fe.run(np.zeros(n), get, done if out is not None else None,
                  ctx.runtime.request_timeout_s, ctx.runtime.max_inflight)


def _check_end_to_end(ctx: RankContext, fe: Frontend, vname: str) -> dict[str, Any]:
    rt = ctx.runtime
    ins, ref, what = _reference(ctx)
    got: dict[int, list[torch.Tensor]] = {}
    res = _run_rows(ctx, fe, ins, got)
    if not res.ok.all():
        raise RuntimeStageError(f"{vname}: end-to-end check: {int((~res.ok).sum())} of {len(res.ok)} requests "
                                "failed (timed out); see the log for the component that is stuck")
    worst = 0.0
    n = len(res.ok)
    for j, r0 in enumerate(ref):
        bd = fe.df.output_bdims[j]
        r = take_requests(r0, bd, list(range(n)))
        y = torch.cat([got[i][j] for i in range(n)], bd[0])
        if y.shape != r.shape or not torch.allclose(y.float(), r.float(), atol=rt.verify_atol, rtol=rt.verify_rtol):
            diff = (y.float() - r.float()).abs().max().item() if y.shape == r.shape else float("inf")
            raise VerificationError(
                f"{vname}: served output {j} ({fe.df.outputs[j]}) differs from the reference ({what}): "
                f"max |diff| {diff:.3g}, shapes {tuple(y.shape)} vs {tuple(r.shape)}, tolerance "
                f"atol={rt.verify_atol} rtol={rt.verify_rtol}"
            )
        worst = max(worst, (y.float() - r.float()).abs().max().item())
    say(0, f"{vname}: end-to-end outputs of {len(res.ok)} requests match the reference ({what}), "
           f"max |diff| {worst:.2e}")
    return {"samples": len(res.ok), "reference": what, "max_abs_diff": worst}


def _collect_stats(ctx: RankContext, fe: Frontend) -> list[dict[str, Any]]:
    comm = ctx.comm
    out: list[dict[str, Any]] = []

    def _ready(st: MPI.Status) -> bool:
        fe.drop_strays()  # late outputs of timed-out requests: receive and drop them
        return bool(comm.Iprobe(source=MPI.ANY_SOURCE, tag=TAG_STATS, status=st))

    missing = set(range(1, comm.Get_size()))
    bound = ctx.runtime.wait_bound_s
    t_end = time.monotonic() + bound
    while missing:
        st = MPI.Status()
        if not tp.wait_polling(lambda st=st: _ready(st), max(0.0, t_end - time.monotonic())):
            raise RankSilentError(
                f"{', '.join(ctx.name(r) for r in sorted(missing))} sent no counters within {bound:g} s of "
                "STOP (runtime.request_timeout_s + runtime.stop_grace_s): stopped, stuck or overloaded. Look "
                "at its log lines above; if it is only slow, raise runtime.stop_grace_s."
            )
        src = st.Get_source()
        out.extend(comm.recv(source=src, tag=TAG_STATS))
        missing.discard(src)
    return sorted(out, key=lambda s: (s.get("variant", ""), s["rank"]))


def run_frontend(ctx: RankContext, variants: list[tuple[str, Dataflow]]) -> dict[str, Any]:
    """Rank 0's whole run (see the module docstring); returns the JSON-able summary."""
    rt = ctx.runtime
    comm = ctx.comm
    tracer = ctx.tracer("frontend")
    summary: dict[str, Any] = {"mode": rt.mode, "world_size": comm.Get_size(), "model": ctx.plan.model,
                               "threads": ctx.threads.describe(), "variants": {}}
    next_id = 0
    batch = _batch_inputs(ctx, variants[-1][1]) if rt.mode == "batch" else None  # before any request
    if rt.mode == "bench":
        benchmark.start_levels(ctx)
    bench_results: dict[str, Any] = {}
    fe: Frontend | None = None
    for vname, df in variants:
        prev = fe
        fe = Frontend(comm, df, tracer, rt.idle_sleep_ms / 1e3)
        fe.next_id = next_id
        strays = prev.drop_strays if prev is not None else None
        for turn in floor_turns(ctx, df, vname):  # the component ranks time their floor, in turn
            ctx.barrier(f"{vname}: timing the floor (rank {turn}'s turn)", rt.load_timeout_s, strays,
                        FLOOR_WAIT_SLEEP_S)
        # every component rank has loaded and checked its callable (and sent the last variant's strays)
        ctx.barrier(f"{vname}: loading and checking the programs", rt.load_timeout_s, strays)
        try:
            vsum: dict[str, Any] = {}
            if rt.verify:
                vsum["end_to_end"] = _check_end_to_end(ctx, fe, vname)
            if batch is not None:
                vsum.update(_batch_mode(ctx, fe, batch))
            else:
                bench_results[vname] = benchmark.run_levels(ctx, fe, vname)
            summary["variants"][vname] = vsum
        except JobInterrupted as e:
            if rt.mode == "bench":
                raise JobInterrupted(f"{vname}: {e}; the finished bench levels are in {ctx.paths.bench_levels}") from None
            raise
        finally:
            next_id = fe.next_id
        fe.stop_all(rt.wait_bound_s)
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
    tracer.write(ctx.paths.trace_dir)
    ctx.barrier("collecting the counters", rt.wait_bound_s)
    if rt.mode == "bench":
        summary.update(benchmark.finish(ctx, bench_results, batch1, floor_now))
    failed = summary["variants"].get("split", {}).get("failed", 0)
    if rt.mode == "batch" and failed:
        raise RequestTimeoutError(
            f"{failed} request(s) exceeded runtime.request_timeout_s={rt.request_timeout_s} s and were "
            f"reported failed (ids {summary['variants']['split']['failed_ids'][:10]}); the outputs of the "
            f"others are in {summary['variants']['split']['output_path']} (see its 'done' mask). Raise "
            "runtime.request_timeout_s or find the slow component in the per-rank counters."
        )
    return summary


# ------------------------------------------------------------------------------------- batch mode
BatchInputs = tuple[list[torch.Tensor], str, Path]


def _batch_inputs(ctx: RankContext, df: Dataflow) -> BatchInputs:
    """Batch mode's inputs, checked against the switchboard, and the checked output path: before any work
    (``[Note: batch outputs on disk]`` in :mod:`hpcsplit.runtime.batch_files`)."""
    rt = ctx.runtime
    out_path = check_output_path(Path(rt.output_path) if rt.output_path else ctx.paths.batch_outputs, rt.overwrite)
    if rt.input_path:
        specs = {s.name: s for s in ctx.switchboard.layout.inputs}
        arrays = read_inputs(rt.input_path, df.inputs, [specs[n] for n in df.inputs] if set(df.inputs) <= set(specs)
                             else None)
        inputs = [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
        src = str(rt.input_path)
    else:
        inputs = [torch.as_tensor(x) for x in ctx.switchboard.example_inputs(rt.num_samples)]
        src = f"switchboard example inputs x{rt.num_samples}"
    say(0, f"batch mode: {int(inputs[0].shape[0])} requests from {src} -> {out_path} (checked)")
    return inputs, src, out_path


def _batch_mode(ctx: RankContext, fe: Frontend, batch: BatchInputs) -> dict[str, Any]:
    rt = ctx.runtime
    inputs, src, out_path = batch
    bdi = fe.df.input_bdims
    inputs = [x.movedim(0, bdi[i][0]) if bdi[i][0] else x for i, x in enumerate(inputs)]
    n = int(inputs[0].shape[bdi[0][0]])
    get = request_getter(fe.df, inputs)
    bdo = fe.df.output_bdims
    writer = OutputWriter(out_path, fe.df.outputs, n)

    def done(i: int, rows: list[torch.Tensor]) -> None:
        writer.row(i, [host_row(r, bdo[j][0]) for j, r in enumerate(rows)])

    say(0, f"batch mode: {n} requests from {src} -> {out_path} (written as they finish)")
    try:
        res = fe.run(np.zeros(n), get, done, rt.request_timeout_s, rt.max_inflight)
    except BaseException as e:
        p = fe.partial
        try:
            writer.close(p.status == STATUS_OK, p.latency_ms)
            saved = (f"wrote the {int(writer.done.sum())} finished of {n} outputs to {out_path} (its 'done' mask "
                     "marks them; the other rows are zeros)")
        except Exception as e2:  # noqa: BLE001 - the first error is the one to report
            saved = f"could not write the finished outputs to {out_path} ({type(e2).__name__}: {e2})"
        say(0, f"stopping on error: {saved}")
        if isinstance(e, JobInterrupted):
            raise JobInterrupted(f"{e}; {saved}") from None
        raise
    writer.close(res.ok, res.latency_ms)
    lat = res.latency_ms[res.ok]
    failed_ids = [int(i) for i in np.flatnonzero(~res.ok)]
    say(0, f"batch mode: {int(res.ok.sum())}/{n} done in {res.wall_s:.2f} s "
           f"({res.ok.sum() / res.wall_s:.1f} req/s), outputs in {out_path}")
    return {
        "requests": n, "done": int(res.ok.sum()), "failed": len(failed_ids), "failed_ids": failed_ids,
        "output_path": str(out_path), "wall_s": res.wall_s,
        "throughput_rps": float(res.ok.sum() / res.wall_s) if res.wall_s else None,
        "p50_ms": float(np.percentile(lat, 50)) if lat.size else None,
        "p99_ms": float(np.percentile(lat, 99)) if lat.size else None,
    }
