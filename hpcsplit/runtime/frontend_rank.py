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
from hpcsplit.runtime.batch_files import check_output_path, host_row
from hpcsplit.runtime.batch_stream import (
    FAIL_COMPONENT,
    FAIL_REASONS,
    FAIL_TIMEOUT,
    ChunkFeed,
    InputSource,
    Progress,
    StreamWriter,
    chunk_rows_for,
    memory_source,
    open_inputs,
    peak_rss_mb,
)
from hpcsplit.runtime.batching import take_requests
from hpcsplit.runtime.context import FLOOR_WAIT_SLEEP_S, TAG_STATS, RankContext, floor_turns, say
from hpcsplit.runtime.faults import JobInterrupted, RankSilentError, chain_requeue, lost_ranks
from hpcsplit.runtime.frontend import STATUS_ERROR, STATUS_TIMEOUT, Frontend, SessionResult, request_getter
from hpcsplit.runtime.heap import settle_heap, thaw_heap
from hpcsplit.runtime.routing import Dataflow
from hpcsplit.runtime.server.serve import run_server

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

    missing = set(range(1, comm.Get_size())) - set(lost_ranks())  # [Note: lost ranks]
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
        fe = Frontend(comm, df, tracer, rt.idle_sleep_ms / 1e3, ctx.spin_s)
        fe.next_id = next_id
        strays = prev.drop_strays if prev is not None else None
        for turn in floor_turns(ctx, df, vname):  # the component ranks time their floor, in turn
            ctx.barrier(f"{vname}: timing the floor (rank {turn}'s turn)", rt.load_timeout_s, strays,
                        FLOOR_WAIT_SLEEP_S)
        settle_heap()  # [Note: frozen heap]
        # every component rank has loaded and checked its callable (and sent the last variant's strays)
        ctx.barrier(f"{vname}: loading and checking the programs", rt.load_timeout_s, strays)
        try:
            vsum: dict[str, Any] = {}
            if rt.verify:
                vsum["end_to_end"] = _check_end_to_end(ctx, fe, vname)
            if batch is not None:
                vsum.update(_batch_mode(ctx, fe, batch))
            elif rt.mode == "server":  # [Note: server mode] in hpcsplit.runtime.server.serve
                vsum.update(run_server(ctx, fe))
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
        thaw_heap()  # [Note: frozen heap]
        if vname != variants[-1][0]:  # a rank stopped in this variant is named within wait_bound_s
            ctx.barrier(f"{vname}: serving ended", rt.wait_bound_s, fe.drop_strays)
    assert fe is not None
    summary["ranks"] = _collect_stats(ctx, fe)
    if lost_ranks():
        summary["lost_ranks"] = {str(r): f"{ctx.name(r)}: {why}" for r, why in sorted(lost_ranks().items())}
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
        split = summary["variants"]["split"]
        why = ", ".join(f"{n} {r}" for r, n in split.get("failed_reasons", {}).items())
        slow = "raise runtime.request_timeout_s or find the slow component in the per-rank counters"
        errors = split.get("component_errors")
        hint = f"For timeouts {slow}; component errors: {errors[0]}" if errors else slow.capitalize()
        raise RequestTimeoutError(
            f"{failed} row(s) failed after their retry ({why or 'timeout'}; ids {split['failed_ids'][:10]}); the "
            f"outputs of the others are in {split['output_path']} (see its 'done' mask and 'failed' reasons), "
            f"and re-running the same command serves only the rows not done. {hint}."
        )
    return summary


# ------------------------------------------------------------------------------------- batch mode
BatchInputs = tuple[InputSource, str, StreamWriter, int]


class TooManyFailures(RuntimeStageError):
    """More rows failed than ``runtime.max_failures``."""


def _batch_inputs(ctx: RankContext, df: Dataflow) -> BatchInputs:
    """Batch mode's inputs, checked against the switchboard, and the outputs file, checked or resumed:
    before any work (``[Note: streaming batch mode]`` in :mod:`hpcsplit.runtime.batch_stream`)."""
    rt = ctx.runtime
    out_path = check_output_path(Path(rt.output_path) if rt.output_path else ctx.paths.batch_outputs, rt.overwrite)
    if rt.input_path:
        specs = {s.name: s for s in ctx.switchboard.layout.inputs}
        src = open_inputs(rt.input_path, df.inputs, [specs[n] for n in df.inputs] if set(df.inputs) <= set(specs)
                          else None)
        label = str(rt.input_path)
    else:
        src = memory_source([np.asarray(x) for x in ctx.switchboard.example_inputs(rt.num_samples)], df.inputs)
        label = f"switchboard example inputs x{rt.num_samples}"
    chunk = chunk_rows_for(src, rt.chunk_rows, rt.max_inflight)
    try:
        writer = StreamWriter(out_path, df.outputs, src.n, src.fingerprint(),
                              str(getattr(ctx.switchboard, "sha256", "") or ""), rt.overwrite, group_rows=chunk)
    except BaseException:
        src.close()
        raise
    say(0, f"batch mode: {src.n} rows from {label} ({len(src.shards)} file(s), checked) -> {writer.stream}: "
           f"{writer.resumed} rows done already (kept), {src.n - writer.resumed} to serve")
    return src, label, writer, chunk


