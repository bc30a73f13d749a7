"""``runtime.mode=server`` on the frontend rank: the HTTP and gRPC servers in a thread, the continuous
frontend loop in the rank's main thread.

[Note: server mode]
After the end-to-end check, rank 0 starts an aiohttp server and a grpc.aio server on one asyncio loop
in a daemon thread (:class:`ServerThread`), listening on ``runtime.server_host`` (null: the address this
node's name resolves to; never all interfaces unless asked).  With ``runtime.server_token`` a random token
is written ``0600`` to the run folder (``server.token``) and every call must carry it.  Once both listen,
``endpoint.json`` (host, ports, model, token file) is written and the server reports ready.

Checked requests come through the :class:`~hpcsplit.runtime.server.hub.Hub`'s bounded queue into
:func:`serve_requests`, which admits their samples (a request of batch N is N samples) into the same
routing, batching and replicas as batch and bench mode (at most ``runtime.max_inflight`` samples in the
pipeline), collects the outputs and answers each request once all its samples are back.  A request not
answered ``runtime.request_timeout_s`` after its arrival is answered with an error (504) and its late
outputs are dropped.

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
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import torch
from aiohttp import web

from hpcsplit.errors import RuntimeStageError
from hpcsplit.runtime import mailbox as mb
from hpcsplit.runtime import transport as tp
from hpcsplit.runtime.context import RankContext, say
from hpcsplit.runtime.doorbell import node_address
from hpcsplit.runtime.faults import COMPONENT_SIGNAL_GRACE_S, stop_signal
from hpcsplit.runtime.frontend import Frontend, RemoteRankError
from hpcsplit.runtime.server.grpc_api import make_handler
from hpcsplit.runtime.server.http_api import make_app
from hpcsplit.runtime.server.hub import Hub, Ticket
from hpcsplit.runtime.server.protocol import ModelSpec, RequestRejected

__all__ = ["ServerThread", "model_spec", "run_server", "serve_requests", "write_private"]

VERSION = "0.1.0"


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


class ServerThread:
    """The HTTP and gRPC servers on one asyncio loop in a daemon thread."""

    def __init__(self, hub: Hub, host: str, http_port: int, grpc_port: int, max_body: int, timeout_s: float) -> None:
        self.hub, self.host = hub, host
        self._want = (http_port, grpc_port)
        self.max_body, self.timeout_s = max_body, timeout_s
        self.http_port = self.grpc_port = 0
        self.loop: asyncio.AbstractEventLoop | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._runner: web.AppRunner | None = None
        self._grpc: grpc.aio.Server | None = None
        self.thread = threading.Thread(target=self._main, name="hpcsplit-server", daemon=True)

    def start(self, timeout_s: float = 30.0) -> None:
        self.thread.start()
        if not self._started.wait(timeout_s):
            raise RuntimeStageError(f"the HTTP/gRPC servers did not start within {timeout_s:g} s")
        if self._error is not None:
            raise RuntimeStageError(f"could not start the servers on {self.host} (ports {self._want}): "
                                    f"{type(self._error).__name__}: {self._error}. Choose other ports "
                                    "(runtime.server_http_port / server_grpc_port; 0 picks free ones) or another "
                                    "runtime.server_host") from None

    def _main(self) -> None:
        loop = asyncio.new_event_loop()
        self.loop = loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._start())
        except BaseException as e:  # noqa: BLE001 - reported by start() in the rank's thread
            self._error = e
            self._started.set()
            return
        self._started.set()
        try:
            loop.run_forever()
        finally:
            loop.close()

    async def _start(self) -> None:
        app = make_app(self.hub, self.max_body, self.timeout_s, VERSION)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self._want[0], backlog=1024)
        await site.start()
        self.http_port = int(self._runner.addresses[0][1])
        opts = [("grpc.max_receive_message_length", self.max_body), ("grpc.max_send_message_length", 1 << 30),
                ("grpc.so_reuseport", 0)]
        self._grpc = grpc.aio.server(options=opts)
        self._grpc.add_generic_rpc_handlers((make_handler(self.hub, self.timeout_s, VERSION),))
        self.grpc_port = self._grpc.add_insecure_port(f"{self.host}:{self._want[1]}")
        if not self.grpc_port:
            raise OSError(f"gRPC could not bind {self.host}:{self._want[1]}")
        await self._grpc.start()

    async def _stop(self) -> None:
        if self._grpc is not None:
            await self._grpc.stop(grace=1.0)
        if self._runner is not None:
            await self._runner.cleanup()

    def stop(self, timeout_s: float = 10.0) -> None:
        loop = self.loop
        if loop is None or not self.thread.is_alive():
            return
        fut = asyncio.run_coroutine_threadsafe(self._stop(), loop)
        try:
            fut.result(timeout_s)
        except Exception as e:  # noqa: BLE001 - closing anyway; the thread is a daemon
            say(0, f"server: closing the servers: {type(e).__name__}: {e}")
        loop.call_soon_threadsafe(loop.stop)
        self.thread.join(timeout_s)


# ------------------------------------------------------------------------------------------ the loop
class _Job:
    """A ticket inside the loop: its sample rows and the outputs collected so far."""

    __slots__ = ("left", "outs", "rows", "ticket")

    def __init__(self, ticket: Ticket, rows: list[int], n_outputs: int) -> None:
        self.ticket, self.rows, self.left = ticket, rows, len(rows)
        self.outs: list[list[Any]] = [[None] * len(rows) for _ in range(n_outputs)]


def serve_requests(ctx: RankContext, fe: Frontend, hub: Hub) -> dict[str, Any]:
    """The continuous frontend loop (``[Note: server mode]``); returns the counts when it has drained."""
    rt = ctx.runtime
    df = fe.df
    bdo = df.output_bdims
    timeout_s = rt.request_timeout_s
    drain_s = min(rt.server_drain_s, rt.abort_grace_s + COMPONENT_SIGNAL_GRACE_S - 1.0)
    jobs: dict[int, _Job] = {}  # first row id -> job, in arrival order
    row_job: dict[int, tuple[_Job, int]] = {}  # row id -> (job, position)
    pending: list[int] = []  # rows taken, not yet admitted
    inflight: dict[int, list[Any]] = {}  # row id -> [route, outputs, missing, critical-path us]
    row_inputs: dict[int, list[torch.Tensor]] = {}
    admit_s: dict[int, float] = {}
    done_s: dict[int, float] = {}
    status: dict[int, int] = {}
    backoff = mb.Backoff(deep_sleep_s=rt.idle_sleep_ms / 1e3)
    counts = {"requests": 0, "samples": 0, "ok": 0, "failed": 0}
    drain_at: float | None = None
    next_scan = 0.0

    def get_inputs(idx: np.ndarray) -> list[torch.Tensor]:
        return [torch.cat([row_inputs[int(r)][i] for r in idx], 0) for i in range(len(df.inputs))]

    def drop(job: _Job, err: RequestRejected, outcome: str) -> None:
        for r in job.rows:
            rec = inflight.pop(r, None)
            if rec is not None:
                fe.router.release(rec[0], failed=True)
            row_job.pop(r, None)
            row_inputs.pop(r, None)
        jobs.pop(job.rows[0], None)
        counts["failed"] += 1
        hub.fail(job.ticket, err, outcome)

    def row_done(r: int, outs: list[Any], aux: int) -> None:
        job, k = row_job.pop(r)
        row_inputs.pop(r, None)
        for j, o in enumerate(outs):
            job.outs[j][k] = o
        job.ticket.compute_us = max(job.ticket.compute_us, aux)
        job.left -= 1
        if job.left == 0:
            jobs.pop(job.rows[0], None)
            arrays = [torch.cat(job.outs[j], bdo[j][0]).movedim(bdo[j][0], 0).cpu().numpy()
                      for j in range(len(bdo))]
            counts["ok"] += 1
            hub.finish(job.ticket, arrays)

    def on_passthrough(r: int, outs: list[torch.Tensor]) -> None:
        row_done(r, outs, 0)

    t0 = time.perf_counter()
    while True:
        now = time.perf_counter()
        worked = False
        sig = stop_signal()
        if sig is not None and drain_at is None:
            hub.draining.set()
            drain_at = now + drain_s
            say(0, f"server: {sig[0]} received: not ready, refusing new requests, draining {len(jobs)} request(s) "
                   f"(at most {drain_s:g} s)")
        # ---- take new requests while the pipeline window has room
        room = rt.max_inflight - len(inflight) - len(pending)
        if room > 0:
            for t in hub.take(max(1, room)):
                worked = True
                n = t.req.batch
                rows = list(range(fe.next_id, fe.next_id + n))
                fe.next_id += n
                job = _Job(t, rows, len(bdo))
                jobs[rows[0]] = job
                for k, r in enumerate(rows):
                    row_job[r] = (job, k)
                    row_inputs[r] = [torch.from_numpy(np.array(a[k:k + 1])) for a in t.req.arrays]
                pending.extend(rows)
                counts["requests"] += 1
                counts["samples"] += n
        # ---- admit pending rows
        if pending:
            k = max(0, min(len(pending), rt.max_inflight - len(inflight)))
            adm, pending = pending[:k], pending[k:]
            if adm:
                worked = True
                t_now = time.perf_counter()
                for r in adm:
                    rj = row_job.get(r)
                    if rj is not None and rj[0].ticket.t_admit == 0.0:
                        rj[0].ticket.t_admit = t_now
                fe.admit_rows(adm, inflight, get_inputs, admit_s, done_s, status, t_now - t0, on_passthrough)
                admit_s.clear()  # per-row records the batch loop keeps; a server would only grow them
                done_s.clear()
                status.clear()
                hub.inflight_rows = len(inflight)
        # ---- collect outputs
        for m, _t_hdr in fe.inbox.poll():
            worked = True
            h = m.header
            if h.kind == tp.KIND_ERROR:
                msg = fe_error(m)
                hub.failed = msg
                hub.draining.set()
                err = RequestRejected(f"a component failed: {msg}", 500, "INTERNAL")
                for job in list(jobs.values()):
                    drop(job, err, "error")
                for t in hub.take(1 << 30):
                    hub.fail(t, err, "error")
                time.sleep(0.5)  # the answers leave before the job aborts
                raise RemoteRankError(msg)
            if h.kind == tp.KIND_CONTROL and m.tensors:  # a component's live counters (for /metrics)
                if 0 <= h.aux < len(df.components):
                    hub.component_stats(df.components[h.aux].name, m.source, m.tensors[0].tolist())
                continue
            if h.kind != tp.KIND_DATA:
                continue
            for row, rid in enumerate(h.request_ids):
                rec = inflight.get(rid)
                if rec is None:
                    continue  # timed out earlier
                for meta, ten in zip(h.tensors, m.tensors, strict=True):
                    rec[1][meta.slot] = ten.narrow(meta.rdim, row, 1)
                    rec[2] -= 1
                rec[3] = max(rec[3], h.aux)
                if rec[2] <= 0:
                    del inflight[rid]
                    fe.router.release(rec[0])
                    row_done(rid, rec[1], rec[3])
            hub.inflight_rows = len(inflight)
        fe.outbox.reap()
        # ---- timeouts, every 10 ms (oldest first)
        if now >= next_scan:
            next_scan = now + 0.01
            expired = []
            for job in jobs.values():
                if now - job.ticket.t_arrival > timeout_s:
                    expired.append(job)
                else:
                    break
            for job in expired:
                worked = True
                gone = set(job.rows)
                pending = [r for r in pending if r not in gone]
                drop(job, RequestRejected(f"request {job.ticket.req.id or job.rows[0]!r} was not answered within "
                                          f"runtime.request_timeout_s={timeout_s:g} s", 504, "DEADLINE_EXCEEDED"),
                     "timeout")
        # ---- drain
        if drain_at is not None:
            if not jobs and hub.queue.empty():
                break
            if now > drain_at:
                err = RequestRejected(f"the server stopped (drain of runtime.server_drain_s={rt.server_drain_s:g} s "
                                      "ran out)", 503, "UNAVAILABLE")
                for job in list(jobs.values()):
                    drop(job, err, "error")
                for t in hub.take(1 << 30):
                    hub.fail(t, err, "error")
                break
        if worked:
            backoff.reset()
        else:
            t_idle = time.perf_counter()
            wake = None
            if jobs:  # the oldest request's deadline (a quiet sleep may last 100 ms)
                wake = max(next(iter(jobs.values())).ticket.t_arrival + timeout_s, next_scan)
            if drain_at is not None:
                wake = t_idle + 0.01 if wake is None else min(wake, t_idle + 0.01)
            backoff.idle(t_idle, wake, bool(fe.inbox.pending) or fe.outbox.in_flight(t_idle),
                         quiet=not fe.inbox.pending and not fe.outbox.pending and not inflight)
    return counts


def fe_error(m: tp.Message) -> str:
    if m.tensors:
        return bytes(m.tensors[0].numpy().tobytes()).decode("utf-8", "replace")
    return f"rank {m.source} failed (no message)"


def run_server(ctx: RankContext, fe: Frontend) -> dict[str, Any]:
    """Server mode on rank 0 (``[Note: server mode]``): start, serve until stopped, drain; the counts."""
    rt = ctx.runtime
    paths = ctx.paths
    spec = model_spec(ctx, fe)
    token = secrets.token_urlsafe(32) if rt.server_token else None
    if token is not None:
        write_private(paths.server_token, token + "\n")
    host = rt.server_host or node_address(rt.doorbell_network)
    hub = Hub(spec, rt.server_queue, token)
    srv = ServerThread(hub, host, rt.server_http_port, rt.server_grpc_port, int(rt.server_max_body_mb * (1 << 20)),
                       rt.request_timeout_s + 5.0)
    srv.start()
    # all interfaces (only when asked): clients still need this node's own address
    shown = node_address(rt.doorbell_network) if host in ("0.0.0.0", "::") else host
    endpoint = {"host": shown, "listen": host, "http_port": srv.http_port, "grpc_port": srv.grpc_port, "model": spec.name,
                "model_version": spec.version, "http_url": f"http://{shown}:{srv.http_port}",
                "grpc_target": f"{shown}:{srv.grpc_port}",
                "token_file": str(paths.server_token.resolve()) if token is not None else None,
                "pid": os.getpid(), "started": time.time()}
    hub.ready.set()
    write_private(paths.server_endpoint, json.dumps(endpoint, indent=2) + "\n")
    say(0, f"server: ready at http://{host}:{srv.http_port} (HTTP) and {host}:{srv.grpc_port} (gRPC), model "
           f"{spec.name!r}; endpoint in {paths.server_endpoint}")
    try:
        counts = serve_requests(ctx, fe, hub)
    finally:
        hub.draining.set()
        srv.stop()
        hub.close()
        for p in (paths.server_endpoint, paths.server_token):
            try:
                p.unlink()
            except FileNotFoundError:
                pass
    say(0, f"server: stopped after {counts['requests']} request(s) ({counts['samples']} samples, {counts['ok']} "
           f"answered, {counts['failed']} failed)")
    return {"server": {**counts, "host": host, "http_port": srv.http_port, "grpc_port": srv.grpc_port}}
