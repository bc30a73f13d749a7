"""The frontend rank's side of the protocol workers (``runtime.server_workers`` > 0, ``[Note: protocol
workers]`` in :mod:`~hpcsplit.runtime.server.worker`): start them, turn their frames into the hub's
tickets and the answers back into frames, mirror the ready state to them, name a worker that dies, and
stop them after the drain.

The ports: the frontend binds each one itself with ``SO_REUSEPORT`` and does not listen on it, which
keeps the port this job's while the workers listen on it beside each other (a socket that does not listen
gets no connections; on Linux only processes of the same user can join the port).  A worker that dies
is named in the log (its clients' connections end with it; the others go on serving); when none is
left the server stops with an error.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, cast

from prometheus_client import Gauge

from hpcsplit.errors import RuntimeStageError
from hpcsplit.runtime.server import channel as ch
from hpcsplit.runtime.server.hub import Hub, Ticket
from hpcsplit.runtime.server.protocol import RequestRejected
from hpcsplit.runtime.server.tls import TlsFiles

__all__ = ["MAX_AUTO_WORKERS", "RemoteTicket", "Workers", "auto_workers"]

MAX_AUTO_WORKERS = 4  # runtime.server_workers=null: at most this many (one frontend thread feeds them all)
STATE_EVERY_S = 0.02  # the ready state is mirrored to the workers, and their processes checked, this often
STOP_WAIT_S = 15.0


def auto_workers(cores: int, used: int) -> int:
    """``runtime.server_workers=null``: one worker per core the node's ranks leave spare, at most
    :data:`MAX_AUTO_WORKERS`; none when no core is spare (the protocol then stays on the frontend's thread).

    Examples
    --------
    >>> auto_workers(2, 2), auto_workers(16, 5), auto_workers(8, 6)
    (0, 4, 2)
    """
    return max(0, min(MAX_AUTO_WORKERS, cores - used))


@dataclass(slots=True, eq=False)
class RemoteTicket(Ticket):
    """A request a worker sent: resolving it sends the answer back on that worker's channel."""

    link: _WorkerLink | None = None
    seq: int = 0

    def resolve(self, result: Any) -> None:
        if self.link is not None:
            self.link.answer(self.seq, self, result)


class _WorkerLink(ch.Link):
    """The frontend's end of one worker's channel."""

    def __init__(self, loop: asyncio.AbstractEventLoop, owner: Workers, index: int) -> None:
        super().__init__(loop)
        self.owner, self.index = owner, index
        self.ready: asyncio.Future[dict[str, Any]] = loop.create_future()

    def answer(self, seq: int, t: Ticket, result: Any) -> None:
        if isinstance(result, BaseException):
            err = result if isinstance(result, RequestRejected) else RequestRejected(str(result), 500, "INTERNAL")
            self.send(ch.error_frame(seq, err))
        else:
            self.send(ch.encode_answer(seq, [result[j] for j in t.req.outputs]))

    def on_frames(self, frames: list[tuple[int, memoryview]]) -> None:
        hub = self.owner.hub
        loop = self.loop
        for kind, body in frames:
            if kind == ch.REQ:
                seq, t_arr, proto, req = ch.decode_request(hub.spec, body)
                t = RemoteTicket(req, ch.PROTOCOLS[proto], loop, cast("asyncio.Future[Any]", None), t_arr,
                                 link=self, seq=seq)
                try:
                    hub.check_admitting()
                    hub.enqueue(t)
                except RequestRejected as e:
                    if not e.counted:
                        hub.count(t, "rejected")
                    t.resolve(e)
            elif kind == ch.COUNT:
                proto, outcome = json.loads(bytes(body))
                hub.count(None, str(outcome), str(proto))
            elif kind == ch.QUERY:
                qid, what = struct.unpack_from("<IB", body)
                loop.create_task(self._reply(qid, what))
            elif kind == ch.READY and not self.ready.done():
                self.ready.set_result(json.loads(bytes(body)))
            else:
                raise ch.ChannelError(f"a frame of kind {kind} from a worker")

    async def _reply(self, qid: int, what: int) -> None:
        hub = self.owner.hub
        data = await hub.metrics_text() if what == 0 else json.dumps(await hub.read_statistics()).encode()
        self.send(ch.frame(ch.REPLY, struct.pack("<I", qid), data))

    def broken(self, err: ch.ChannelError) -> None:
        self.owner.log(f"server: protocol worker {self.index} sent a frame that does not fit ({err}): dropping it")
        super().broken(err)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        if not self.ready.done():
            self.ready.set_exception(ConnectionError("its channel closed"))


def _reserve(host: str, port: int) -> socket.socket:
    """Bind ``host:port`` (0: a free port) with ``SO_REUSEPORT``, without listening (see the module docstring)."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                       flags=socket.AI_PASSIVE)[0]
    s = socket.socket(family, kind, proto)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        s.bind(addr)
    except OSError:
        s.close()
        raise
    return s


def _how(rc: int) -> str:
    return f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}"


class Workers:
    """``runtime.server_workers`` protocol workers serving ``hub`` (the frontend's), in place of
    :class:`~hpcsplit.runtime.server.servers.Servers` on the frontend's own loop."""

    def __init__(self, hub: Hub, host: str, http_port: int, grpc_port: int, max_body: int, n: int,
                 tls: TlsFiles | None, drain_s: float, log: Callable[[str], None]) -> None:
        self.hub, self.host, self.n = hub, host, n
        self._want = (http_port, grpc_port)
        self.max_body, self.tls, self.drain_s, self.log = max_body, tls, drain_s, log
        self.http_port = self.grpc_port = 0
        self.procs: list[subprocess.Popen[bytes]] = []
        self.links: list[_WorkerLink] = []
        self.dead: set[int] = set()
        self._held: list[socket.socket] = []

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    async def start(self, timeout_s: float = 60.0) -> None:
        try:
            await self._start(timeout_s)
        except BaseException:
            await self.stop()
            raise

    async def _start(self, timeout_s: float) -> None:
        g = Gauge("hpcsplit_server_workers", "Protocol worker processes serving (runtime.server_workers)",
                  registry=self.hub.registry)
        g.set_function(lambda: len(self.procs) - len(self.dead))
        try:
            self._held = [_reserve(self.host, p) for p in self._want]
        except OSError as e:
            raise RuntimeStageError(f"could not bind {self.host} (ports {self._want}) for the protocol workers: "
                                    f"{e.strerror}. Choose other ports (runtime.server_http_port / server_grpc_port;"
                                    " 0 picks free ones) or another runtime.server_host") from None
        self.http_port, self.grpc_port = (int(s.getsockname()[1]) for s in self._held)
        loop = asyncio.get_running_loop()
        cfg = {"spec": ch.spec_to_dict(self.hub.spec), "token": self.hub.token, "host": self.host,
               "http_port": self.http_port, "grpc_port": self.grpc_port, "max_body": self.max_body,
               "tls_cert": self.tls.cert if self.tls else None, "tls_key": self.tls.key if self.tls else None,
               "drain_s": self.drain_s}
        env = dict(os.environ, OMP_NUM_THREADS="1")
        for k in range(self.n):
            mine, theirs = socket.socketpair()
            try:
                self.procs.append(subprocess.Popen(  # noqa: ASYNC220 - once per worker, at start
                    [sys.executable, "-m", "hpcsplit.runtime.server.worker", str(theirs.fileno()), str(os.getpid()),
                     str(k)], pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL))
            finally:
                theirs.close()
            _, link = await loop.create_connection(functools.partial(_WorkerLink, loop, self, k), sock=mine)
            link.send(ch.json_frame(ch.CONFIG, cfg))
            self.links.append(link)
        t_end = time.monotonic() + timeout_s
        for k, link in enumerate(self.links):
            while not link.ready.done():
                rc = self.procs[k].poll()
                if rc is not None or time.monotonic() > t_end:
                    why = _how(rc) if rc is not None else f"not listening after {timeout_s:g} s"
                    raise RuntimeStageError(f"protocol worker {k} (pid {self.procs[k].pid}) did not start: {why}; "
                                            "its lines above say why")
                await asyncio.wait({link.ready}, timeout=0.05)
            try:
                link.ready.result()
            except ConnectionError:
                raise RuntimeStageError(f"protocol worker {k} (pid {self.procs[k].pid}) closed its channel while "
                                        "starting; its lines above say why") from None

    async def watch(self, serving: Coroutine[Any, Any, dict[str, Any]]) -> dict[str, Any]:
        """Run the frontend loop (``serving``) while mirroring the hub's state to the workers and watching
        them; when every worker has died the loop is cancelled (its requests answered 503) and the server
        ends with an error."""
        task = asyncio.ensure_future(serving)
        last: tuple[Any, ...] | None = None
        try:
            while not task.done():
                hub = self.hub
                state = (hub.ready.is_set(), hub.draining.is_set(), hub.failed, tuple(hub.degraded))
                if state != last:
                    last = state
                    for link in self.links:
                        link.send(ch.json_frame(ch.STATE, {"ready": state[0], "draining": state[1],
                                                           "failed": state[2], "degraded": state[3]}))
                self._check()
                if len(self.dead) == self.n:
                    task.cancel()
                    try:
                        await task
                    except asyncio.CancelledError:
                        pass
                    raise RuntimeStageError(f"all {self.n} protocol workers died (named above): the server cannot "
                                            "answer clients any more")
                await asyncio.wait({task}, timeout=STATE_EVERY_S)
            return task.result()
        finally:
            if not task.done():
                task.cancel()

    def _check(self) -> None:
        for k, (p, link) in enumerate(zip(self.procs, self.links, strict=True)):
            if k in self.dead:
                continue
            rc = p.poll()
            if rc is None and not link.closed:
                continue
            if rc is None:  # the channel broke, the process lives: it cannot be reached any more
                p.kill()
                rc = p.wait()
            self.dead.add(k)
            self.log(f"server: protocol worker {k} (pid {p.pid}) died ({_how(rc)}); its clients' connections are "
                     f"gone, {self.n - len(self.dead)} worker(s) left")

    async def stop(self, timeout_s: float = STOP_WAIT_S) -> None:
        """After the drain: STOP to every worker (after the answers still to go), then wait for them,
        killing any left at the deadline; the ports are released."""
        for link in self.links:
            link.flush()
            link.send(ch.frame(ch.STOP))
            link.flush()
        t_end = time.monotonic() + timeout_s
        for k, p in enumerate(self.procs):
            while p.poll() is None and time.monotonic() < t_end:
                await asyncio.sleep(0.02)
            if p.poll() is None:
                self.log(f"server: protocol worker {k} (pid {p.pid}) did not stop within {timeout_s:g} s: killed")
                p.kill()
                p.wait()
            elif p.returncode != 0 and k not in self.dead:
                self.log(f"server: protocol worker {k} (pid {p.pid}) ended with {_how(p.returncode)}")
        for link in self.links:
            if link.transport is not None:
                link.transport.close()
        for s in self._held:
            s.close()
        self._held = []
