"""The frontend's engine (:class:`Frontend`, on rank 0): admits requests, routes them, collects outputs, enforces
timeouts.

One :meth:`Frontend.run` call is one *session*: requests ``0..n-1`` arriving at ``arrivals_s`` (all at 0
in batch mode, an open-loop schedule in bench mode).  At most ``max_inflight`` requests are inside the
pipeline at once (so memory is bounded); the rest wait at the frontend, their latency counting from
their arrival.  A request not finished ``request_timeout_s`` after its arrival (batch mode:
``admission=True``, after its admission) is reported failed and its late outputs are dropped.  Each
admitted request gets a route (:class:`~routing.Router`, fewest outstanding per replica); requests
admitted in one loop turn for the same replica travel in one message.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hpcsplit.errors import RuntimeStageError
from hpcsplit.runtime import mailbox as mb
from hpcsplit.runtime import transport as tp
from hpcsplit.runtime.batching import take_requests
from hpcsplit.runtime.faults import JobInterrupted, lost_ranks, stop_signal
from hpcsplit.runtime.routing import INPUT, Dataflow, Router
from hpcsplit.runtime.trace import Tracer

__all__ = ["STATUS_ERROR", "STATUS_OK", "STATUS_PENDING", "STATUS_TIMEOUT", "Frontend", "RemoteRankError", "SessionResult",
           "request_getter"]

STATUS_PENDING = 0
STATUS_OK = 1
STATUS_TIMEOUT = 2
STATUS_ERROR = 3  # a component reported the request failed (batch mode: [Note: failed rows])

log = logging.getLogger("hpcsplit.runtime")


class RemoteRankError(RuntimeStageError):
    """A component rank reported an exception (its message names rank, component and requests)."""


@dataclass(frozen=True, slots=True)
class SessionResult:
    """Per-request timings of one session (times are seconds from the session start)."""

    request_ids: np.ndarray
    arrival_s: np.ndarray
    admit_s: np.ndarray
    done_s: np.ndarray  # NaN where not finished
    status: np.ndarray  # STATUS_*
    wall_s: float
    path_ms: np.ndarray | None = None  # compute on the request's critical path, measured in the run

    @property
    def ok(self) -> np.ndarray:
        return self.status == STATUS_OK

    @property
    def latency_ms(self) -> np.ndarray:
        return (self.done_s - self.arrival_s) * 1e3


def _decode_error(m: tp.Message) -> str:
    if m.tensors:
        return bytes(m.tensors[0].numpy().tobytes()).decode("utf-8", "replace")
    return f"rank {m.source} failed (no message)"


def _warn_timeout(expired: list[int], base: int, request_timeout_s: float) -> None:
    log.warning("requests %s exceeded runtime.request_timeout_s=%g s and are reported failed",
                [int(base + i) for i in expired[:10]] + (["..."] if len(expired) > 10 else []),
                request_timeout_s)


def request_getter(df: Dataflow, inputs: Sequence[torch.Tensor],
                   modulo: int | None = None) -> Callable[[np.ndarray], list[torch.Tensor]]:
    """``idx -> [tensor per model input]`` selecting requests along each input's batch dim (request ``i``
    takes entry ``i % modulo`` when ``modulo`` is given: a pool of inputs cycled through).

    Examples
    --------
    >>> from types import SimpleNamespace
    >>> get = request_getter(SimpleNamespace(input_bdims=((0,),)), [torch.arange(3)], modulo=3)
    >>> get(np.array([1, 4]))[0].tolist()
    [1, 1]
    """
    bd = df.input_bdims

    def get(idx: np.ndarray) -> list[torch.Tensor]:
        pos = (idx % modulo if modulo else idx).tolist()
        return [take_requests(x, bd[i], pos) for i, x in enumerate(inputs)]

    return get


class Frontend:
    """Rank 0's side of serving a :class:`Dataflow` (see the module docstring)."""

    def __init__(self, comm: Any, dataflow: Dataflow, tracer: Tracer | None = None,
                 idle_sleep_s: float = 2e-3, spin_s: float = mb.SPIN_S) -> None:
        self.comm = comm
        self.idle_sleep_s, self.spin_s = idle_sleep_s, spin_s
        self.df = dataflow
        self.router = Router(dataflow)
        self.tracer = tracer or Tracer(comm.Get_rank(), None, None)
        self.inbox = mb.Inbox(comm)
        self.outbox = mb.Outbox()
        self.next_id = 0
        self._comp_index = {c.name: c.index for c in dataflow.components}
        self._entry = [(self._comp_index[c], pairs) for c, pairs in dataflow.entry_groups().items()]
        self._passthrough = [(j, dataflow.inputs.index(name))
                             for j, (src, name) in enumerate(dataflow.output_sources) if src == INPUT]
        self.n_outputs = len(dataflow.outputs)
        self.stalled = False  # the last session ended because nothing came back (see run's ``admission``)
        self.count_turns = False  # count the loop's passes that do work and their thread CPU (the calibration)
        self.turns, self.turn_cpu_s = 0, 0.0
        self.row_errors: list[str] = []  # the messages of the first 20 KIND_ROW_ERROR reports

    # ------------------------------------------------------------------ session
    def run(
        self,
        arrivals_s: np.ndarray,
        get_inputs: Callable[[np.ndarray], Sequence[torch.Tensor]],
        on_done: Callable[[int, list[torch.Tensor]], None] | None = None,
        request_timeout_s: float = 60.0,
        max_inflight: int = 64,
        max_admit: int = 256,
        admission: bool = False,
    ) -> SessionResult:
        """Serve requests ``0..len(arrivals_s)-1``; return their timings.

        Parameters
        ----------
        arrivals_s
            Arrival offsets in seconds (non-decreasing).
        get_inputs
            ``idx -> [tensor per model input]`` holding those requests along each input's batch dim.
        on_done
            Called with ``(idx, [tensor per model output])`` when a request finishes (each the
            request's part: size 1 in every batch dim); None in benchmarks (outputs dropped).
        request_timeout_s, max_inflight
            ``runtime.request_timeout_s`` and ``runtime.max_inflight``.
        admission
            Batch mode: requests enter as the window frees and each one's timeout counts from its
            admission (``admit_s``), not its arrival, so any number of requests can finish.  A pipeline
            that stops answering would then time out one window after another for ever: when requests
            expire and nothing at all has come back for ``request_timeout_s``, the session ends there,
            every unfinished request failed, and ``self.stalled`` is set (the caller's end-of-job
            counters then name the silent rank).

        Raises
        ------
        RemoteRankError
            When a component rank reports an exception (the session's results so far are in
            ``self.partial``).
        JobInterrupted
            When the rank got a stop signal (``self.partial`` as above).
        """
        n = len(arrivals_s)
        arrivals = np.asarray(arrivals_s, dtype=np.float64)
        base = self.next_id
        self.next_id += n
        ids = np.arange(base, base + n, dtype=np.int64)
        admit_s = np.full(n, np.nan)
        done_s = np.full(n, np.nan)
        status = np.zeros(n, dtype=np.int8)
        path_ms = np.full(n, np.nan)
        self.partial = SessionResult(ids, arrivals, admit_s, done_s, status, 0.0, path_ms)
        inflight: dict[int, list[Any]] = {}  # idx -> [route, outputs, missing, critical-path us]
        keep = on_done is not None
        start = admit_s if admission else arrivals  # a request's deadline counts from here
        self.stalled = False
        last_out = 0.0  # session time of the last output received
        backoff = mb.Backoff(spin_s=self.spin_s, deep_sleep_s=self.idle_sleep_s)
        t0 = time.perf_counter()
        next_i = 0
        resolved = 0
        next_scan = 0.0
        count = self.count_turns
        while resolved < n:
            now = time.perf_counter() - t0
            worked = False
            c_pass = time.thread_time() if count else 0.0
            sig = stop_signal()
            if sig is not None:  # [Note: stop signals] in hpcsplit.runtime.faults: admit nothing more
                raise JobInterrupted(f"{sig[0]} received: stopped admitting requests ({int((status == STATUS_OK).sum())}"
                                     f" of this session's {n} finished, {len(inflight)} in flight dropped)")
            # ---- admit arrived requests while the window has room
            adm: list[int] = []
            while (next_i < n and arrivals[next_i] <= now and len(inflight) + len(adm) < max_inflight
                   and len(adm) < max_admit):
                if not admission and now - arrivals[next_i] > request_timeout_s:
                    status[next_i] = STATUS_TIMEOUT
                    resolved += 1
                else:
                    adm.append(next_i)
                next_i += 1
            if adm:
                worked = True
                resolved += self._admit(adm, inflight, get_inputs, admit_s, done_s, status, now, keep, t0,
                                        on_done, base)
            # ---- collect outputs
            for m, t_hdr in self.inbox.poll():
                worked = True
                h = m.header
                if h.kind == tp.KIND_ERROR:
                    raise RemoteRankError(_decode_error(m))
                if h.kind == tp.KIND_ROW_ERROR:  # [Note: failed rows] in hpcsplit.runtime.component
                    last_out = time.perf_counter() - t0
                    failed = 0
                    for rid in h.request_ids:
                        rec = inflight.pop(rid - base, None)
                        if rec is not None:
                            self.router.release(rec[0], failed=True)
                            status[rid - base] = STATUS_ERROR
                            resolved += 1
                            failed += 1
                    if failed and len(self.row_errors) < 20:
                        self.row_errors.append(_decode_error(m))
                    continue
                if h.kind != tp.KIND_DATA:
                    continue
                t_now = time.perf_counter()
                last_out = t_now - t0
                late = []
                for row, rid in enumerate(h.request_ids):
                    idx = rid - base
                    rec = inflight.get(idx)
                    if rec is None:
                        continue  # timed out earlier, or another session's straggler
                    for meta, t in zip(h.tensors, m.tensors, strict=True):
                        if keep:
                            rec[1][meta.slot] = t.narrow(meta.rdim, row, 1)
                        rec[2] -= 1
                    rec[3] = max(rec[3], h.aux)
                    if rec[2] <= 0:
                        del inflight[idx]
                        resolved += 1
                        if t_now - t0 - start[idx] > request_timeout_s:
                            # Finished, but past its deadline: collected late (this rank slept past the
                            # timeout scan, or the output was already late).  Failed, as the scan would have.
                            self.router.release(rec[0], failed=True)
                            status[idx] = STATUS_TIMEOUT
                            late.append(idx)
                            continue
                        self.router.release(rec[0])
                        done_s[idx] = t_now - t0
                        path_ms[idx] = rec[3] / 1e3
                        status[idx] = STATUS_OK
                        if on_done is not None:
                            on_done(idx, rec[1])
                if late:
                    _warn_timeout(late, base, request_timeout_s)
                self.tracer.span("recv_output", t_hdr, t_now, h.request_ids, src=m.source)
            self.outbox.reap()
            # ---- timeouts (oldest first), every 10 ms
            if now >= next_scan:
                next_scan = now + 0.01
                expired = []
                for idx in inflight:
                    if now - start[idx] > request_timeout_s:
                        expired.append(idx)
                    else:
                        break
                for idx in expired:
                    rec = inflight.pop(idx)
                    self.router.release(rec[0], failed=True)
                    status[idx] = STATUS_TIMEOUT
                    resolved += 1
                if expired:
                    worked = True
                    _warn_timeout(expired, base, request_timeout_s)
                    if admission and now - last_out > request_timeout_s:
                        left = np.flatnonzero(status == STATUS_PENDING)
                        log.warning("nothing came back for %.1f s (more than runtime.request_timeout_s=%g s) "
                                    "while requests were in flight: the pipeline is stalled; the session "
                                    "stops, its %d unfinished request(s) failed", now - last_out,
                                    request_timeout_s, len(left))
                        for idx in list(inflight):
                            self.router.release(inflight.pop(idx)[0], failed=True)
                        status[left] = STATUS_TIMEOUT
                        resolved = n
                        self.stalled = True
            if worked:
                backoff.reset()
                if count:
                    self.turns += 1
                    self.turn_cpu_s += time.thread_time() - c_pass
            else:
                wake = t0 + arrivals[next_i] if next_i < n and len(inflight) < max_inflight else None
                if inflight:  # the oldest request's deadline (a quiet sleep may last 100 ms)
                    due = max(t0 + start[next(iter(inflight))] + request_timeout_s, t0 + next_scan)
                    wake = due if wake is None else min(wake, due)
                t_idle = time.perf_counter()
                backoff.idle(t_idle, wake, bool(self.inbox.pending) or self.outbox.in_flight(t_idle),
                             quiet=not self.inbox.pending and not self.outbox.pending)
        self.outbox.drain(timeout_s=10.0)
        self.partial = SessionResult(ids, arrivals, admit_s, done_s, status, time.perf_counter() - t0, path_ms)
        return self.partial

    def _admit(self, adm: list[int], inflight: dict[int, list[Any]], get_inputs: Callable[..., Any],
               admit_s: np.ndarray, done_s: np.ndarray, status: np.ndarray, now: float, keep: bool,
               t0: float, on_done: Callable[..., None] | None, base: int) -> int:
        """Route, record and send newly admitted requests; returns how many finished right away."""
        t_a, c_a = time.perf_counter(), self.tracer.cpu()
        idx = np.asarray(adm, dtype=np.int64)
        inputs = get_inputs(idx)
        routes = []
        for i in adm:
            route = self.router.assign()
            routes.append(route)
            outs: list[Any] = [None] * self.n_outputs if keep else []
            inflight[i] = [route, outs, self.n_outputs - len(self._passthrough), 0]
            admit_s[i] = now
        finished = 0
        if self._passthrough:
            for k, i in enumerate(adm):
                rec = inflight[i]
                if keep:
                    for j, src in self._passthrough:
                        rec[1][j] = take_requests(inputs[src], self.df.input_bdims[src], [k])
                if rec[2] <= 0:
                    del inflight[i]
                    self.router.release(rec[0])
                    done_s[i], status[i] = now, STATUS_OK
                    finished += 1
                    if on_done is not None:
                        on_done(i, rec[1])
        ids = [base + i for i in adm]
        for ci, pairs in self._entry:
            groups: dict[int, list[int]] = {}
            for k, route in enumerate(routes):
                groups.setdefault(route[ci], []).append(k)
            for rank, pos in groups.items():
                bd = self.df.input_bdims
                sel = [(slot, take_requests(inputs[i], bd[i], pos), bd[i][0]) for i, slot in pairs]
                self.outbox.add(tp.isend_message(self.comm, rank, tp.KIND_DATA, [ids[k] for k in pos],
                                                 [routes[k] for k in pos], sel), rank)
        self.tracer.span("admit_send", t_a, time.perf_counter(), ids, cpu0=c_a)
        return finished

    def admit_rows(self, rows: list[int], inflight: dict[int, list[Any]], get_inputs: Callable[..., Any],
                   admit_s: Any, done_s: Any, status: Any, now: float,
                   on_done: Callable[[int, list[torch.Tensor]], None]) -> int:
        """Server mode's admission (:mod:`hpcsplit.runtime.server.serve`): rows numbered by their global
        request ids (``get_inputs`` gets those), outputs kept; the per-row records are mappings."""
        return self._admit(rows, inflight, get_inputs, admit_s, done_s, status, now, True, 0.0, on_done, 0)

    # ------------------------------------------------------------------ control
    def stop_all(self, timeout_s: float = 30.0) -> None:
        """Start the shutdown: STOP to every replica fed by the frontend (it propagates downstream).

        Outputs still on their way (of timed-out requests) are received and dropped later by
        :meth:`drop_strays`, which the caller keeps calling until the components report back.
        """
        lost = lost_ranks()  # [Note: lost ranks]: STOP goes to the survivors only
        for r in self.df.entry_ranks():
            if r not in lost:
                self.outbox.add(tp.isend_message(self.comm, r, tp.KIND_STOP), r)
        self.outbox.drain(timeout_s=timeout_s)

    def drop_strays(self) -> int:
        """Receive and drop whatever arrives (late outputs); returns how many messages."""
        return len(self.inbox.poll())