SEGMENT_ROWS = 1 << 16  # rows per Frontend.run session: its per-request arrays stay this size, whatever n
LATENCY_SAMPLE = 4096  # latencies kept per session for the summary's percentiles


def _too_many(n: int, limit: int, writer: StreamWriter) -> TooManyFailures:
    return TooManyFailures(
        f"{n} rows failed (timed out, or a component raised on them), more than runtime.max_failures={limit}: "
        f"stopping. The rows done are kept in {writer.stream}; find the slow or failing component in the log "
        "(its rank names it), then re-run the same command to continue")


def _by_reason(codes: np.ndarray) -> dict[int, np.ndarray]:
    """``FAIL_*`` code -> mask of the rows that failed for it, for the codes present (in code order)."""
    return {c: codes == c for c in sorted(FAIL_REASONS) if (codes == c).any()}


def _reason_name(code: int) -> str:
    return FAIL_REASONS[code].split(" (")[0]  # "timeout", "component error"


def _reasons(codes: np.ndarray) -> str:
    """``3 timeout, 1 component error`` for the ``failed`` reason codes of some rows."""
    return ", ".join(f"{int(mask.sum())} {_reason_name(c)}" for c, mask in _by_reason(codes).items())


def _mark_failed(writer: StreamWriter, rows: np.ndarray, codes: np.ndarray) -> None:
    for c, mask in _by_reason(codes).items():
        writer.fail(rows[mask], c)


