"""A component rank: load its program per variant, check it, serve until STOP, report counters.

:func:`serve_component` is the rank loop (``[Note: serve dataflow]`` in :mod:`~hpcsplit.runtime.routing`):
join inputs per request, batch, run, send each output row where its request's route says.
:func:`run_component_rank` is the rank's lifecycle around it (``[Note: serve rank lifecycle]`` in
:mod:`~hpcsplit.runtime.stage`).  An exception in the program is reported to the frontend, then raised.
"""

from __future__ import annotations

import inspect
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from hpcsplit.core.device import free_device_copy, is_oom, time_latency_ms
from hpcsplit.core.grouping import GROUP_SEP, group_members
from hpcsplit.core.mpi import MPI
from hpcsplit.errors import RankLeftJob, RuntimeStageError, VerificationError
from hpcsplit.runtime import faults
from hpcsplit.runtime import mailbox as mb
from hpcsplit.runtime import transport as tp
from hpcsplit.runtime.batching import Batcher, JoinBuffer, ReadyRequest, Row, stack_rows, take_requests
from hpcsplit.runtime.context import FLOOR_WAIT_SLEEP_S, TAG_STATS, RankContext, floor_turns, say
from hpcsplit.runtime.faults import COMPONENT_SIGNAL_GRACE_S, JobInterrupted, stop_signal
from hpcsplit.runtime.heap import settle_heap, thaw_heap
from hpcsplit.runtime.routing import OUTPUT, WHOLE, Dataflow
from hpcsplit.runtime.settings import FaultSettings
from hpcsplit.runtime.threads import cpu_seconds
from hpcsplit.runtime.trace import Tracer

__all__ = ["load_variant", "run_component_rank", "serve_component", "with_fault"]

_MAX_B1_SAMPLES = 20000  # batch-1 compute samples a rank keeps for the bench (per variant)

SendGroups = list[tuple[int | None, tuple[tuple[int, int], ...]]]  # (component index or None: output, (out, slot))


def as_tuple(out: Any) -> tuple[Any, ...]:
    """A program's result as a tuple of outputs."""
    if isinstance(out, tuple | list):
        return tuple(out)
    return (out,)


def with_fault(fn: Callable[..., Any], fault: FaultSettings | None, name: str) -> Callable[..., Any]:
    """Wrap ``fn`` with the test-only fault of ``runtime.fault`` when it targets ``name``."""
    if fault is None or fault.component != name:
        return fn
    seen = [0, 0]

    def faulty(*args: Any) -> Any:
        if fault.kind == "nan":
            if any(a.is_floating_point() and bool(torch.isnan(a).any()) for a in args if isinstance(a, torch.Tensor)):
                raise ValueError("a NaN in the inputs (injected fault, runtime.fault kind=nan)")
            return fn(*args)
        seen[0] += 1
        if seen[0] > fault.after_batches:
            if fault.kind == "sleep":
                if seen[1] < fault.times:  # sleep faults: how many batches sleep
                    seen[1] += 1
                    time.sleep(fault.sleep_s)
            else:
                raise RuntimeError(f"injected fault (runtime.fault) after {fault.after_batches} batches")
        return fn(*args)

    return faulty


