"""The hand-over between the servers' handlers and the frontend loop (one event loop, ``[Note: server mode]``).

A checked request becomes a :class:`Ticket` and goes into a bounded queue (``runtime.server_queue``;
a deque: the handlers and the frontend loop run on one thread): when it is full the server answers 503 / UNAVAILABLE at once, so memory
stays bounded however fast clients send.  The frontend loop takes tickets, feeds their samples into
the pipeline and resolves each ticket's asyncio future (directly on the loop's own thread, through
``loop.call_soon_threadsafe`` from any other).  After putting a ticket the hub calls ``on_submit``, which
ends the frontend loop's pause, so an idle server adds no sleep to a request.

The hub also keeps the counters behind ``/v2/models/<m>/stats`` and the Prometheus metrics
(``/metrics``), and the ready / draining state.

[Note: metrics per batch]
The per-request metrics (``hpcsplit_requests_total`` and the four request histograms) are not
prometheus_client's ``Counter`` and ``Histogram``: their ``observe`` takes a lock and walks the buckets,
about 1 us a call, and an answered request made five such calls, a tenth of the frontend loop's own work
per request (``python -m hpcsplit.bench server``).  Here a request appends its figures to a list, and the
lists fold into bucket counts (numpy, per batch of values) when ``/metrics`` is read or 4,096 values wait.
The exposition is the same: counters, cumulative ``le`` buckets, ``_sum`` and ``_count``.
"""

from __future__ import annotations

import asyncio
import hmac
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from hpcsplit.runtime.server.protocol import InferRequest, ModelSpec, RequestRejected

__all__ = ["Hub", "Ticket"]

