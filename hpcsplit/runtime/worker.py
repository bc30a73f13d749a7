"""The serve and bench stages on MPI ranks: rank 0 is the frontend, every other rank one component replica.

    python -m hpcsplit stage=serve  ...      # runtime.mode=batch: inputs file -> outputs file
    python -m hpcsplit stage=bench +experiment=clip   # whole model vs split plan at each bench.qps

[Note: serve rank lifecycle]
Every rank: read the plan, set its thread share and OMP wait policy (``threads.configure_rank``, before
the first ``import torch``), bind its GPU and memory slice (or CPU threads), load the switchboard and
derive the dataflow (``routing.build_dataflow``, the same pure function on every rank).  A component
rank loads only its component, checks it on the switchboard's example activations, then runs
:func:`serve_component` until the frontend says STOP.  The frontend (:mod:`frontend`) pushes requests
through, checks the end-to-end outputs against the golden outputs, then serves the batch file or the
benchmark levels.  Bench mode repeats this per variant (``whole`` = the unsplit model on the same
ranks, then ``split``), each ended by STOP.  At the end components send their counters to rank 0 and
everyone meets at a non-spinning barrier.

Faults: an exception in a component is sent to the frontend as an ERROR message naming rank,
component and requests; the frontend writes the outputs finished so far (batch mode) and raises, and
``hpcsplit._rank`` aborts the job.  The component raises too, after ``runtime.abort_grace_s``, in case
the frontend cannot.
"""

from __future__ import annotations

import ipaddress
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hpcsplit import _mpi
from hpcsplit._profile_measure import full_fp32_on_gpu
from hpcsplit.cluster import slice_fraction
from hpcsplit.errors import ConfigError, RuntimeStageError
from hpcsplit.runtime.plan import Plan
from hpcsplit.runtime.routing import OUTPUT, Dataflow, build_dataflow, whole_graph_of, whole_plan
from hpcsplit.runtime.threads import configure_rank

__all__ = ["RUNTIME_DEFAULTS", "mpi_main", "runtime_settings", "serve_component"]

RUNTIME_DEFAULTS: dict[str, Any] = {
    "mode": None,  # batch | bench; None: from the stage name (serve -> batch)
    "max_wait_ms": 0.0,
    "max_inflight": 64,
    "request_timeout_s": 60.0,
    "threads": None,
    "omp_wait_policy": "PASSIVE",
    "trace": {"start_step": None, "end_step": None},
    "input_path": None,
    "output_path": None,
    "num_samples": 16,
    "verify": True,
    "verify_atol": 1e-4,
    "verify_rtol": 1e-3,
    "abort_grace_s": 3.0,
    "idle_sleep_ms": 2.0,
    "doorbell": True,  # true | local | false; [Note: doorbell] in runtime/doorbell.py
    "doorbell_network": None,  # interface (hsn0) or IPv4 network (10.0.0.0/8) other nodes ring at; None: hostname's
    "fault": None,  # tests: {component, kind: raise|sleep, after_batches, sleep_s, times}
}


_MAX_B1_SAMPLES = 20000  # batch-1 compute samples a rank keeps for the bench (per variant)


def runtime_settings(cfg: dict[str, Any]) -> dict[str, Any]:
    """``cfg['runtime']`` over :data:`RUNTIME_DEFAULTS`, with the mode resolved; raises ConfigError."""
    rt = dict(RUNTIME_DEFAULTS)
    rt.update({k: v for k, v in (cfg.get("runtime") or {}).items() if v is not None or k == "threads"})
    rt["trace"] = dict(RUNTIME_DEFAULTS["trace"], **(rt.get("trace") or {}))
    mode = rt.get("mode") or {"bench": "bench"}.get(str(cfg.get("stage")), "batch")
    problems = []
    if mode not in ("batch", "bench"):
        problems.append(f"runtime.mode={mode!r}: use batch or bench")
    if float(rt["max_wait_ms"]) < 0:
        problems.append(f"runtime.max_wait_ms={rt['max_wait_ms']}: needs >= 0")
    if int(rt["max_inflight"]) < 1:
        problems.append(f"runtime.max_inflight={rt['max_inflight']}: needs >= 1")
    if not float(rt["request_timeout_s"]) > 0:
        problems.append(f"runtime.request_timeout_s={rt['request_timeout_s']}: needs > 0")
    if not (type(rt["doorbell"]) is bool or rt["doorbell"] == "local"):
        problems.append(f"runtime.doorbell={rt['doorbell']!r}: use true (ring ranks on every node), local "
                        "(ranks on the same node only) or false")
    net = rt["doorbell_network"]
    if net is not None:
        try:
            if not isinstance(net, str) or not net.strip():
                raise ValueError("not a string")
            if "/" in net:
                ipaddress.IPv4Network(net, strict=False)
        except ValueError as e:
            problems.append(f"runtime.doorbell_network={net!r}: give an interface name (hsn0, ib0) or an IPv4 "
                            f"network such as 10.100.0.0/16 ({e})")
    if problems:
        raise ConfigError("invalid runtime settings:\n  - " + "\n  - ".join(problems))
    rt["mode"] = mode
    return rt