# -------------------------------------------------------------------------------------- the rank loop
def serve_component(
    comm: MPI.Comm,
    df: Dataflow,
    name: str,
    fn: Callable[..., Any],
    batch_size: int,
    max_wait_s: float,
    request_timeout_s: float = 60.0,
    tracer: Tracer | None = None,
    device: torch.device | None = None,
    abort_grace_s: float = 3.0,
    idle_sleep_s: float = 2e-3,
    row_errors: bool = False,
    spin_s: float = mb.SPIN_S,
    stats_every_s: float | None = None,
    silence_s: float | None = None,
    quiet_limit_s: float | None = None,
) -> dict[str, Any]:
    """Serve component ``name`` on this rank until the frontend sends STOP; return counters.

    Joins inputs per request, batches up to ``batch_size`` or ``max_wait_s``, runs ``fn`` and sends
    each output row to the rank its request's route names (``[Note: serve dataflow]``).

    An exception in ``fn`` ends the job (the frontend is told, then this rank raises), unless
    ``row_errors`` (batch mode): then the batch's requests run one by one, those that pass go on, and
    those that fail alone are reported to the frontend (``KIND_ROW_ERROR``: it marks those rows failed,
    with the message) while this rank keeps serving (``[Note: failed rows]``).

    ``stats_every_s`` (server mode): this often, when they changed, the counters go to rank 0 as a
    ``KIND_CONTROL`` message (``aux`` = the component's index; int64 batches, samples, compute us,
    largest batch, failed rows), which the server shows at ``/metrics``.

    ``silence_s`` (server mode, ``[Note: serving through faults]`` in :mod:`hpcsplit.runtime.server.failover`):
    the counters also go every ``silence_s`` / 5 when they did not change (this rank's heartbeat); the
    frontend's ``CONTROL_LOST`` messages name the ranks lost (nothing is sent to them, no STOP awaited from
    them); once the frontend's heartbeats have begun, ``silence_s`` without a word from it makes this rank
    leave the job (:class:`RankLeftJob`), ``quiet_limit_s`` after it said its heartbeats end.
    """
    rank = comm.Get_rank()
    flow = df.component(name)
    tracer = tracer or Tracer(rank, None, None)
    comp_index = {c.name: c.index for c in df.components}
    groups: SendGroups = [(None if dst == OUTPUT else comp_index[dst], pairs)
                          for dst, pairs in df.send_groups(name).items()]
    join = JoinBuffer(len(flow.inputs))
    batcher = Batcher(batch_size, max_wait_s)
    inbox = mb.Inbox(comm, device)
    outbox = mb.Outbox()
    backoff = mb.Backoff(spin_s=spin_s, deep_sleep_s=idle_sleep_s)
    stats: dict[str, Any] = {"rank": rank, "component": name, "batches": 0, "requests": 0, "compute_s": 0.0,
                             "expired": 0, "max_batch": 0, "row_errors": 0}
    # (wall-clock end, ms) of every batch of one request: the bench compares a level's with the profile
    b1_at: list[float] = []
    b1_ms: list[float] = []
    t_start, cpu_start = time.perf_counter(), cpu_seconds()
    db = mb._DOORBELL
    db_start = db.wakeups if db is not None else 0
    rings_start = db.rings if db is not None else 0
    lost = set(faults.lost_ranks())
    stops_needed = set(df.upstream_ranks(name)) - lost
    stopping = False
    next_expire = t_start + 1.0
    beat_s = silence_s / 5 if silence_s else None
    every_s = min(stats_every_s or 1e9, beat_s or 1e9)
    next_stats, next_beat, sent_batches = t_start + every_s, t_start, -1
    heard0: float | None = None  # the frontend's last message, once its heartbeats began (server mode)
    limit0 = silence_s
    # CUDA kernels run asynchronously: the compute span ends when the stream is done, not when the
    # launches return (the send would synchronise anyway, see buffers.send_buffer)
    cuda_sync = torch.cuda.current_stream(device).synchronize if getattr(device, "type", "") == "cuda" else None
    with torch.inference_mode():
        while True:
            worked = False
            from0 = False
            for m, t_hdr in inbox.poll():
                worked = True
                h = m.header
                from0 = from0 or m.source == 0
                if h.kind == tp.KIND_STOP:
                    stops_needed.discard(m.source)
                    stopping = not stops_needed
                    continue
                if h.kind == tp.KIND_CONTROL and m.source == 0 and h.aux < 0:  # [Note: serving through faults]
                    if h.aux == faults.CONTROL_LOST:
                        _lost(m, lost, rank, name, inbox, outbox)
                        stops_needed -= lost
                        stopping = stopping or not stops_needed  # every rank upstream is lost: nothing comes
                    elif h.aux == faults.CONTROL_QUIET:
                        limit0 = quiet_limit_s
                    if heard0 is not None or h.aux == faults.CONTROL_ALIVE:  # heartbeats began: watch them
                        heard0 = time.perf_counter()
                    continue
                if h.kind != tp.KIND_DATA:
                    continue
                now = time.perf_counter()
                for row, (rid, route) in enumerate(zip(h.request_ids, h.routes, strict=True)):
                    for meta, t in zip(h.tensors, m.tensors, strict=True):
                        ready = join.add(rid, route, meta.slot, Row(t, row, meta.rdim), now, h.aux)
                        if ready is not None:
                            batcher.push(ready, now)
                tracer.span("recv", t_hdr, now, h.request_ids, src=m.source)
            now = time.perf_counter()
            if batcher.due(now):
                worked = True
                items = batcher.take()
                ids = [it.request_id for it in items]
                try:
                    inputs = [stack_rows([it.rows[k] for it in items]) for k in range(len(flow.inputs))]
                    if cuda_sync is not None:
                        cuda_sync()  # the inputs' copies and stacking are not this batch's compute
                    t0, c0 = time.perf_counter(), tracer.cpu()
                    outs = as_tuple(fn(*inputs))
                    if cuda_sync is not None:
                        cuda_sync()
                    t1 = time.perf_counter()
                except Exception as e:  # noqa: BLE001 - reported to the frontend, then re-raised
                    msg = (f"rank {rank} component {name!r} failed on requests {ids[:16]}"
                           f"{'...' if len(ids) > 16 else ''}: {type(e).__name__}: {e}\n"
                           + traceback.format_exc(limit=6))
                    if not row_errors:
                        _report_and_raise(comm, msg, abort_grace_s, e)
                    _rows_one_by_one(comm, outbox, groups, items, flow, fn, e, stats, tracer, rank, name)
                    continue
                tracer.span("compute", t0, t1, ids, cpu0=c0, batch=len(ids))
                stats["batches"] += 1
                stats["requests"] += len(ids)
                stats["compute_s"] += t1 - t0
                stats["max_batch"] = max(stats["max_batch"], len(ids))
                if len(ids) == 1 and len(b1_ms) < _MAX_B1_SAMPLES:
                    b1_at.append(time.time())
                    b1_ms.append((t1 - t0) * 1e3)
                # [Note: critical path in the run] aux of a data message = the longest chain of
                # compute (us) behind it: upstream's longest + ours.  Exact per request at batch 1.
                path_us = max(it.path_us for it in items) + int((t1 - t0) * 1e6)
                _send_outputs(comm, outbox, groups, items, outs, flow.out_bdims, tracer, path_us, lost)
            outbox.reap()
            if heard0 is not None:
                if from0:
                    heard0 = now
                elif limit0 is not None and now - heard0 > limit0:
                    raise RankLeftJob(f"rank {rank} component {name!r}: nothing from the frontend (rank 0) for "
                                      f"{now - heard0:.1f} s (runtime.silence_s): the job lost its frontend; this "
                                      "rank leaves it")
            if now > next_expire:
                next_expire = now + 1.0
                stats["expired"] += len(join.expire(now, request_timeout_s))
            if stats_every_s is not None and now >= next_stats and not stopping:
                next_stats = now + every_s
                if stats["batches"] != sent_batches or (beat_s is not None and now >= next_beat):
                    sent_batches = stats["batches"]
                    next_beat = now + (beat_s or 0.0)
                    live = torch.tensor([stats["batches"], stats["requests"], int(stats["compute_s"] * 1e6),
                                         stats["max_batch"], stats["row_errors"]], dtype=torch.int64)
                    outbox.add(tp.isend_message(comm, 0, tp.KIND_CONTROL, (), (), [(0, live)],
                                                aux=comp_index[name]), 0)
            if stopping and not len(batcher) and not inbox.pending:
                # every receiver keeps receiving until it has our STOP, so these complete
                if not outbox.drain(timeout_s=120.0):
                    say(rank, f"{name}: {len(outbox.pending)} send(s) still not received 120 s after STOP")
                for r in df.downstream_ranks(name):
                    if r not in lost:
                        outbox.add(tp.isend_message(comm, r, tp.KIND_STOP), r)
                outbox.drain(timeout_s=120.0)
                break
            sig = stop_signal()  # [Note: stop signals]: the frontend saves and aborts; if it cannot, we stop
            if sig is not None and sig[1] > abort_grace_s + COMPONENT_SIGNAL_GRACE_S:
                raise JobInterrupted(f"rank {rank} component {name!r}: {sig[0]} {sig[1]:.0f} s ago and the job "
                                     "was not aborted by the frontend; stopping")
            if worked:
                backoff.reset()
            else:
                t_idle = time.perf_counter()
                backoff.idle(t_idle, batcher.deadline(), bool(inbox.pending) or outbox.in_flight(t_idle),
                             quiet=not inbox.pending and not outbox.pending)
    wall = time.perf_counter() - t_start
    stats.update(wall_s=wall, cpu_s=cpu_seconds() - cpu_start, pending_join=len(join),
                 batch1_samples=(b1_at, b1_ms))
    if db is not None:  # during this call (one doorbell serves every variant)
        stats.update(doorbell_wakeups=db.wakeups - db_start, doorbell_rings=db.rings - rings_start)
    return stats


