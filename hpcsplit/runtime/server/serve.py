"""``runtime.mode=server`` on the frontend rank: the HTTP and gRPC servers and the frontend loop on one
event loop in the rank's main thread.

[Note: server mode]
After the end-to-end check, rank 0 starts an aiohttp server and a grpc.aio server on an asyncio loop in
its main thread (:class:`Servers`), listening on ``runtime.server_host`` (null: the address this
node's name resolves to; never all interfaces unless asked).  With ``runtime.server_token`` a random token
is written ``0600`` to the run folder (``server.token``) and every call must carry it.  Once both listen,
``endpoint.json`` (host, ports, model, token file) is written and the server reports ready.

One thread does it all: :class:`ServeLoop` (the frontend's side) is a task on the same loop, so a request
goes from its handler into the pipeline and back without a thread hand-over, and the handlers and the MPI
calls never contend for the GIL.  A first version ran the servers in a thread of their own beside the
MPI loop: the two fought for the GIL, and a trivial model served 640 req/s at concurrency 1 with 1.4 ms
added to the p50 (``python -m hpcsplit.bench server``).  The loop's pauses
(:class:`_Waker`) end on a timer, on a new request, or when a rank rings this rank's doorbell, whose
sockets are readers of the loop: one ``epoll`` waits for clients and ranks alike.  Short pauses (under
``DOORBELL_MIN_SLEEP_S``) are a plain sleep, since asyncio's timers wait in whole milliseconds; with nothing
in flight the loop waits on the doorbell at once (only a client or a rank can bring work then).

With ``runtime.server_workers`` > 0 (null: one per spare core of the node) the two servers run in
protocol worker processes instead, on the same ports, and hand their checked requests to this loop over
a channel each (``[Note: protocol workers]`` in :mod:`~hpcsplit.runtime.server.worker`); the loop below is
the same.  With ``runtime.tls_cert`` and ``runtime.tls_key`` both protocols are served over TLS.

Checked requests come through the :class:`~hpcsplit.runtime.server.hub.Hub`'s bounded queue into
:func:`serve_requests`, which admits their samples (a request of batch N is N samples) into the same
routing, batching and replicas as batch and bench mode (at most ``runtime.max_inflight`` samples in the
pipeline), collects the outputs and answers each request once all its samples are back.  A request not
answered ``runtime.request_timeout_s`` after its arrival (waiting in the queue or in the pipeline) is answered
with an error (504) and its late outputs are dropped; when the loop ends, whatever still waits is
answered (503).  That is the handlers' deadline: they wait on their ticket without a timer of their own.

Stop: a stop signal (``[Note: stop signals]``: SIGTERM from scancel, SLURM preemption, the login side's
Ctrl-C) makes readiness false and refuses new requests (503); what was accepted is finished within
``runtime.server_drain_s`` (what is left then is answered 503), the servers close, and the job ends as a
finished one (exit 0).  A component's exception (an ERROR message) is answered to every waiting request
(500) before :class:`~hpcsplit.runtime.frontend.RemoteRankError` aborts the job as in the other modes.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hpcsplit.errors import RuntimeStageError
from hpcsplit.runtime import mailbox as mb
from hpcsplit.runtime import transport as tp
from hpcsplit.runtime.context import RankContext, say
from hpcsplit.runtime.doorbell import node_address
from hpcsplit.runtime.faults import COMPONENT_SIGNAL_GRACE_S, stop_signal
from hpcsplit.runtime.frontend import Frontend, RemoteRankError
from hpcsplit.runtime.server.failover import Failover, read_token
from hpcsplit.runtime.server.hub import Hub, Ticket
from hpcsplit.runtime.server.protocol import ModelSpec, RequestRejected
from hpcsplit.runtime.server.servers import VERSION, Servers
from hpcsplit.runtime.server.tls import load_tls
from hpcsplit.runtime.server.workers import Workers, auto_workers
from hpcsplit.runtime.threads import usable_cores

__all__ = ["VERSION", "ServeLoop", "Servers", "model_spec", "protocol_workers", "run_server", "serve_requests",
           "write_private"]


def model_spec(ctx: RankContext, fe: Frontend) -> ModelSpec:
    """The served model: the switchboard's name, inputs and outputs in the dataflow's order."""
    lay = ctx.switchboard.layout
    ins = {t.name: t for t in lay.inputs}
    outs = {t.name: t for t in lay.outputs}
    return ModelSpec.from_layout(ctx.switchboard.model_name, [ins[n] for n in fe.df.inputs],
                                 [outs[n] for n in fe.df.outputs], ctx.runtime.server_max_batch)


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable by the owner only (0600), replacing what is there."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------------ the loop
class _Job:
    """A ticket inside the loop: its sample rows and the outputs collected so far (numpy views of the
    received messages, one per row, batch dim first)."""

    __slots__ = ("left", "outs", "rows", "ticket")

    def __init__(self, ticket: Ticket, rows: list[int], n_outputs: int) -> None:
        self.ticket, self.rows, self.left = ticket, rows, len(rows)
        self.outs: list[list[Any]] = [[None] * len(rows) for _ in range(n_outputs)]


class _Fatal(Exception):
    """A component failed: every waiting request was answered; the job aborts once the answers left."""


class ServeLoop:
    """The frontend's side of server mode (``[Note: server mode]``): :meth:`step` takes requests from the hub,
    admits their samples, collects outputs and answers tickets; it never blocks."""

    def __init__(self, ctx: RankContext, fe: Frontend, hub: Hub) -> None:
        rt = ctx.runtime
        self.rt, self.fe, self.hub, self.df = rt, fe, hub, fe.df
        self.bdo = fe.df.output_bdims
        self.timeout_s = rt.request_timeout_s
        self.drain_s = min(rt.server_drain_s, rt.abort_grace_s + COMPONENT_SIGNAL_GRACE_S - 1.0)
        self.jobs: dict[int, _Job] = {}  # first row id -> job, in arrival order
        self.row_job: dict[int, tuple[_Job, int]] = {}  # row id -> (job, position)
        self.pending: list[int] = []  # rows taken, not yet admitted
        self.inflight: dict[int, list[Any]] = {}  # row id -> [route, outputs, missing, critical-path us]
        self._admit_s: dict[int, float] = {}
        self._done_s: dict[int, float] = {}
        self._status: dict[int, int] = {}
        self.counts = {"requests": 0, "samples": 0, "ok": 0, "failed": 0}
        self.drain_at: float | None = None
        self.done = False
        self.fatal: str | None = None
        self._next_scan = 0.0
        self._t0 = time.perf_counter()
        self.failover = Failover(ctx, fe, hub)  # [Note: serving through faults]

    def _get_inputs(self, idx: np.ndarray) -> list[torch.Tensor]:
        """The admitted rows' inputs: one copy per input, of the runs of consecutive rows of each request
        (a request's rows are admitted in order, so a request of batch N is one slice of its arrays)."""
        rj = self.row_job
        runs: list[tuple[list[np.ndarray], int, int]] = []
        for r in idx.tolist():
            job, k = rj[r]
            arrays = job.ticket.req.arrays
            if runs and runs[-1][0] is arrays and runs[-1][2] == k:
                runs[-1] = (arrays, runs[-1][1], k + 1)
            else:
                runs.append((arrays, k, k + 1))
        return [torch.from_numpy(np.concatenate([a[i][k0:k1] for a, k0, k1 in runs], 0))  # a fresh array
                for i in range(len(self.df.inputs))]

    def _drop(self, job: _Job, err: RequestRejected, outcome: str) -> None:
        if self.pending:  # its rows not admitted yet (a sample re-sent, or a request of many rows) go too
            gone = set(job.rows)
            self.pending = [r for r in self.pending if r not in gone]
        for r in job.rows:
            rec = self.inflight.pop(r, None)
            if rec is not None:
                self.fe.router.release(rec[0], failed=True)
            self.row_job.pop(r, None)
        self.jobs.pop(job.rows[0], None)
        self.counts["failed"] += 1
        self.hub.fail(job.ticket, err, outcome)

    def _fail_all(self, err: RequestRejected) -> None:
        for job in list(self.jobs.values()):
            self._drop(job, err, "error")
        for t in self.hub.take(1 << 30):
            self.hub.fail(t, err, "error")

    def _row_done(self, r: int, outs: list[Any], aux: int) -> None:
        job, k = self.row_job.pop(r)
        for j, o in enumerate(outs):
            job.outs[j][k] = o
        job.ticket.compute_us = max(job.ticket.compute_us, aux)
        job.left -= 1
        if job.left == 0:
            self.jobs.pop(job.rows[0], None)
            # one row: its view of the received message is the answer (the encoders copy what they send)
            arrays = [o[0] if len(o) == 1 else np.concatenate(o, 0) for o in job.outs]
            self.counts["ok"] += 1
            self.hub.finish(job.ticket, arrays)
            if self.fe.tracer.enabled:
                self.fe.tracer.span("request", job.ticket.t_arrival, time.perf_counter(), job.rows,
                                    queued_us=int((job.ticket.t_admit - job.ticket.t_arrival) * 1e6))

    def _on_passthrough(self, r: int, outs: list[torch.Tensor]) -> None:
        bdo = self.bdo
        self._row_done(r, [o.movedim(bdo[j][0], 0).cpu().numpy() for j, o in enumerate(outs)], 0)

    def step(self) -> bool:
        """One pass; whether it did work.  Sets :attr:`done` once drained; raises :class:`_Fatal` when a
        component failed (its waiting requests answered first)."""
        rt, fe, hub, inflight = self.rt, self.fe, self.hub, self.inflight
        now = time.perf_counter()
        worked = False
        sig = stop_signal()
        if sig is not None and self.drain_at is None:
            hub.draining.set()
            self.drain_at = now + self.drain_s
            say(0, f"server: {sig[0]} received: not ready, refusing new requests, draining {len(self.jobs)} "
                   f"request(s) (at most {self.drain_s:g} s)")
        # ---- take new requests while the pipeline window has room
        room = rt.max_inflight - len(inflight) - len(self.pending)
        if room > 0 and hub.queue:
            for t in hub.take(room):
                worked = True
                n = t.req.batch
                rows = list(range(fe.next_id, fe.next_id + n))
                fe.next_id += n
                job = _Job(t, rows, len(self.bdo))
                self.jobs[rows[0]] = job
                for k, r in enumerate(rows):
                    self.row_job[r] = (job, k)
                self.pending.extend(rows)
                self.counts["requests"] += 1
                self.counts["samples"] += n
        # ---- admit pending rows
        if self.pending:
            k = max(0, min(len(self.pending), rt.max_inflight - len(inflight)))
            adm, self.pending = self.pending[:k], self.pending[k:]
            if adm:
                worked = True
                t_now = time.perf_counter()
                for r in adm:
                    rj = self.row_job.get(r)
                    if rj is not None and rj[0].ticket.t_admit == 0.0:
                        rj[0].ticket.t_admit = t_now
                fe.admit_rows(adm, inflight, self._get_inputs, self._admit_s, self._done_s, self._status,
                              t_now - self._t0, self._on_passthrough)
                self._admit_s.clear()  # per-row records the batch loop keeps; a server would only grow them
                self._done_s.clear()
                self._status.clear()
                hub.inflight_rows = len(inflight)
        # ---- collect outputs
        heard = self.failover.heard
        for m, t_hdr in fe.inbox.poll():
            worked = True
            heard[m.source] = now
            h = m.header
            if self.fe.tracer.enabled:
                self.fe.tracer.span("recv_output", t_hdr, time.perf_counter(), h.request_ids, src=m.source)
            if h.kind == tp.KIND_ERROR:
                msg = fe_error(m)
                hub.failed = self.fatal = msg
                hub.draining.set()
                self._fail_all(RequestRejected(f"a component failed: {msg}", 500, "INTERNAL"))
                raise _Fatal(msg)
            if h.kind == tp.KIND_CONTROL and m.tensors:  # a component's live counters (for /metrics)
                if 0 <= h.aux < len(self.df.components):
                    hub.component_stats(self.df.components[h.aux].name, m.source, m.tensors[0].tolist())
                continue
            if h.kind != tp.KIND_DATA:
                continue
            # numpy views, batch dim first: a row is a slice (a view, no copy), joined once per request
            slots = [(meta.slot, _batch_first(ten.numpy(), meta.rdim)) for meta, ten in
                     zip(h.tensors, m.tensors, strict=True)]
            for row, rid in enumerate(h.request_ids):
                rec = inflight.get(rid)
                if rec is None:
                    continue  # timed out earlier
                for slot, a in slots:
                    rec[1][slot] = a[row:row + 1]
                    rec[2] -= 1
                rec[3] = max(rec[3], h.aux)
                if rec[2] <= 0:
                    del inflight[rid]
                    fe.router.release(rec[0])
                    self._row_done(rid, rec[1], rec[3])
            hub.inflight_rows = len(inflight)
        fe.outbox.reap()
        if self.failover.check(self, now):  # heartbeats; silent or ended replicas routed around
            worked = True
            if self.done:  # the last replica of a component was lost: the job ends, to be started again
                return worked
        # ---- timeouts, every 10 ms (oldest first)
        if now >= self._next_scan:
            self._next_scan = now + 0.01
            expired = []
            for job in self.jobs.values():
                if now - job.ticket.t_arrival > self.timeout_s:
                    expired.append(job)
                else:
                    break
            for job in expired:
                worked = True
                self._drop(job, self._late(job.ticket.req.id or job.rows[0]), "timeout")
            q = hub.queue  # requests still waiting for room in the pipeline (oldest first)
            while q and now - q[0].t_arrival > self.timeout_s:
                worked = True
                t = q.popleft()
                self.counts["requests"] += 1
                self.counts["samples"] += t.req.batch
                self.counts["failed"] += 1
                hub.fail(t, self._late(t.req.id or "(queued)"), "timeout")
        # ---- drain
        if self.drain_at is not None:
            if not self.jobs and not hub.queue:
                self.done = True
            elif now > self.drain_at:
                self._fail_all(RequestRejected(f"the server stopped (drain of runtime.server_drain_s="
                                               f"{rt.server_drain_s:g} s ran out)", 503, "UNAVAILABLE"))
                self.done = True
        return worked

    def _late(self, which: object) -> RequestRejected:
        return RequestRejected(f"request {which!r} was not answered within runtime.request_timeout_s="
                               f"{self.timeout_s:g} s", 504, "DEADLINE_EXCEEDED")

    def abandon(self, why: str) -> None:
        """Answer every request still waiting (503): the loop ends, and no handler may wait on a ticket
        nobody will resolve (the handlers' wait has no timer of its own: this and the timeout scan are
        its deadline).  The jobs first (their rows leave the router), then whatever the hub still has
        open, each on its own, even if a job could not be dropped."""
        err = RequestRejected(why, 503, "UNAVAILABLE")
        try:
            if self.jobs:
                self._fail_all(err)
        finally:
            self.hub.abandon(err)

    def pause(self, backoff: mb.Backoff) -> tuple[float, bool]:
        """The idle pause after a pass without work: ``(seconds, on the doorbell)`` (:meth:`Backoff.plan`)."""
        fe = self.fe
        t_idle = time.perf_counter()
        wake = None
        if self.jobs:  # the oldest request's deadline (a quiet sleep may last 100 ms)
            wake = max(next(iter(self.jobs.values())).ticket.t_arrival + self.timeout_s, self._next_scan)
        if self.drain_at is not None:
            wake = t_idle + 0.01 if wake is None else min(wake, t_idle + 0.01)
        quiet = not fe.inbox.pending and not fe.outbox.pending and not self.inflight
        db = mb._DOORBELL
        if quiet and db is not None and db.quiet_sleep_s is not None:
            # nothing on the way: only a client (whose request kicks the loop) or a rank's ring brings
            # work, so wait for either at once (no backoff first: its spins and short sleeps would take
            # the cores the clients and the component ranks need, and block this loop while they last)
            s = db.quiet_sleep_s if wake is None else min(db.quiet_sleep_s, max(0.0, wake - t_idle))
            return s, s > 0
        return backoff.plan(t_idle, wake, bool(fe.inbox.pending) or fe.outbox.in_flight(t_idle), quiet=quiet)


def _batch_first(a: np.ndarray, dim: int) -> np.ndarray:
    """``a`` with its batch dim ``dim`` first (a view; ``np.moveaxis`` costs some 3 us even for dim 0)."""
    return a if dim == 0 else np.moveaxis(a, dim, 0)


def _settle(fut: asyncio.Future[bool], value: bool) -> None:
    if not fut.done():
        fut.set_result(value)


class _Waker:
    """The event loop's idle pauses: they end at their timeout, when a request is submitted (:meth:`kick`,
    from a handler on this loop), or when a rank rings this one's doorbell (its sockets are readers of
    the loop, so one ``epoll`` waits for clients and ranks alike)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, db: Any) -> None:
        self.loop, self.db = loop, db
        self._fut: asyncio.Future[bool] | None = None
        self._fds = [sk.fileno() for sk in db.sockets] if db is not None else []
        for fd in self._fds:
            loop.add_reader(fd, self._on_ring)

    def _on_ring(self) -> None:  # also while busy: UDP rings from other nodes come whether or not we wait
        fut = self._fut
        self.db.rung(woke=fut is not None and not fut.done())
        self.kick()

    def kick(self) -> None:
        if self._fut is not None:
            _settle(self._fut, True)

    async def pause(self, seconds: float, on_bell: bool) -> bool:
        """Wait up to ``seconds``; True when woken early (work may be waiting)."""
        db = self.db if on_bell else None
        if db is not None and db.arm(db.probe_header):  # a message came before the flag went up
            return True
        fut = self.loop.create_future()
        self._fut = fut
        # the timer may fire in the loop turn after a kick settled the future, before this task resumes
        timer = self.loop.call_later(seconds, _settle, fut, False)
        try:
            return await fut
        finally:
            self._fut = None
            timer.cancel()
            if db is not None:
                db.disarm()

    def close(self) -> None:
        for fd in self._fds:
            self.loop.remove_reader(fd)


async def serve_requests(ctx: RankContext, fe: Frontend, hub: Hub) -> dict[str, Any]:
    """Run :class:`ServeLoop` on this event loop until it has drained; returns its counts.

    Between passes it yields to the loop (the servers read and answer clients); when a pass found no
    work it pauses as :class:`~hpcsplit.runtime.mailbox.Backoff` says, waking early for a new request or
    a ring.  A component failure is re-raised as :class:`RemoteRankError` once the answers have left.
    """
    sl = ServeLoop(ctx, fe, hub)
    backoff = mb.Backoff(spin_s=ctx.spin_s, deep_sleep_s=ctx.runtime.idle_sleep_ms / 1e3)
    waker = _Waker(asyncio.get_running_loop(), mb._DOORBELL)
    hub.on_submit = waker.kick
    try:
        while not sl.done:
            try:
                worked = sl.step()
            except _Fatal as e:
                await asyncio.sleep(0.5)  # the answers leave before the job aborts
                raise RemoteRankError(str(e)) from None
            if worked:
                backoff.reset()
                await asyncio.sleep(0)
                continue
            seconds, on_bell = sl.pause(backoff)
            if seconds < mb.DOORBELL_MIN_SLEEP_S:
                # a spin or a short sleep (a reply is near, or a message is half-way): asyncio's timers
                # wait in whole milliseconds (epoll), so sleep here, then give the loop its turn
                if seconds > 0:
                    time.sleep(seconds)  # noqa: ASYNC251 - under 100 us, on purpose (above)
                elif backoff.yielding:  # a long spin lets whatever else has work on this core run first
                    os.sched_yield()
                await asyncio.sleep(0)
            elif await waker.pause(seconds, on_bell):  # without a doorbell: a timer or a new request
                backoff.reset()
    finally:
        hub.on_submit = None
        hub.draining.set()
        waker.close()
        try:
            sl.abandon("the server stopped before this request was answered")
        except Exception as e:  # noqa: BLE001 - the loop's own error is the one that propagates
            say(0, f"server: answering the requests left: {type(e).__name__}: {e}")
        sl.failover.close()
    return {**sl.counts, **sl.failover.summary()}


def fe_error(m: tp.Message) -> str:
    if m.tensors:
        return bytes(m.tensors[0].numpy().tobytes()).decode("utf-8", "replace")
    return f"rank {m.source} failed (no message)"


def run_server(ctx: RankContext, fe: Frontend) -> dict[str, Any]:
    """Server mode on rank 0 (``[Note: server mode]``): start, serve until stopped, drain; the counts."""
    loop = asyncio.new_event_loop()  # not asyncio.run: the rank's stop-signal handlers stay as they are
    asyncio.set_event_loop(loop)
    try:
        return loop.run_until_complete(_run_server(ctx, fe))
    finally:
        asyncio.set_event_loop(None)
        loop.close()


def protocol_workers(ctx: RankContext) -> int:
    """``runtime.server_workers``, resolved: null is one per core the ranks of the frontend's node leave spare
    (:func:`~hpcsplit.runtime.server.workers.auto_workers`)."""
    n = ctx.runtime.server_workers
    if n is not None:
        return n
    node = ctx.entry.node
    used = sum(max(1, e.threads) for e in ctx.plan.ranks if e.node == node)
    return auto_workers(usable_cores(), used)


async def _run_server(ctx: RankContext, fe: Frontend) -> dict[str, Any]:
    rt = ctx.runtime
    paths = ctx.paths
    spec = model_spec(ctx, fe)
    tls = load_tls(rt.tls_cert, rt.tls_key)
    token_path = Path(rt.server_token_file) if rt.server_token_file else paths.server_token
    token = None
    if rt.server_token:
        token = read_token(token_path) if rt.server_token_file else secrets.token_urlsafe(32)
        if not rt.server_token_file:
            write_private(paths.server_token, token + "\n")
    host = rt.server_host or node_address(rt.doorbell_network)
    hub = Hub(spec, rt.server_queue, token)
    n_workers = protocol_workers(ctx)
    max_body = int(rt.server_max_body_mb * (1 << 20))

    def servers(http_port: int, grpc_port: int) -> Servers | Workers:
        if n_workers:  # [Note: protocol workers] in hpcsplit.runtime.server.worker
            return Workers(hub, host, http_port, grpc_port, max_body, n_workers, tls, rt.server_drain_s,
                           lambda m: say(0, m))
        return Servers(hub, host, http_port, grpc_port, max_body, tls)

    srv = servers(rt.server_http_port, rt.server_grpc_port)
    try:
        await srv.start()
    except RuntimeStageError as e:
        if not rt.server_port_fallback or not (rt.server_http_port or rt.server_grpc_port):
            raise
        say(0, f"server: {e}; runtime.server_port_fallback: listening on free ports instead")
        srv = servers(0, 0)
        await srv.start()
    # all interfaces (only when asked): clients still need this node's own address
    shown = node_address(rt.doorbell_network) if host in ("0.0.0.0", "::") else host
    scheme = "https" if tls else "http"
    endpoint = {"host": shown, "listen": host, "http_port": srv.http_port, "grpc_port": srv.grpc_port, "model": spec.name,
                "model_version": spec.version, "http_url": f"{scheme}://{shown}:{srv.http_port}",
                "grpc_target": f"{shown}:{srv.grpc_port}", "tls": tls is not None,
                "token_file": str(token_path.resolve()) if token is not None else None,
                "pid": os.getpid(), "workers": n_workers,
                "worker_pids": srv.pids if isinstance(srv, Workers) else [], "started": time.time()}
    hub.ready.set()
    write_private(paths.server_endpoint, json.dumps(endpoint, indent=2) + "\n")
    how = f"{n_workers} protocol worker(s)" if n_workers else "on the frontend's thread"
    say(0, f"server: ready at {scheme}://{host}:{srv.http_port} (HTTP) and {host}:{srv.grpc_port} (gRPC"
           f"{', TLS' if tls else ''}), {how}, model {spec.name!r}; endpoint in {paths.server_endpoint}")
    counts: dict[str, Any] = {}
    try:
        serving = serve_requests(ctx, fe, hub)
        counts = await (srv.watch(serving) if isinstance(srv, Workers) else serving)
    finally:
        hub.draining.set()
        await srv.stop()
        # the token stays for the job the login side starts next (the same token: clients keep working)
        keep = counts.get("restart") or token_path != paths.server_token
        for p in (paths.server_endpoint, *(() if keep else (paths.server_token,))):
            try:
                p.unlink()
            except FileNotFoundError:
                pass
    say(0, f"server: stopped after {counts['requests']} request(s) ({counts['samples']} samples, {counts['ok']} "
           f"answered, {counts['failed']} failed)")
    return {"server": {**counts, "host": host, "http_port": srv.http_port, "grpc_port": srv.grpc_port,
                       "workers": n_workers}}
