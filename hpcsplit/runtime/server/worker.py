"""A protocol worker (``runtime.server_workers`` > 0): the HTTP and gRPC servers in a process of their own,
sharing the frontend's ports (``SO_REUSEPORT``), handing checked requests to the MPI frontend over its
channel (``[Note: protocol worker channel]``) and the answers back to its clients.

    python -m hpcsplit.runtime.server.worker FD PARENT_PID INDEX    (started by the frontend rank only)

[Note: protocol workers]
The frontend rank starts the workers (:mod:`~hpcsplit.runtime.server.workers`) and each one asks the
kernel to kill it when the frontend rank ends (``PR_SET_PDEATHSIG``: SIGKILL), checks that its parent is
still the one that started it (the parent may have died before the request), and also ends when its
channel closes: a worker never outlives the job, however the frontend ends.  The worker's hub
(:class:`WorkerHub`) checks the token and every request as the frontend's own servers do; the queue, the
pipeline, the deadlines and every counter are the frontend's (``/metrics`` and ``/stats`` are the
frontend's answers, so they count every worker).  A stop signal (SIGTERM, SIGINT: scancel signals every
process of the step) makes the worker refuse new requests (503) while it keeps answering the ones it
sent on; the frontend drains as it does without workers and then sends STOP, after the last answers.  A
worker that gets no STOP ends by itself ``drain_s`` + 15 s after its signal.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import socket
import struct
import sys
import time
from typing import Any

from hpcsplit.core.procs import die_with_parent
from hpcsplit.runtime.heap import settle_heap
from hpcsplit.runtime.server import channel as ch
from hpcsplit.runtime.server.hub import Hub, Ticket
from hpcsplit.runtime.server.protocol import InferRequest, RequestRejected
from hpcsplit.runtime.server.servers import Servers
from hpcsplit.runtime.server.tls import load_tls

__all__ = ["WorkerHub", "main"]

QUERY_TIMEOUT_S = 10.0
STOP_GRACE_S = 15.0


def _log(index: int, msg: str) -> None:
    print(f"[rank 0 worker {index}] {msg}", file=sys.stderr, flush=True)


class WorkerHub(Hub):
    """The worker's side of the hub: the same checks and state, but the requests and the counters go to
    the frontend's hub over the channel."""

    def __init__(self, cfg: dict[str, Any], link: _FrontendLink) -> None:
        super().__init__(ch.spec_from_dict(cfg["spec"]), 1 << 30, cfg["token"])
        self.link = link
        self.waiting: dict[int, Ticket] = {}
        self._seq = itertools.count(1)
        self._queries: dict[int, asyncio.Future[bytes]] = {}
        self.local_stop = False  # a stop signal reached this worker itself

    def is_ready(self) -> bool:
        return super().is_ready() and not self.local_stop

    def submit(self, req: InferRequest, protocol: str) -> Ticket:
        self.check_admitting()
        if self.link.closed:
            raise RequestRejected("the server is stopping (the frontend closed this worker's channel)", 503,
                                  "UNAVAILABLE")
        loop = asyncio.get_running_loop()
        t = Ticket(req, protocol, loop, loop.create_future())
        seq = next(self._seq)
        self.waiting[seq] = t
        self.link.send(ch.encode_request(seq, t.t_arrival, ch.PROTOCOLS.index(protocol), req))
        return t

    def count(self, t: Ticket | None, outcome: str, protocol: str | None = None, now: float | None = None) -> None:
        # only requests refused here (token, size, a bad input) are counted here: the frontend counts the rest
        self.link.send(ch.json_frame(ch.COUNT, [t.protocol if t is not None else protocol or "", outcome]))

    async def _query(self, what: int) -> bytes:
        qid = next(self._seq)
        fut = self._queries[qid] = asyncio.get_running_loop().create_future()
        self.link.send(ch.frame(ch.QUERY, struct.pack("<IB", qid, what)))
        try:
            async with asyncio.timeout(QUERY_TIMEOUT_S):
                return await fut
        except TimeoutError:
            raise RequestRejected(f"the frontend did not answer within {QUERY_TIMEOUT_S:g} s", 503,
                                  "UNAVAILABLE") from None
        finally:
            self._queries.pop(qid, None)

    async def metrics_text(self) -> bytes:
        return await self._query(0)

    async def read_statistics(self) -> dict[str, Any]:
        return dict(json.loads(await self._query(1)))

    # ------------------------------------------------------------------ from the frontend
    def answered(self, seq: int, arrays: list[Any]) -> None:
        t = self.waiting.pop(seq, None)
        if t is None or t.future.done():
            return
        outs: list[Any] = [None] * len(self.spec.outputs)
        for j, a in zip(t.req.outputs, arrays, strict=True):
            outs[j] = a
        t.future.set_result(outs)

    def refused(self, seq: int, err: RequestRejected) -> None:
        t = self.waiting.pop(seq, None)
        if t is not None and not t.future.done():
            t.future.set_exception(err)

    def replied(self, qid: int, data: bytes) -> None:
        fut = self._queries.get(qid)
        if fut is not None and not fut.done():
            fut.set_result(data)

    def lost(self) -> None:
        """The channel closed: every request still waiting is answered 503."""
        self.failed = self.failed or "the frontend is gone"
        for t in self.waiting.values():
            if not t.future.done():
                t.future.set_exception(RequestRejected("the server stopped before this request was answered",
                                                       503, "UNAVAILABLE"))
        self.waiting.clear()
        for fut in self._queries.values():
            if not fut.done():
                fut.set_exception(RequestRejected("the server stopped", 503, "UNAVAILABLE"))