def _say(rank: int, msg: str) -> None:
    print(f"[rank {rank}] {msg}", file=sys.stderr, flush=True)


def _input_path(cfg: dict[str, Any], run_dir: Path, what: str) -> Path:
    paths = cfg.get("paths") or {}
    given = cfg.get(what)
    if isinstance(given, dict):
        given = given.get("path")
    if given:
        return Path(given)
    name = {"plan": paths.get("plan_filename", "plan.json"),
            "switchboard": paths.get("switchboard_dirname", "switchboard")}[what]
    return run_dir / name


def _bind_device(plan: Plan, entry: Any, rank: int) -> Any:
    """This rank's torch device; on CUDA also its memory slice (``slice_gb``)."""
    import torch

    if plan.device_kind != "cuda" or entry.role != "component":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeStageError(
            f"rank {rank}: the plan places component {entry.component!r} on GPU {entry.gpu}, but CUDA is "
            "not available here. Run on GPU nodes, or allocate for CPU (cluster with gpus_per_node: 0)."
        )
    n = torch.cuda.device_count()
    if entry.gpu >= n:
        raise RuntimeStageError(
            f"rank {rank}: plan says GPU {entry.gpu} but this rank sees {n} GPU(s) "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); request all GPUs of the node "
            "for every task (no per-task GPU binding), or re-plan for this node shape."
        )
    dev = torch.device("cuda", entry.gpu)
    torch.cuda.set_device(dev)
    full_fp32_on_gpu()  # as the profile ran (and as the end-to-end check needs)
    # the profile measured this cell under the same cap (GB = GiB, as everywhere in hpcsplit)
    frac = slice_fraction(entry.slice_gb, torch.cuda.get_device_properties(dev).total_memory)
    torch.cuda.set_per_process_memory_fraction(frac, dev)
    return dev


def _with_fault(fn: Callable[..., Any], fault: dict[str, Any] | None, name: str) -> Callable[..., Any]:
    """Wrap ``fn`` with the test-only fault of ``runtime.fault`` when it targets ``name``."""
    if not fault or fault.get("component") != name:
        return fn
    after = int(fault.get("after_batches", 0))
    kind = fault.get("kind", "raise")
    times = int(fault.get("times", 1))  # sleep faults: how many batches sleep
    seen = [0, 0]

    def faulty(*args: Any) -> Any:
        seen[0] += 1
        if seen[0] > after:
            if kind == "sleep":
                if seen[1] < times:
                    seen[1] += 1
                    time.sleep(float(fault.get("sleep_s", 1.0)))
            else:
                raise RuntimeError(f"injected fault (runtime.fault) after {after} batches")
        return fn(*args)

    return faulty


def _as_tuple(out: Any) -> tuple[Any, ...]:
    if isinstance(out, tuple | list):
        return tuple(out)
    return (out,)


