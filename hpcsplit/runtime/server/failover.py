"""Server mode through faults: which component replicas are alive, and what happens to a lost one's requests.

[Note: serving through faults]
A server runs for days; a rank of it may be killed (the OOM killer, ``kill -9``), stopped (SIGSTOP, a
swapped-out node) or cut off.  When a component has other replicas the server goes on without the lost
one; when it was the last, the job ends and the login side starts it again (``launcher.restarts``,
:mod:`hpcsplit.launch.serve_watch`).

- **Heard from.**  Every component rank sends the frontend its counters once a second while they change
  and, in any case, every ``runtime.silence_s`` / 5 (its heartbeat); the frontend sends every component
  rank a heartbeat as often.  Any message counts.  A replica the frontend has heard nothing from for
  ``runtime.silence_s`` is lost; so is one whose process ended on the frontend's node, within
  :data:`CHECK_S` (``[Note: lost ranks]`` in :mod:`hpcsplit.runtime.faults`).  A component rank that has heard
  nothing from the frontend for ``silence_s`` leaves the job (:class:`~hpcsplit.errors.RankLeftJob`): a
  job whose frontend is gone ends.
- **Lost.**  The frontend routes nothing more to it (:meth:`Router.drop`), forgets its half-received
  messages and unfinished sends, and tells every other component rank (``CONTROL_LOST``): they send it
  nothing and wait for no STOP from it.  A lost rank on the frontend's node that still runs (stopped,
  stuck) is killed when the launcher set the job up to survive it (``RANKS_SURVIVE_VAR``), so it cannot
  come back with stale answers; one elsewhere is told it is lost and leaves if it hears it.
- **Its requests.**  Every sample whose route went through the lost rank is sent again under a new
  request id on a live route (a late answer to the old id is dropped); a sample lost a second time fails
  its request with 503.  The request's deadline stays ``runtime.request_timeout_s`` from its arrival, so
  a request gets its answer or an error, never silence.
- **Seen.**  The log names the rank, component, node and host; ``/v2/health/ready`` and the model's ready
  route answer 200 with ``{"ready": true, "state": "degraded", "lost": [...]}`` (gRPC: trailing metadata
  ``hpcsplit-state: degraded``); ``/metrics`` has ``hpcsplit_degraded``, ``hpcsplit_component_replicas``,
  ``hpcsplit_replica_lost{component,rank,node,host,reason}`` and ``hpcsplit_requests_resent_total``.
- **The last replica.**  Not ready, every waiting request answered 503, the server ends and its summary
  says why it must restart (``restart``); the token file is kept for the next job.
- **The end.**  STOP, the counters and the barriers after serving go to the survivors only.

What the MPI library allows (MPICH 5.0.2, the PyPI wheel, ch4; measured on the development VM, see
docs/serving.md "Faults"): hydra kills every rank of a node when one of them is killed by a signal,
whatever ``-disable-auto-cleanup`` says, but not when one exits, so each rank runs under
:mod:`hpcsplit.launch.keeper`, which turns its death into an exit code; messages sent to a dead rank of the
node take the sender's shared-memory cells for good (64 by default: after that the sender sends nothing
to anyone), so the launcher raises ``MPIR_CVAR_CH4_SHM_POSIX_IQUEUE_NUM_CELLS``; ``MPI_Finalize`` waits for
the dead rank unless ``MPIR_CVAR_NO_COLLECTIVE_FINALIZE=1``.  ULFM is not there
(``MPIR_CVAR_ENABLE_FT=1`` fails an assertion in ``MPI_Init``).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from hpcsplit.core.paths import RANKS_SURVIVE_VAR
from hpcsplit.errors import RuntimeStageError
from hpcsplit.runtime import faults
from hpcsplit.runtime import transport as tp
from hpcsplit.runtime.context import RankContext, say
from hpcsplit.runtime.frontend import Frontend
from hpcsplit.runtime.server.hub import Hub
from hpcsplit.runtime.server.protocol import RequestRejected

ServeLoop = Any  # hpcsplit.runtime.server.serve.ServeLoop (which holds this): its jobs, rows and pending samples

__all__ = ["CHECK_S", "Failover", "read_token"]

CHECK_S = 0.1  # how often the frontend looks for silent or ended replicas


_TOKEN = re.compile(r"[A-Za-z0-9._~+/=-]{16,512}")


def read_token(path: Path) -> str:
    """The bearer token in ``path`` (``runtime.server_token_file``): one line of 16-512 URL-safe characters in
    a regular file only its owner may read; anything else is refused, naming what was found."""
    what = f"runtime.server_token_file={path}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        raise RuntimeStageError(f"{what}: cannot open it ({e.strerror}); give a regular file holding the token") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise RuntimeStageError(f"{what} is not a regular file; give a file holding the token")
        if st.st_mode & 0o077:
            raise RuntimeStageError(f"{what} may be read by others (mode {st.st_mode & 0o777:o}); chmod 600 it")
        data = os.read(fd, 4097)
    finally:
        os.close(fd)
    text = data.decode("ascii", "replace").strip()
    if len(data) > 4096 or not _TOKEN.fullmatch(text):
        raise RuntimeStageError(f"{what} does not hold one token (needed: one line of 16 to 512 characters of "
                                "A-Z a-z 0-9 . _ ~ + / = -)")
    return text


class Failover:
    """The frontend's side of ``[Note: serving through faults]`` for one :class:`ServeLoop`."""

    def __init__(self, ctx: RankContext, fe: Frontend, hub: Hub) -> None:
        rt = ctx.runtime
        self.ctx, self.fe, self.hub = ctx, fe, hub
        self.silence_s, self.heartbeat_s = rt.silence_s, rt.heartbeat_s
        now = time.perf_counter()
        self.heard: dict[int, float] = dict.fromkeys(fe.df.rank_component, now)  # rank -> last message
        self.lost: dict[int, str] = {}  # rank -> what the log and metrics say
        self.resent = 0
        self.restart: str | None = None  # why the job must start again (a component lost its last replica)
        self._resends: set[int] = set()  # row ids that are a re-send already
        self._next_check = now + CHECK_S
        self._next_beat = now
        self._kill = os.environ.get(RANKS_SURVIVE_VAR) == "1"
        self._total = {c.name: len(c.replicas) for c in fe.df.components}
        hub.registry.register(_FailoverCollector(self))

    def live(self) -> list[int]:
        return [r for r in self.heard if r not in self.lost]

    # ------------------------------------------------------------------ each pass
    def check(self, sl: ServeLoop, now: float) -> bool:
        """Heartbeats out; silent or ended replicas found and handled.  Whether it did work."""
        if now < self._next_check:
            return False
        self._next_check = now + CHECK_S
        if now >= self._next_beat:
            self._next_beat = now + self.heartbeat_s
            self._send_all(self.live(), faults.CONTROL_ALIVE)
        newly = dict.fromkeys(faults.ended_ranks(self.live()), "its process ended")  # on this node
        for r in self.live():
            quiet = now - self.heard[r]
            if r not in newly and quiet > self.silence_s:
                newly[r] = f"it sent nothing for {quiet:.1f} s (runtime.silence_s={self.silence_s:g})"
        if not newly:
            return False
        self._lose(sl, newly)
        return True

    def close(self) -> None:
        """Serving is over: the component ranks stop watching for the frontend's heartbeat (STOP follows)."""
        self._send_all(self.live(), faults.CONTROL_QUIET)

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"lost": {str(r): w for r, w in self.lost.items()}, "resent": self.resent}
        if self.restart:
            out["restart"] = self.restart
        return out

    # ------------------------------------------------------------------ a replica lost
    def _send_all(self, ranks: list[int], what: int, payload: torch.Tensor | None = None) -> None:
        fe = self.fe
        for r in ranks:
            fe.outbox.add(tp.isend_message(fe.comm, r, tp.KIND_CONTROL, (), (),
                                           [(0, payload)] if payload is not None else (), aux=what), r)

    def _lose(self, sl: ServeLoop, newly: dict[int, str]) -> None:
        fe, df = self.fe, self.fe.df
        here = socket.gethostname()
        for r, why in sorted(newly.items()):
            comp = df.rank_component[r]
            left = fe.router.drop(r)
            self.lost[r] = f"{self.ctx.name(r)}: {why}"
            faults.mark_lost(r, why)
            host, pid = faults.job_process(r)
            killed = ""
            if self._kill and host == here and pid and not faults.process_gone(pid):
                try:
                    os.kill(pid, signal.SIGKILL)  # stopped or stuck: it must not come back with stale answers
                    killed = "; killed it (SIGKILL)"
                except OSError:
                    pass
            say(0, f"server: lost {self.ctx.name(r)}: {why}{killed}; component {comp!r} has {left} of "
                   f"{self._total[comp]} replica(s) left")
            if left == 0 and self.restart is None:
                self.restart = (f"component {comp!r} lost its last replica ({self.ctx.name(r)}: {why}); the job "
                                "cannot go on")
        gone = set(newly)
        everyone = torch.tensor(sorted(self.lost), dtype=torch.int64)
        told = self.live() + [r for r in newly if faults.job_process(r)[0] != here]  # a lost one elsewhere may hear
        self._send_all(told, faults.CONTROL_LOST, everyone)
        fe.inbox.forget(gone)
        fe.outbox.forget(gone)  # (the word to a lost rank too: nothing waits for it to be taken)
        self.hub.degraded = list(self.lost.values())
        if self.restart is not None:
            self.hub.failed = f"{self.restart}; the login side starts it again (launcher.restarts)"
            sl._fail_all(RequestRejected(f"the server stopped: {self.restart}; it is being restarted, retry "
                                        "shortly", 503, "UNAVAILABLE"))
            sl.done = True
            say(0, f"server: {self.restart}: not ready, every waiting request answered 503; the server stops so "
                   "that the login side can start it again")
            return
        self._reroute(sl, gone)

    def _reroute(self, sl: ServeLoop, gone: set[int]) -> None:
        """Send again, under new ids, the samples whose route went through ``gone``; a second loss fails them."""
        fe = self.fe
        again: list[int] = []
        failed = 0
        for rid, rec in list(sl.inflight.items()):
            if gone.isdisjoint(rec[0]) or rid not in sl.inflight:  # (a request failed below took its other rows)
                continue
            del sl.inflight[rid]
            fe.router.release(rec[0], failed=True)
            jk = sl.row_job.pop(rid, None)
            if jk is None:
                continue
            job, k = jk
            if rid in self._resends:  # already sent again once
                if job.rows[0] in sl.jobs:
                    failed += 1
                    sl._drop(job, RequestRejected(
                        f"request {job.ticket.req.id or job.rows[0]!r}: two replicas it was routed to were lost "
                        f"({', '.join(self.lost[r] for r in sorted(gone))})", 503, "UNAVAILABLE"), "error")
                continue
            new = fe.next_id
            fe.next_id += 1
            sl.row_job[new] = (job, k)
            job.rows.append(new)
            self._resends.add(new)
            again.append(new)
        again = [r for r in again if r in sl.row_job]  # (not those of a request failed after them)
        self._resends.difference_update(r for r in list(self._resends) if r not in sl.row_job)
        sl.pending[:0] = again  # admitted first in the next pass, on live routes
        self.resent += len(again)
        self.hub.inflight_rows = len(sl.inflight)
        if again or failed:
            say(0, f"server: {len(again)} sample(s) in flight on the lost replica(s) sent again on live ones"
                   + (f"; {failed} request(s) failed (lost twice)" if failed else ""))