def _batch_pass(ctx: RankContext, fe: Frontend, src: InputSource, writer: StreamWriter, rows: np.ndarray,
                chunk: int, prog: Progress, failed_before: int,
                lat: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Serve ``rows`` (sorted) of ``src`` into ``writer`` in sessions of :data:`SEGMENT_ROWS`, admission-timed
    (``Frontend.run(admission=True)``); returns the rows that failed and why (``FAIL_*`` codes).  Latency
    samples go to ``lat``."""
    rt = ctx.runtime
    limit = rt.max_failures
    bdi, bdo = fe.df.input_bdims, fe.df.output_bdims
    feed = ChunkFeed(src, rows, chunk)
    failed: list[np.ndarray] = []
    codes: list[np.ndarray] = []
    nfail = [failed_before, time.perf_counter()]
    lo = 0

    def failures() -> None:
        now = time.perf_counter()
        if now - nfail[1] > 0.5:
            nfail[0] = failed_before + sum(map(len, failed)) + int((fe.partial.status >= STATUS_TIMEOUT).sum())
            nfail[1] = now
            if limit is not None and nfail[0] > limit:
                raise _too_many(int(nfail[0]), limit, writer)

    def get(idx: np.ndarray) -> list[torch.Tensor]:
        ts = [torch.from_numpy(a) for a in feed.get(lo + idx)]
        failures()
        return [t.movedim(0, bdi[i][0]) if bdi[i][0] else t for i, t in enumerate(ts)]

    def done(i: int, outs: list[torch.Tensor]) -> None:
        p = fe.partial
        # host_row's numpy views keep their receive buffer from reuse (buffers.BufferPool) until written
        writer.row(int(rows[lo + i]), [host_row(r, bdo[j][0]) for j, r in enumerate(outs)],
                   float(p.done_s[i] - p.admit_s[i]) * 1e3)
        prog.tick(writer.written, int(nfail[0]))

    try:
        for lo in range(0, len(rows), SEGMENT_ROWS):  # get() and done() read lo
            seg = rows[lo:lo + SEGMENT_ROWS]
            res = fe.run(np.zeros(len(seg)), get, done, rt.request_timeout_s, rt.max_inflight, admission=True)
            ms = ((res.done_s - res.admit_s)[res.ok] * 1e3).astype(np.float32)
            lat.append(ms[:: max(1, len(ms) // LATENCY_SAMPLE)])
            failed.append(seg[~res.ok])
            codes.append(np.where(res.status[~res.ok] == STATUS_ERROR, FAIL_COMPONENT, FAIL_TIMEOUT))
            if fe.stalled:  # nothing comes back: the rows after this session fail too (a re-run serves them)
                failed.append(rows[lo + SEGMENT_ROWS:])
                codes.append(np.full(len(failed[-1]), FAIL_TIMEOUT))
                break
    finally:
        feed.close()
    if not failed:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    return np.concatenate(failed), np.concatenate(codes).astype(np.int64)


def _batch_mode(ctx: RankContext, fe: Frontend, batch: BatchInputs) -> dict[str, Any]:
    rt = ctx.runtime
    src, label, writer, chunk = batch
    n, kept = src.n, writer.resumed
    todo = writer.todo
    prog = Progress(n, kept, rt.progress_s, lambda m: say(0, m), ctx.paths.run_dir / "batch-progress.txt")
    stopped = ctx.paths.run_dir / "batch-interrupted.txt"  # for slurm/infer.sbatch: requeue, not a failure
    stopped.unlink(missing_ok=True)
    (ctx.paths.run_dir / "batch-progress.txt").unlink(missing_ok=True)  # an earlier run's
    say(0, f"batch mode: serving {len(todo)} of {n} rows from {label} in chunks of {chunk} rows "
           f"(max_inflight {rt.max_inflight}) -> {writer.stream}")
    t0 = time.perf_counter()
    lat: list[np.ndarray] = []
    failed = retried = codes = np.zeros(0, dtype=np.int64)
    fe.row_errors = []
    try:
        if len(todo):
            retried, codes = _batch_pass(ctx, fe, src, writer, todo, chunk, prog, 0, lat)
            if len(retried) and not fe.stalled:
                say(0, f"batch mode: {len(retried)} rows failed ({_reasons(codes)}); retrying them once")
                writer.flush()
                failed, codes = _batch_pass(ctx, fe, src, writer, retried, chunk, prog, len(retried), lat)
                _mark_failed(writer, failed, codes)
            elif len(retried):
                failed = retried
                say(0, f"batch mode: the pipeline stalled: {len(failed)} rows not served (no retry); a "
                       "silent rank is named at the end of the job")
                _mark_failed(writer, failed, codes)
            if rt.max_failures is not None and len(failed) > rt.max_failures:
                raise _too_many(len(failed), rt.max_failures, writer)
        writer.flush()
        prog.tick(writer.written, len(failed), force=True)
    except BaseException as e:
        try:
            writer.close()
            saved = (f"{int(writer.done.sum())} of {n} rows are done in {writer.path} ({writer.written} this run, "
                     f"{kept} kept from before); re-run the same command (or let SLURM requeue the job) to serve "
                     "the rest")
        except Exception as e2:  # noqa: BLE001 - the first error is the one to report
            saved = f"could not flush the finished rows to {writer.stream} ({type(e2).__name__}: {e2})"
        src.close()
        say(0, f"stopping: {saved}")
        if isinstance(e, JobInterrupted):
            try:
                stopped.write_text(f"{e}; {saved}\n")
            except OSError as e2:  # the marker is for slurm/infer.sbatch; the error below is the record
                say(0, f"could not write {stopped} ({e2.strerror})")
            if chain_requeue(lambda: say(0, "batch mode: the rows done are flushed; submitit requeues the job")):
                raise SystemExit(3) from None  # submitit requeued the job (its handler normally exits itself)
        if isinstance(e, JobInterrupted | TooManyFailures):
            raise type(e)(f"{e}; {saved}") from None
        raise
    wall = time.perf_counter() - t0
    out = writer.close()
    src.close()
    lats = np.concatenate(lat) if lat else np.zeros(0)
    served = writer.written
    rss = peak_rss_mb()
    say(0, f"batch mode: {int(writer.done.sum())}/{n} rows done ({served} served in {wall:.2f} s: "
           f"{served / wall if wall else 0:.1f} rows/s; {kept} kept from an earlier run), {len(retried)} retried, "
           f"{len(failed)} failed; outputs in {out}; frontend peak RSS {rss or 0:.0f} MiB")
    if len(failed):
        say(0, f"batch mode: failed rows after their retry ({_reasons(codes)}; first 100): {failed[:100].tolist()}")
        for c, mask in _by_reason(codes).items():
            say(0, f"batch mode:   {FAIL_REASONS[c]}: rows {failed[mask][:20].tolist()}")
    errors = list(dict.fromkeys(fe.row_errors))[:5]
    for msg in errors:
        say(0, f"batch mode: a component's error on failed rows: {msg}")
    return {
        "requests": n, "rows": n, "kept": kept, "served": served, "done": int(writer.done.sum()),
        "retried": len(retried), "failed": len(failed), "failed_ids": [int(i) for i in failed[:100]],
        "failed_reasons": {_reason_name(c): int(mask.sum()) for c, mask in _by_reason(codes).items()},
        "component_errors": errors,
        "output_path": str(out), "wall_s": wall, "chunk_rows": chunk,
        "throughput_rps": float(served / wall) if wall else None,
        "frontend_peak_rss_mb": rss,
        "p50_ms": float(np.percentile(lats, 50)) if lats.size else None,
        "p99_ms": float(np.percentile(lats, 99)) if lats.size else None,
    }