def _lost(m: tp.Message, lost: set[int], rank: int, name: str, inbox: mb.Inbox, outbox: mb.Outbox) -> None:
    """The frontend's ``CONTROL_LOST``: the ranks lost so far; this rank among them leaves the job."""
    named = {int(r) for r in m.tensors[0].tolist()} if m.tensors else set()
    for r in named:
        faults.mark_lost(r, "declared lost by the frontend")
    if rank in named:
        raise RankLeftJob(f"rank {rank} component {name!r}: the frontend declared this rank lost (silent for longer "
                          "than runtime.silence_s); it leaves the job, which goes on without it")
    lost |= named
    inbox.forget(lost)
    outbox.forget(lost)


def _send_outputs(comm: MPI.Comm, outbox: mb.Outbox, groups: SendGroups, items: list[ReadyRequest],
                  outs: tuple[Any, ...], out_bdims: tuple[tuple[int, ...], ...], tracer: Tracer,
                  path_us: int = 0, skip: set[int] | frozenset[int] = frozenset()) -> None:
    t0, c0 = time.perf_counter(), tracer.cpu()
    ids = [it.request_id for it in items]
    routes = [it.route for it in items]
    for ci, pairs in groups:
        by_rank: dict[int, list[int]] = {}
        for k, route in enumerate(routes):
            by_rank.setdefault(0 if ci is None else route[ci], []).append(k)
        for dest, pos in by_rank.items():
            if dest in skip:  # a lost replica ([Note: serving through faults]): the frontend sends these again
                continue
            sel = [(slot, take_requests(outs[j], out_bdims[j], pos), out_bdims[j][0]) for j, slot in pairs]
            outbox.add(tp.isend_message(comm, dest, tp.KIND_DATA, [ids[k] for k in pos],
                                        [routes[k] for k in pos], sel, aux=path_us), dest)
    tracer.span("send", t0, time.perf_counter(), ids, cpu0=c0)


