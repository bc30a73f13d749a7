"""What the frontend does with the samples in flight on a lost replica (``[Note: serving through faults]``):
sent again once under new ids on live routes, failed with 503 when lost a second time.  The bookkeeping
alone, on a real :class:`Router` and the ServeLoop's own structures; the real server is in
tests/mpi/test_server_faults.py."""

from __future__ import annotations

from types import SimpleNamespace as NS
from typing import Any

import pytest

pytest.importorskip("torch")

from hpcsplit.runtime.routing import Router
from hpcsplit.runtime.server.failover import Failover
from hpcsplit.runtime.server.serve import ServeLoop


class _Loop:
    """The parts of a ServeLoop that the failover touches: its rows in flight, their jobs, the pending rows;
    a request is dropped by ServeLoop's own ``_drop``."""

    def __init__(self, fe: Any) -> None:
        self.fe, self.counts = fe, {"failed": 0}
        self.hub = NS(fail=lambda ticket, err, outcome: None)
        self.inflight: dict[int, list[Any]] = {}
        self.row_job: dict[int, tuple[Any, int]] = {}
        self.jobs: dict[int, Any] = {}
        self.pending: list[int] = []
        self.dropped: list[tuple[Any, str]] = []

    def add(self, rows: list[int], routes: list[tuple[int, ...]]) -> Any:
        job = NS(rows=list(rows), ticket=NS(req=NS(id=f"req{rows[0]}")))
        self.jobs[rows[0]] = job
        for k, (r, route) in enumerate(zip(rows, routes, strict=True)):
            self.row_job[r] = (job, k)
            self.inflight[r] = [route, [None], 1, 0]
        return job

    def _drop(self, job: Any, err: Any, outcome: str) -> None:
        ServeLoop._drop(self, job, err, outcome)  # type: ignore[arg-type]
        self.dropped.append((job, str(err)))


def _failover(replicas: tuple[int, ...]) -> tuple[Failover, Any]:
    fe = NS(router=Router(NS(components=(NS(replicas=replicas, sizes=()),))), next_id=100)
    fo = object.__new__(Failover)  # its state without a server around it
    fo.fe, fo.hub, fo.lost, fo.resent, fo._resends = fe, NS(inflight_rows=0), {}, 0, set()
    return fo, fe


def test_samples_on_a_lost_replica_are_sent_again_once_then_failed() -> None:
    fo, fe = _failover((1, 2, 3))
    sl = _Loop(fe)
    a = sl.add([0, 1], [(1,), (2,)])  # one sample on each of replicas 1 and 2
    b = sl.add([2], [(3,)])
    for route in ((1,), (2,), (3,)):
        fe.router.outstanding[route[0]] += 1
    fe.router.drop(1)
    fo.lost[1] = "rank 1: its process ended"
    fo._reroute(sl, {1})
    assert sl.pending == [100] and sl.row_job[100] == (a, 0) and a.rows == [0, 1, 100]
    assert 0 not in sl.inflight and 1 in sl.inflight and 2 in sl.inflight and fo.resent == 1
    assert fe.router.outstanding[1] == 0  # released, and never chosen again
    sl.pending.clear()
    sl.inflight[100] = [(2,), [None], 1, 0]  # the re-sent sample went to replica 2, which is lost too
    fe.router.drop(2)
    fo.lost[2] = "rank 2: it sent nothing for 2.1 s"
    fo._reroute(sl, {2})
    assert [j for j, _ in sl.dropped] == [a] and "two replicas it was routed to were lost" in sl.dropped[0][1]
    assert sl.pending == [] and 100 not in sl.row_job and 1 not in sl.row_job  # the whole request failed
    assert sl.jobs == {2: b} and 2 in sl.inflight  # the request on replica 3 goes on


def test_a_request_failed_when_lost_twice_leaves_no_row_waiting_for_admission() -> None:
    """A request of two samples: one is re-sent and lost again while the other still waits for admission
    (the pipeline window was full); the request fails, and none of its rows stays pending (admitting one
    would look up a job that is gone)."""
    fo, fe = _failover((1, 2, 3))
    sl = _Loop(fe)
    a = sl.add([0], [(1,)])
    a.rows.append(1)  # its second sample, not admitted yet
    sl.row_job[1] = (a, 1)
    sl.pending.append(1)
    b = sl.add([2], [(3,)])
    for route in ((1,), (3,)):
        fe.router.outstanding[route[0]] += 1
    fe.router.drop(1)
    fo.lost[1] = "rank 1: its process ended"
    fo._reroute(sl, {1})
    assert sl.pending == [100, 1] and a.rows == [0, 1, 100]
    sl.pending.remove(100)
    sl.inflight[100] = [(2,), [None], 1, 0]  # admitted on replica 2, which is lost too
    fe.router.drop(2)
    fo.lost[2] = "rank 2: it sent nothing for 2.1 s"
    fo._reroute(sl, {2})
    assert [j for j, _ in sl.dropped] == [a]
    assert sl.pending == []  # row 1 went with its request
    assert sl.jobs == {2: b}