class _FailoverCollector:
    """``/metrics``: the degraded state, live replicas per component, each lost replica, re-sent samples."""

    def __init__(self, fo: Failover) -> None:
        self.fo = fo

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        fo = self.fo
        deg = GaugeMetricFamily("hpcsplit_degraded", "1 while the server serves without some of its replicas")
        deg.add_metric([], float(bool(fo.lost)))
        reps = GaugeMetricFamily("hpcsplit_component_replicas", "Live replicas of each component",
                                 labels=["component"])
        for k, c in enumerate(fo.fe.df.components):
            reps.add_metric([c.name], float(len([r for r in fo.fe.router.live(k) if r not in fo.lost])))
        lost = GaugeMetricFamily("hpcsplit_replica_lost", "A component replica the server lost (1 each)",
                                 labels=["component", "rank", "node", "host", "reason"])
        for r in sorted(fo.lost):
            e = fo.ctx.plan.rank_entry(r)
            host = faults.job_process(r)[0]
            lost.add_metric([str(e.component), str(r), str(e.node), host, faults.lost_ranks().get(r, "")], 1.0)
        resent = CounterMetricFamily("hpcsplit_requests_resent", "Samples sent again after a replica was lost")
        resent.add_metric([], float(fo.resent))
        yield from (deg, reps, lost, resent)