# [Note: failed rows]
# In batch mode a component's exception need not end the job: a bad sample (a NaN the model refuses, a
# malformed row) fails only its own row.  The batch that raised is run again one request at a time
# (batch 1, so a row that passes gets the same outputs it would have in any batch); the requests that
# pass are sent on as usual, and the ids of those that fail alone go to the frontend in one
# KIND_ROW_ERROR message with the first exception's text.  The frontend marks them failed (reason:
# component error), retries them once at the end of the pass, lists them, and stops the job when
# runtime.max_failures is exceeded; this rank keeps serving.  Downstream components never see a failed
# request; their partial joins of it expire (request_timeout_s).  A crash (the rank dies) still ends the job.
ROW_ERROR_LOGS = 5  # a component logs its first few failed rows, then every 100th batch


def _rows_one_by_one(comm: MPI.Comm, outbox: mb.Outbox, groups: SendGroups, items: list[ReadyRequest],
                     flow: Any, fn: Callable[..., Any], exc: BaseException, stats: dict[str, Any],
                     tracer: Tracer, rank: int, name: str) -> None:
    """[Note: failed rows]: run a failed batch's requests alone, send on those that pass, report the rest."""
    bad: list[int] = []
    first = f"{type(exc).__name__}: {exc}"
    for it in items:
        try:
            outs = as_tuple(fn(*[stack_rows([it.rows[k]]) for k in range(len(flow.inputs))]))
        except Exception as e:  # noqa: BLE001 - this row fails, the rank goes on
            bad.append(it.request_id)
            first = f"{type(e).__name__}: {e}"
            continue
        _send_outputs(comm, outbox, groups, [it], outs, flow.out_bdims, tracer, it.path_us)
    stats["batches"] += 1
    stats["requests"] += len(items) - len(bad)
    if not bad:
        return
    n_before = stats["row_errors"]
    stats["row_errors"] += len(bad)
    text = f"rank {rank} component {name!r}: {first}"[:2000]
    if n_before < ROW_ERROR_LOGS or stats["batches"] % 100 == 0:
        say(rank, f"{name}: {len(bad)} of {len(items)} request(s) failed alone ({first[:300]}); "
                  f"reported to the frontend as failed rows, still serving ({stats['row_errors']} so far)")
    payload = torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8)
    outbox.add(tp.isend_message(comm, 0, tp.KIND_ROW_ERROR, bad, (), [(0, payload)], aux=len(payload)), 0)