_LATENCY_BUCKETS = (5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_FOLD_AT = 4096  # values a histogram keeps before it folds them into its buckets


class _Histogram:
    """One histogram series, observed per batch (``[Note: metrics per batch]``): :meth:`add` keeps a value,
    :meth:`fold` turns the values kept into bucket counts (itself, once ``_FOLD_AT`` wait).

    Examples
    --------
    >>> h = _Histogram((1.0, 2.0))
    >>> for v in (0.5, 1.0, 1.5, 7.0):
    ...     h.add(v)
    >>> h.fold()
    >>> h.counts.tolist(), h.total
    ([2, 1, 1], 10.0)
    """

    __slots__ = ("bounds", "counts", "pending", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = np.asarray(bounds, dtype=np.float64)
        self.counts = np.zeros(len(bounds) + 1, dtype=np.int64)  # the last one: above every bound (+Inf)
        self.total = 0.0
        self.pending: list[float] = []

    def add(self, value: float) -> None:
        p = self.pending
        p.append(value)
        if len(p) >= _FOLD_AT:
            self.fold()

    def fold(self) -> None:
        if self.pending:
            a = np.asarray(self.pending, dtype=np.float64)
            self.pending = []
            # le semantics: a value equal to a bound is in that bound's bucket
            self.counts += np.bincount(np.searchsorted(self.bounds, a, side="left"), minlength=len(self.counts))
            self.total += float(a.sum())

    def sample(self) -> tuple[list[tuple[str, float]], float]:
        """The cumulative ``(le, count)`` buckets, ``+Inf`` last, and the sum."""
        self.fold()
        cum = np.cumsum(self.counts).tolist()
        les = [floatToGoString(b) for b in self.bounds.tolist()] + ["+Inf"]
        return list(zip(les, cum, strict=True)), self.total


@dataclass(slots=True, eq=False)  # compared and hashed by identity (the hub's set of open tickets)
class Ticket:
    """One client request on its way: resolved with the output arrays or an error."""

    req: InferRequest
    protocol: str
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]
    t_arrival: float = field(default_factory=time.perf_counter)
    t_admit: float = 0.0
    compute_us: int = 0  # the longest critical-path compute of its samples

    def resolve(self, result: Any) -> None:
        """From any thread: hand the future its result (a list of arrays, or a RequestRejected)."""
        def _set() -> None:
            if not self.future.done():
                if isinstance(result, BaseException):
                    self.future.set_exception(result)
                else:
                    self.future.set_result(result)

        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:  # the frontend loop runs on the servers' event loop: no hand-over
            _set()
            return
        try:
            self.loop.call_soon_threadsafe(_set)
        except RuntimeError:  # the loop closed (shutdown): nobody waits any more
            pass


class Hub:
    """Bounded queue, readiness, counters and metrics shared by the servers and the frontend loop."""

    def __init__(self, spec: ModelSpec, capacity: int, token: str | None) -> None:
        self.spec = spec
        self.token = token
        self.capacity = capacity
        self.queue: deque[Ticket] = deque()
        self.ready = threading.Event()
        self.draining = threading.Event()
        self.failed: str | None = None  # the job's fatal error, once it has one
        self.degraded: list[str] = []  # the replicas lost while serving on ([Note: serving through faults])
        self._lock = threading.Lock()
        # Triton-style statistics (perf_analyzer reads them when /v2 lists "statistics")
        self.stats = {k: [0, 0] for k in ("success", "fail", "queue", "compute_input", "compute_infer",
                                          "compute_output", "cache_hit", "cache_miss")}
        self.inference_count = 0
        self.execution_count = 0
        self.last_inference_ms = 0
        self.inflight_rows = 0
        self.registry = CollectorRegistry()
        r = self.registry
        # [Note: metrics per batch]: plain counts and lists, folded when /metrics is read
        self.outcomes: dict[tuple[str, str], int] = {}  # (protocol, outcome) -> requests
        self.latency: dict[str, _Histogram] = {}  # protocol -> arrival to answer (s)
        self.h_batch = _Histogram(_BATCH_BUCKETS)
        self.h_compute = _Histogram(_LATENCY_BUCKETS)
        self.h_queue = _Histogram(_LATENCY_BUCKETS)
        r.register(_RequestCollector(self))
        g = Gauge("hpcsplit_queue_depth", "Requests waiting at the frontend", registry=r)
        g.set_function(lambda: len(self.queue))
        g2 = Gauge("hpcsplit_inflight_samples", "Samples inside the pipeline", registry=r)
        g2.set_function(lambda: self.inflight_rows)
        g3 = Gauge("hpcsplit_ready", "1 while the server admits requests", registry=r)
        g3.set_function(lambda: float(self.is_ready()))
        # (component, rank) -> [batches, samples, compute us, largest batch, failed rows], sent by the ranks
        self.components: dict[tuple[str, int], list[int]] = {}
        r.register(_ComponentCollector(self))
        self.open: set[Ticket] = set()  # submitted, not yet answered (finish / fail): abandon() answers them
        self.on_submit: Callable[[], None] | None = None  # wakes the frontend loop when it pauses

    # ------------------------------------------------------------------ state
    def is_ready(self) -> bool:
        return self.ready.is_set() and not self.draining.is_set() and self.failed is None

    def check_token(self, given: str | None) -> bool:
        if self.token is None:
            return True
        return given is not None and hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode())

    # ------------------------------------------------------------------ server side
    def submit(self, req: InferRequest, protocol: str) -> Ticket:
        """Queue a checked request (from the asyncio thread); raises RequestRejected when not admitting."""
        self.check_admitting()
        loop = asyncio.get_running_loop()
        t = Ticket(req, protocol, loop, loop.create_future())
        self.enqueue(t)
        return t

    def check_admitting(self) -> None:
        """Raise RequestRejected (503) unless the server admits requests now."""
        if self.failed is not None:
            raise RequestRejected(f"the server failed: {self.failed}", 503, "UNAVAILABLE")
        if not self.is_ready():
            raise RequestRejected("the server is not ready (starting or draining after a stop signal)", 503,
                                  "UNAVAILABLE")

    def enqueue(self, t: Ticket) -> None:
        """Queue a ticket; raises RequestRejected (503, counted ``busy``) when the queue is full."""
        if len(self.queue) >= self.capacity:
            self.count(t, "busy")
            err = RequestRejected(f"the server's queue is full ({self.capacity} requests wait: "
                                  "runtime.server_queue); retry later", 503, "UNAVAILABLE")
            err.counted = True
            raise err
        self.queue.append(t)
        self.open.add(t)
        if self.on_submit is not None:
            self.on_submit()

    def count(self, t: Ticket | None, outcome: str, protocol: str | None = None, now: float | None = None) -> None:
        """One answered request (``ok``, ``error``, ``busy``, ``timeout``, ``rejected``) into the metrics."""
        proto = t.protocol if t is not None else (protocol or "")
        key = (proto, outcome)
        with self._lock:
            self.outcomes[key] = self.outcomes.get(key, 0) + 1
            if t is not None and outcome != "busy":
                h = self.latency.get(proto)
                if h is None:
                    h = self.latency[proto] = _Histogram(_LATENCY_BUCKETS)
                h.add((time.perf_counter() if now is None else now) - t.t_arrival)

    # ------------------------------------------------------------------ frontend side
    def take(self, limit: int) -> list[Ticket]:
        q = self.queue
        return [q.popleft() for _ in range(min(limit, len(q)))]

    def finish(self, t: Ticket, outputs: list[np.ndarray]) -> None:
        now = time.perf_counter()
        n = t.req.batch
        queued = t.t_admit - t.t_arrival
        with self._lock:
            self.inference_count += n
            self.execution_count += 1
            self.last_inference_ms = int(time.time() * 1e3)
            st = self.stats
            _add(st["success"], now - t.t_arrival)
            _add(st["queue"], queued)
            _add(st["compute_infer"], now - t.t_admit)
            st["compute_input"][0] += 1  # perf_analyzer wants the three compute counts equal
            st["compute_output"][0] += 1
            self.h_batch.add(n)
            self.h_compute.add(t.compute_us / 1e6)
            self.h_queue.add(queued)
        self.count(t, "ok", now=now)
        self.open.discard(t)
        t.resolve(outputs)

    def fail(self, t: Ticket, err: RequestRejected, outcome: str = "error") -> None:
        with self._lock:
            _add(self.stats["fail"], time.perf_counter() - t.t_arrival)
        self.count(t, outcome)
        err.counted = True
        self.open.discard(t)
        t.resolve(err)

    def abandon(self, err: RequestRejected) -> int:
        """Answer ``err`` to every request not answered yet, each on its own (the frontend loop ended and
        could not answer them: no handler may wait on a ticket nobody resolves); returns how many."""
        left = list(self.open)
        self.queue.clear()
        for t in left:
            try:
                self.fail(t, err)
            except Exception:  # noqa: BLE001 - the next one still gets its answer
                self.open.discard(t)
                t.resolve(err)
        return len(left)

    async def metrics_text(self) -> bytes:
        """``/metrics``: the Prometheus text (a protocol worker asks the frontend's hub for it)."""
        return generate_latest(self.registry)

    async def read_statistics(self) -> dict[str, Any]:
        """:meth:`statistics`, as the servers' handlers ask for it (a protocol worker asks the frontend)."""
        return self.statistics()

    def statistics(self) -> dict[str, Any]:
        """``/v2/models/<m>/stats`` (Triton's shape)."""
        with self._lock:
            st = {k: {"count": c, "ns": ns} for k, (c, ns) in self.stats.items()}
            return {"model_stats": [{"name": self.spec.name, "version": self.spec.version,
                                     "last_inference": self.last_inference_ms,
                                     "inference_count": self.inference_count,
                                     "execution_count": self.execution_count,
                                     "inference_stats": st, "batch_stats": []}]}

    def component_stats(self, name: str, rank: int, values: list[int]) -> None:
        """A component rank's counters so far (``serve_component``'s ``stats_every_s``); malformed ones are
        ignored."""
        if len(values) == 5 and all(isinstance(v, int) and v >= 0 for v in values):
            self.components[(name, int(rank))] = list(values)