class _FrontendLink(ch.Link):
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop)
        self.hub: WorkerHub | None = None
        self.config: asyncio.Future[dict[str, Any]] = loop.create_future()
        self.stop: asyncio.Future[str] = loop.create_future()

    def on_frames(self, frames: list[tuple[int, memoryview]]) -> None:
        hub = self.hub
        for kind, body in frames:
            if kind == ch.ANS and hub is not None:
                hub.answered(*ch.decode_answer(body))
            elif kind == ch.ERR and hub is not None:
                hub.refused(*ch.decode_error(body))
            elif kind == ch.STATE and hub is not None:
                st = json.loads(bytes(body))
                if st["ready"]:
                    hub.ready.set()
                if st["draining"]:
                    hub.draining.set()
                hub.failed = st["failed"]
                hub.degraded = [str(x) for x in st.get("degraded", ())]  # [Note: serving through faults]
            elif kind == ch.REPLY and hub is not None:
                hub.replied(struct.unpack_from("<I", body)[0], bytes(body[4:]))
            elif kind == ch.CONFIG and not self.config.done():
                self.config.set_result(json.loads(bytes(body)))
            elif kind == ch.STOP and not self.stop.done():
                self.stop.set_result("stop")

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        if self.hub is not None:
            self.hub.lost()
        if not self.config.done():
            self.config.set_exception(ConnectionError("the frontend closed the channel before the configuration"))
        if not self.stop.done():
            self.stop.set_result("lost")


async def _serve(sock: socket.socket, index: int) -> int:
    loop = asyncio.get_running_loop()
    _, link = await loop.create_connection(lambda: _FrontendLink(loop), sock=sock)
    async with asyncio.timeout(30):
        cfg = await link.config
    hub = WorkerHub(cfg, link)
    link.hub = hub
    tls = load_tls(cfg["tls_cert"], cfg["tls_key"])
    srv = Servers(hub, cfg["host"], cfg["http_port"], cfg["grpc_port"], cfg["max_body"], tls, reuse_port=True)
    await srv.start()
    settle_heap()  # [Note: frozen heap]
    # ready once listening: the frontend checked the model before it started the workers, and it refuses
    # what reaches it before its own hub is ready; draining and failure come with its STATE frames
    hub.ready.set()
    link.send(ch.json_frame(ch.READY, {"pid": os.getpid(), "http_port": srv.http_port, "grpc_port": srv.grpc_port}))
    deadline: list[float] = []

    def on_signal(signum: int) -> None:  # refuse new requests; the frontend's drain and STOP end the worker
        if not hub.local_stop:
            hub.local_stop = True
            deadline.append(time.monotonic() + float(cfg["drain_s"]) + STOP_GRACE_S)
            _log(index, f"{signal.Signals(signum).name} received: refusing new requests until the frontend's STOP")

    for s in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(s, on_signal, s)
    try:
        while True:
            wait_s = deadline[0] - time.monotonic() if deadline else 1.0
            done, _ = await asyncio.wait({link.stop}, timeout=max(0.0, wait_s))
            if done:
                break
            if deadline and time.monotonic() >= deadline[0]:
                _log(index, "no STOP from the frontend after the stop signal's drain: stopping")
                break
    finally:
        # the worker is ending: a later stop signal (a second scancel, the launcher's) is ignored.  Left to the
        # loop, one that came while asyncio.run closed the loop (its self-pipe closes before its signal handlers
        # go) printed a BrokenPipeError traceback and killed the worker by the signal instead of its exit code
        for s in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(s)
            signal.signal(s, signal.SIG_IGN)
        await srv.stop()
        link.flush()
        if link.transport is not None:
            link.transport.close()
    return 0 if link.stop.done() and link.stop.result() == "stop" else 1


def main(argv: list[str]) -> int:
    fd, parent, index = int(argv[0]), int(argv[1]), int(argv[2])
    die_with_parent(parent)  # SIGKILL when the frontend rank ends ([Note: protocol workers])
    sock = socket.socket(fileno=fd)
    try:
        return asyncio.run(_serve(sock, index))
    except Exception as e:  # noqa: BLE001 - said, and the frontend names the worker that ended
        _log(index, f"failed: {type(e).__name__}: {e}")
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