def _report_and_raise(comm: MPI.Comm, msg: str, grace_s: float, exc: BaseException) -> None:
    """Tell the frontend (so it writes partial outputs and aborts), then raise ourselves."""
    rank = comm.Get_rank()
    say(rank, msg.splitlines()[0])
    try:
        payload = torch.frombuffer(bytearray(msg.encode("utf-8")), dtype=torch.uint8)
        h = tp.isend_message(comm, 0, tp.KIND_ERROR, (), (), [(0, payload)], aux=len(payload))
        mb.ring(0)
        tp.wait_polling(h.test, timeout_s=grace_s)
        time.sleep(grace_s)  # the frontend aborts the job; if it cannot, we do below
    finally:
        raise RuntimeStageError(msg.splitlines()[0]) from exc


# --------------------------------------------------------------------------------- the rank's life
def _load_callable(ctx: RankContext, name: str) -> Any:
    """This rank's callable; on CUDA placed on the rank's device (the loader's ``device=`` or ``.to``)."""
    sb = ctx.switchboard
    loader: Callable[..., Any] = sb.load_whole if name == WHOLE else sb.load_component
    args = () if name == WHOLE else (name,)
    if ctx.on_gpu and "device" in inspect.signature(loader).parameters:
        return loader(*args, device=ctx.device)
    fn = loader(*args)
    if ctx.on_gpu:
        if not hasattr(fn, "to"):
            raise RuntimeStageError(
                f"rank {ctx.rank}: the switchboard's loader returned a callable that cannot be "
                f"moved to {ctx.device} (no device= argument, no .to); this hpcsplit cannot serve "
                f"{name!r} on a GPU"
            )
        fn = fn.to(ctx.device)
    return fn


def _group_callable(ctx: RankContext, flow: Any) -> Callable[..., tuple[Any, ...]]:
    """A group's members run back to back (``[Note: component groups]``): inputs and outputs in ``flow``'s order."""
    sb = ctx.switchboard
    steps = [(_load_callable(ctx, m), [t.name for t in sb.components[m].inputs], [t.name for t in sb.components[m].outputs])
             for m in group_members(flow.name, sb.order)]
    ins, outs = tuple(flow.inputs), tuple(flow.outputs)

    def run(*args: Any) -> tuple[Any, ...]:
        env = dict(zip(ins, args, strict=True))
        for fn, m_in, m_out in steps:
            env.update(zip(m_out, as_tuple(fn(*[env[n] for n in m_in])), strict=True))
        return tuple(env[n] for n in outs)

    return run


def _example_inputs(ctx: RankContext, name: str, batch: int, flow: Any = None) -> tuple[torch.Tensor, ...]:
    sb = ctx.switchboard
    if name == WHOLE:
        return tuple(sb.example_inputs(batch))
    if GROUP_SEP in name:  # the members' example activations that come from outside the group
        acts = sb.component_example_inputs(batch)
        env = {t.name: x for m in group_members(name, sb.order) for t, x in zip(sb.components[m].inputs, acts[m],
                                                                                 strict=True)}
        return tuple(env[n] for n in flow.inputs)
    return tuple(sb.component_example_inputs(batch)[name])


def _check_component(ctx: RankContext, df: Dataflow, name: str, fn: Callable[..., Any], batch: int) -> float:
    """Run ``fn`` once on the switchboard's example activations; check output count, batch and finiteness."""
    flow = df.component(name)
    args = tuple(a.to(ctx.device) for a in _example_inputs(ctx, name, batch, flow))
    t0 = time.perf_counter()
    with torch.inference_mode():
        outs = as_tuple(fn(*args))
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
        raise VerificationError(f"rank {ctx.rank}: component {name!r} on its example inputs: " + "; ".join(problems))
    return dt