def _add(stat: list[int], seconds: float) -> None:
    stat[0] += 1
    stat[1] += int(max(seconds, 0.0) * 1e9)


class _RequestCollector:
    """``/metrics`` for the requests (``[Note: metrics per batch]``): outcomes and the four histograms."""

    def __init__(self, hub: Hub) -> None:
        self.hub = hub

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        hub = self.hub
        with hub._lock:
            outcomes = sorted(hub.outcomes.items())
            latency = {p: h.sample() for p, h in sorted(hub.latency.items())}
            rest = [h.sample() for h in (hub.h_batch, hub.h_compute, hub.h_queue)]
        req = CounterMetricFamily("hpcsplit_requests", "Infer requests answered, by protocol and outcome",
                                  labels=["protocol", "outcome"])
        for (proto, outcome), n in outcomes:
            req.add_metric([proto, outcome], n)
        lat = HistogramMetricFamily("hpcsplit_request_latency_seconds", "Infer request latency (arrival to answer)",
                                    labels=["protocol"])
        for proto, (buckets, total) in latency.items():
            lat.add_metric([proto], buckets, sum_value=total)
        yield req
        yield lat
        for (name, doc), (buckets, total) in zip(
                (("hpcsplit_request_batch_size", "Samples per infer request"),
                 ("hpcsplit_request_compute_seconds",
                  "Compute on a request's critical path (the components' batches it rode in)"),
                 ("hpcsplit_request_queue_seconds", "Arrival to admission into the pipeline")), rest, strict=True):
            fam = HistogramMetricFamily(name, doc)
            fam.add_metric([], buckets, sum_value=total)
            yield fam


class _ComponentCollector:
    """``/metrics`` for every component replica, from the counters its rank sends once a second."""

    def __init__(self, hub: Hub) -> None:
        self.hub = hub

    def describe(self) -> list[Any]:
        return []  # the replicas are known once their ranks report

    def collect(self) -> Iterator[Any]:
        labels = ["component", "rank"]
        batches = CounterMetricFamily("hpcsplit_component_batches", "Batches a component replica ran", labels=labels)
        samples = CounterMetricFamily("hpcsplit_component_samples", "Samples a component replica computed",
                                      labels=labels)
        compute = CounterMetricFamily("hpcsplit_component_compute_seconds",
                                      "Time a component replica spent in its program", labels=labels)
        largest = GaugeMetricFamily("hpcsplit_component_max_batch", "Largest batch a component replica ran",
                                    labels=labels)
        for (name, rank), (b, n, us, mx, _failed) in sorted(dict(self.hub.components).items()):  # a snapshot
            key = [name, str(rank)]
            batches.add_metric(key, b)
            samples.add_metric(key, n)
            compute.add_metric(key, us / 1e6)
            largest.add_metric(key, mx)
        yield from (batches, samples, compute, largest)