# ----------------------------------------------------------------------------------- component ranks
def serve_component(
    comm: Any,
    df: Dataflow,
    name: str,
    fn: Callable[..., Any],
    batch_size: int,
    max_wait_s: float,
    request_timeout_s: float = 60.0,
    tracer: Any = None,
    device: Any = None,
    abort_grace_s: float = 3.0,
    idle_sleep_s: float = 2e-3,
) -> dict[str, Any]:
    """Serve component ``name`` on this rank until the frontend sends STOP; return counters.

    Joins inputs per request, batches up to ``batch_size`` or ``max_wait_s``, runs ``fn`` and sends
    each output row to the rank its request's route names (``[Note: serve dataflow]``).
    """
    import torch

    from hpcsplit.runtime import mailbox as mb
    from hpcsplit.runtime import transport as tp
    from hpcsplit.runtime.batching import Batcher, JoinBuffer, Row, stack_rows
    from hpcsplit.runtime.threads import cpu_seconds
    from hpcsplit.runtime.trace import Tracer

    rank = comm.Get_rank()
    flow = df.component(name)
    tracer = tracer or Tracer(rank, None, None)
    comp_index = {c.name: c.index for c in df.components}
    groups = [(None if dst == OUTPUT else comp_index[dst], pairs) for dst, pairs in df.send_groups(name).items()]
    join = JoinBuffer(len(flow.inputs))
    batcher = Batcher(batch_size, max_wait_s)
    inbox = mb.Inbox(comm, device)
    outbox = mb.Outbox()
    backoff = mb.Backoff(deep_sleep_s=idle_sleep_s)
    stats = {"rank": rank, "component": name, "batches": 0, "requests": 0, "compute_s": 0.0,
             "expired": 0, "max_batch": 0}
    # (wall-clock end, ms) of every batch of one request: the bench compares a level's with the profile
    b1_at: list[float] = []
    b1_ms: list[float] = []
    t_start, cpu_start = time.perf_counter(), cpu_seconds()
    db = mb._DOORBELL
    db_start = db.wakeups if db is not None else 0
    stops_needed = set(df.upstream_ranks(name))
    stopping = False
    next_expire = t_start + 1.0
    # CUDA kernels run asynchronously: the compute span ends when the stream is done, not when the
    # launches return (the send would synchronise anyway, see transport._send_buffer)
    cuda_sync = torch.cuda.current_stream(device).synchronize if getattr(device, "type", "") == "cuda" else None
    with torch.inference_mode():
        while True:
            worked = False
            for m, t_hdr in inbox.poll():
                worked = True
                h = m.header
                if h.kind == tp.KIND_STOP:
                    stops_needed.discard(m.source)
                    stopping = not stops_needed
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
                    t0 = time.perf_counter()
                    outs = _as_tuple(fn(*inputs))
                    if cuda_sync is not None:
                        cuda_sync()
                    t1 = time.perf_counter()
                except Exception as e:  # noqa: BLE001 - reported to the frontend, then re-raised
                    msg = (f"rank {rank} component {name!r} failed on requests {ids[:16]}"
                           f"{'...' if len(ids) > 16 else ''}: {type(e).__name__}: {e}\n"
                           + traceback.format_exc(limit=6))
                    _report_and_raise(comm, msg, abort_grace_s, e)
                tracer.span("compute", t0, t1, ids, batch=len(ids))
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
                _send_outputs(comm, outbox, groups, items, outs, flow.out_bdims, tracer, path_us)
            outbox.reap()
            if now > next_expire:
                next_expire = now + 1.0
                stats["expired"] += len(join.expire(now, request_timeout_s))
            if stopping and not len(batcher) and not inbox.pending:
                # every receiver keeps receiving until it has our STOP, so these complete
                if not outbox.drain(timeout_s=120.0):
                    _say(rank, f"{name}: {len(outbox.pending)} send(s) still not received 120 s after STOP")
                for r in df.downstream_ranks(name):
                    outbox.add(tp.isend_message(comm, r, tp.KIND_STOP), r)
                outbox.drain(timeout_s=120.0)
                break
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
        stats.update(doorbell_wakeups=db.wakeups - db_start)
    return stats


def _send_outputs(comm: Any, outbox: Any, groups: Any, items: list[Any], outs: tuple[Any, ...],
                  out_bdims: tuple[tuple[int, ...], ...], tracer: Any, path_us: int = 0) -> None:
    from hpcsplit.runtime import transport as tp
    from hpcsplit.runtime.batching import take_requests

    t0 = time.perf_counter()
    ids = [it.request_id for it in items]
    routes = [it.route for it in items]
    for ci, pairs in groups:
        by_rank: dict[int, list[int]] = {}
        for k, route in enumerate(routes):
            by_rank.setdefault(0 if ci is None else route[ci], []).append(k)
        for dest, pos in by_rank.items():
            sel = [(slot, take_requests(outs[j], out_bdims[j], pos), out_bdims[j][0]) for j, slot in pairs]
            outbox.add(tp.isend_message(comm, dest, tp.KIND_DATA, [ids[k] for k in pos],
                                        [routes[k] for k in pos], sel, aux=path_us), dest)
    tracer.span("send", t0, time.perf_counter(), ids)