def _measure_floor(ctx: RankContext, df: Dataflow, vname: str, name: str, fn: Callable[..., Any]) -> list[float]:
    """This rank's turn of ``[Note: floor re-measured]``: ms per batch of one, or [] if it has no turn."""
    samples: list[float] = []
    for turn in floor_turns(ctx, df, vname):
        if turn == ctx.rank:
            n = ctx.bench.floor_runs
            args = tuple(a.to(ctx.device) for a in _example_inputs(ctx, name, 1, df.component(name)))
            samples = time_latency_ms(fn, args, warmup=2, iters=n, device=ctx.device)  # the profile's timer
            say(ctx.rank, f"{vname}: {name!r} batch of one, back to back: p50 {float(np.median(samples)):.2f} ms "
                          f"({n} runs)")
        ctx.barrier(f"{vname}: timing the floor (rank {turn}'s turn)", ctx.runtime.load_timeout_s,
                    max_sleep_s=FLOOR_WAIT_SLEEP_S)
    return samples


def load_variant(ctx: RankContext, df: Dataflow, vname: str, name: str, slice_gb: float | None) -> Any:
    """This rank's program for one variant, checked on its example inputs (``runtime.verify``).

    On a GPU, running out of memory in the rank's slice stops the job with the slice and the fix.
    """
    rank = ctx.rank
    try:
        fn = _group_callable(ctx, df.component(name)) if GROUP_SEP in name else _load_callable(ctx, name)
        if ctx.runtime.verify:
            bs = df.batch_size_of(rank)
            dt = _check_component(ctx, df, name, fn, bs)
            say(rank, f"{vname}: {name!r} runs on its example inputs (batch {bs}, {dt * 1e3:.1f} ms)")
    except Exception as e:
        if not ctx.on_gpu or not is_oom(e):
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


def run_component_rank(ctx: RankContext, variants: list[tuple[str, Dataflow]]) -> None:
    """Per variant: load and check the program, time the floor (bench), serve until STOP; then send the
    counters to rank 0."""
    comm, rt, rank = ctx.comm, ctx.runtime, ctx.rank
    tracer = ctx.tracer(str(ctx.entry.component))
    all_stats = []
    for vname, df in variants:
        name = df.rank_component[rank]
        fn = load_variant(ctx, df, vname, name, ctx.entry.slice_gb)
        floor = _measure_floor(ctx, df, vname, name, fn)
        fn = with_fault(fn, rt.fault, name)
        settle_heap()  # [Note: frozen heap]
        ctx.barrier(f"{vname}: loading and checking the programs", rt.load_timeout_s)
        server = rt.mode == "server"
        st = serve_component(comm, df, name, fn, df.batch_size_of(rank), rt.max_wait_ms / 1e3,
                             rt.request_timeout_s, tracer, ctx.device, rt.abort_grace_s, rt.idle_sleep_ms / 1e3,
                             row_errors=rt.mode == "batch", stats_every_s=1.0 if server else None,
                             spin_s=ctx.spin_s, silence_s=rt.silence_s if server else None,
                             quiet_limit_s=rt.wait_bound_s)
        thaw_heap()  # this variant's program may go now ([Note: frozen heap])
        st["variant"] = vname
        if vname != variants[-1][0]:  # a rank stopped in this variant is named within wait_bound_s, not the
            ctx.barrier(f"{vname}: serving ended", rt.wait_bound_s)  # next variant's load_timeout_s
        if floor:
            st["floor_samples_ms"] = floor
        all_stats.append(st)
        if ctx.on_gpu:  # the next variant's program gets this one's memory (the slice cap counts cached blocks)
            del fn
            for m in group_members(name, ctx.switchboard.order) if GROUP_SEP in name else (name,):
                free_device_copy(ctx.switchboard, m, ctx.device)
    tracer.write(ctx.paths.trace_dir)
    # counters and up to 2 x 20,000 batch-1 compute samples per variant (a few hundred KB; no tensors)
    req = comm.isend(all_stats, dest=0, tag=TAG_STATS)
    if not tp.wait_polling(req.Test, timeout_s=2 * rt.wait_bound_s):
        raise RuntimeStageError(f"rank {rank}: rank 0 did not take this rank's counters within "
                                f"{2 * rt.wait_bound_s:g} s")
    ctx.barrier("collecting the counters", rt.wait_bound_s)