def _report_and_raise(comm: Any, msg: str, grace_s: float, exc: BaseException) -> None:
    """Tell the frontend (so it writes partial outputs and aborts), then raise ourselves."""
    import torch

    from hpcsplit.runtime import transport as tp

    rank = comm.Get_rank()
    _say(rank, msg.splitlines()[0])
    try:
        payload = torch.frombuffer(bytearray(msg.encode("utf-8")), dtype=torch.uint8)
        h = tp.isend_message(comm, 0, tp.KIND_ERROR, (), (), [(0, payload)], aux=len(payload))
        from hpcsplit.runtime import mailbox as mb

        mb.ring(0)
        tp.wait_polling(h.test, timeout_s=grace_s)
        time.sleep(grace_s)  # the frontend aborts the job; if it cannot, we do below
    finally:
        raise RuntimeStageError(msg.splitlines()[0]) from exc


# ------------------------------------------------------------------------------------------ mpi_main
def mpi_main(cfg: dict[str, Any], run_dir: str, comm: Any | None = None) -> dict[str, Any] | None:
    """Entry of ``stage=serve`` and ``stage=bench`` on every rank (``[Note: serve rank lifecycle]``).

    Returns
    -------
    dict or None
        On rank 0 the summary (batch: counts, output file, latency; bench: per-level summaries and
        result files); None on other ranks.
    """
    comm = _mpi.get_comm(comm)
    rank = comm.Get_rank()
    run_path = Path(run_dir)
    rt = runtime_settings(cfg)
    plan = Plan.load(_input_path(cfg, run_path, "plan"))
    _mpi.check_world_size(comm, plan.world_size)
    entry = plan.rank_entry(rank)
    node_comm = comm.Split_type(_mpi.MPI.COMM_TYPE_SHARED)
    local_ranks = node_comm.Get_size()
    node_comm.Free()
    choice = configure_rank(rt, entry.threads if plan.device_kind == "cpu" else None, local_ranks)

    import torch  # only now: OpenMP reads OMP_NUM_THREADS / OMP_WAIT_POLICY when torch loads it

    from hpcsplit.runtime import session
    from hpcsplit.runtime.routing import graph_from_switchboard
    from hpcsplit.runtime.transport import cuda_aware_mpi
    from hpcsplit.switchboard import Switchboard

    torch.set_num_threads(choice.threads)
    device = _bind_device(plan, entry, rank)
    aware, why = cuda_aware_mpi()
    role = "frontend" if entry.role == "frontend" else f"component {entry.component!r} replica {entry.replica}"
    _say(rank, f"{role}: {choice.describe()}, device {device}, {_mpi.mpi_library_version()}, "
               f"CUDA-aware MPI: {aware} ({why})")
    sb = Switchboard.load(_input_path(cfg, run_path, "switchboard"))
    if plan.switchboard_sha256 and getattr(sb, "sha256", None) and sb.sha256 != plan.switchboard_sha256:
        from hpcsplit.errors import PlanError

        raise PlanError(
            f"the plan was made for switchboard {plan.switchboard_sha256[:12]} but "
            f"{_input_path(cfg, run_path, 'switchboard')} is {sb.sha256[:12]}; pass the matching "
            "switchboard=... or re-run the allocate stage"
        )
    graph = graph_from_switchboard(sb)
    variants: list[tuple[str, Dataflow]] = []
    if rt["mode"] == "bench":
        variants.append(("whole", build_dataflow(whole_plan(plan), whole_graph_of(graph))))
    variants.append(("split", build_dataflow(plan, graph)))
    if rank == 0:
        _say(rank, "plan:\n" + plan.format())
        for vname, df in variants:
            _say(rank, f"{vname} " + df.format())
    ctx = session.Context(comm=comm, cfg=cfg, rt=rt, plan=plan, sb=sb, run_dir=run_path, device=device,
                          threads=choice)
    from hpcsplit.runtime.doorbell import start_doorbell

    # MPICH's blocking collectives spin: meet at a sleeping barrier first, so the doorbell's collectives
    # (and, at the end, its close and MPI_Finalize) do not spin while a slower rank loads or plots
    session._barrier(comm)
    db = None
    if rt["doorbell"]:  # [Note: doorbell]
        db = start_doorbell(comm, rt["doorbell"] is True, rt["doorbell_network"])
        if db.note:
            _say(rank, db.note)
    if entry.role == "frontend":
        out: dict[str, Any] | None = session.run_frontend(ctx, variants)
    else:
        session.run_component_rank(ctx, variants, entry)
        out = None
    session._barrier(comm)
    if db is not None:  # collective, so only on success: a failing rank aborts the whole job instead
        db.close()
    return out
