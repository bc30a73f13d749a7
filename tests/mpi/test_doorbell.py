"""The doorbell under real ``mpiexec``: a sleeping rank is woken by a ring, a busy one is not rung; ranks on
other nodes (simulated on this one) are rung over UDP."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.mpi.jobs import MPIEXEC, run_job

pytestmark = pytest.mark.mpi

# every script ends alike: uninstall, close (collective), gather the ranks' dicts on rank 0
TAIL = '''comm.Barrier()
mb.install_doorbell(None)
db.close()
res = comm.gather(out, root=0)
if rank == 0:
    print("RESULT " + json.dumps(res))
'''

SCRIPT = r'''
import json, time
import torch
from mpi4py import MPI
from hpcsplit.runtime import transport as tp
from hpcsplit.runtime import mailbox as mb
from hpcsplit.runtime.doorbell import Doorbell

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
db = Doorbell(comm)
out = {}
# 1. rank 1 sleeps (10 s timeout); rank 0 sends it a message and rings once the flag is up
if rank == 1:
    out["rung"] = db.sleep(10.0, db.probe_header)
    out["wakeups"] = db.wakeups
    out["got"] = tp.recv_message(comm, source=0).header.request_ids
elif rank == 0:
    while not db.flags[1]:
        time.sleep(1e-3)
    time.sleep(0.02)  # past the probe the sleeper makes after raising its flag: this one must ring
    h = tp.isend_message(comm, 1, tp.KIND_DATA, (7,), (), [(0, torch.ones(3))])
    out["ring_sleeper"] = db.ring(1)
    h.wait()
    out["ring_busy"] = db.ring(2)  # rank 2 is in the barrier below, not sleeping: no byte
comm.Barrier()
# 2. nobody rings: the sleep ends at its timeout
if rank == 1:
    out["timeout"] = db.sleep(0.05, db.probe_header)
comm.Barrier()
# 3. the message is there before the flag goes up: the probe after raising it sees it, no ring needed
if rank == 0:
    tp.send_message(comm, 1, tp.KIND_DATA, (8,), (), [(0, torch.ones(3))])
comm.Barrier()
if rank == 1:
    out["probe_first"] = db.sleep(10.0, db.probe_header)
    out["wakeups_after"] = db.wakeups
    tp.recv_message(comm, source=0)
# 4. through the mailbox: Backoff sleeps with the doorbell installed, Outbox.add rings
mb.install_doorbell(db)
comm.Barrier()
if rank == 1:
    b = mb.Backoff(spin_s=0.0, max_sleep_s=5.0, deep_sleep_s=5.0)
    b._sleep = 5.0
    inbox = mb.Inbox(comm)
    while not inbox.poll():
        b.idle(time.perf_counter())
    out["backoff_wakeups"] = db.wakeups
elif rank == 0:
    while not db.flags[1]:
        time.sleep(1e-3)
    time.sleep(0.02)  # past the probe the sleeper makes after raising its flag: this one must ring
    ob = mb.Outbox()
    ob.add(tp.isend_message(comm, 1, tp.KIND_DATA, (9,), (), [(0, torch.ones(3))]), 1)
    ob.drain(10.0)
    out["rings"] = db.rings
def nap_barrier():
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(1e-3)


# 5. a quiet rank (nothing on the way) of a one-node job sleeps DOORBELL_QUIET_SLEEP_S after 1 ms of backoff
#    instead of backing off on, and a ring still wakes it at once
comm.Barrier()
if rank == 1:
    counts = {}
    for quiet in (True, False):
        b, n, t_end = mb.Backoff(), 0, time.perf_counter() + 0.5
        while (now := time.perf_counter()) < t_end:
            b.idle(now, quiet=quiet)
            n += time.perf_counter() - now > 15e-6  # slept (the first 50 us are spin: instant returns)
        counts[quiet] = n
    out["quiet_idle_calls"], out["backoff_idle_calls"] = counts[True], counts[False]
    b, inbox = mb.Backoff(), mb.Inbox(comm)
    nap_barrier()
    got = []
    while not got:
        got = inbox.poll()
        if not got:
            b.idle(time.perf_counter(), quiet=not inbox.pending)
    out["quiet_woken_at"] = time.time()
elif rank == 0:
    nap_barrier()  # (MPICH's Barrier would spin beside the counting above)
    time.sleep(0.35)  # rank 1 is in a quiet sleep by now
    out["quiet_sent_at"] = time.time()
    ob = mb.Outbox()
    ob.add(tp.isend_message(comm, 1, tp.KIND_DATA, (10,), (), [(0, torch.ones(3))]), 1)
    ob.drain(10.0)
else:
    nap_barrier()
# 6. a send still pending when added rings again when it completes (for MPICH delivering a held-back
#    message after the first ring; here the pending send is a large one, which completes once taken)
comm.Barrier()
if rank == 1:
    time.sleep(0.3)  # no MPI calls: rank 0's large send stays pending through its add()
    tp.recv_message(comm, source=0)
    t0 = time.perf_counter()
    out["rerung"] = db.sleep(5.0)  # no probe: only a ring ends it early
    out["rerung_after_s"] = time.perf_counter() - t0
elif rank == 0:
    ob = mb.Outbox()
    rings0 = db.rings
    ob.add(tp.isend_message(comm, 1, tp.KIND_DATA, (11,), (), [(0, torch.ones(1 << 20))]), 1)
    out["pending_after_add"] = len(ob.pending)
    t_end = time.time() + 20  # (fails below rather than hangs, should rank 1 need our progress)
    while not db.flags[1] and time.time() < t_end:  # rank 1 has the message and sleeps again
        time.sleep(1e-3)
    time.sleep(0.02)
    ob.drain(10.0)
    out["rerings"] = db.rings - rings0
''' + TAIL


def test_sleeping_rank_is_woken_and_busy_rank_not_rung(tmp_path: Path) -> None:
    r0, r1, _r2 = run_job(tmp_path, SCRIPT, 3, timeout_s=180)
    assert r0["ring_sleeper"] is True and r0["ring_busy"] is False
    assert r1["rung"] is True and r1["wakeups"] == 1 and r1["got"] == [7]
    assert r1["timeout"] is False
    assert r1["probe_first"] is True and r1["wakeups_after"] == 1  # woken by the probe, not a ring
    assert r1["backoff_wakeups"] == 2 and r0["rings"] == 2
    # 0.5 s idle: 1 ms of backoff (6 sleeps), then five 100 ms sleeps, vs a hundred or so sleeps of the backoff
    # (20 us doubling to 1 ms, then 2-10 ms)
    assert r1["quiet_idle_calls"] <= 16 and r1["backoff_idle_calls"] >= max(30, 2 * r1["quiet_idle_calls"]), r1
    assert r1["quiet_woken_at"] - r0["quiet_sent_at"] < 0.05  # rung, not the end of a 100 ms sleep
    # a 4 MiB send pending at add() rang nobody then (rank 1 was awake) and rang once more on completion
    assert r0["pending_after_add"] == 1 and r0["rerings"] == 1
    assert r1["rerung"] is True and r1["rerung_after_s"] < 2.0


REMOTE = r'''
import json, os, time
import torch
from mpi4py import MPI
from hpcsplit.runtime import transport as tp
from hpcsplit.runtime import mailbox as mb
from hpcsplit.runtime.doorbell import Doorbell

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
mode = os.environ["REMOTE"]
db = Doorbell(comm, remote=mode != "local", network="203.0.113.0/24" if mode == "bad" else None)
out = {"remote_peers": len(db._remote), "all_local": db.all_local, "note": db.note, "address": db.address,
       "quiet_sleep_s": db.quiet_sleep_s}
comm.Barrier()
# 1. stale rings (messages already taken while busy) must not end a later sleep early
if rank == 0:
    out["stale"] = db.ring(1)
comm.Barrier()
time.sleep(0.05)  # the datagram has landed in rank 1's socket
if rank == 1:
    t0 = time.perf_counter()
    out["stale_sleep_rung"] = db.sleep(0.2, db.probe_header)
    out["stale_sleep_s"] = time.perf_counter() - t0
comm.Barrier()
# 2. rank 1 sleeps through the mailbox (5 s); rank 0 sends and rings without seeing any flag
mb.install_doorbell(db)
if rank == 1:
    b = mb.Backoff(spin_s=0.0, max_sleep_s=5.0, deep_sleep_s=5.0)
    b._sleep = 5.0
    inbox = mb.Inbox(comm)
    t0 = time.perf_counter()
    got = []
    while not got:
        got = inbox.poll()
        if not got:
            b.idle(time.perf_counter())
    out["woken_after_s"] = time.perf_counter() - t0
    out["got"] = got[0][0].header.request_ids
    out["wakeups"] = db.wakeups
elif rank == 0:
    while not db.flags[1]:  # the flags still exist on this one node; rank 0 only reads them to time the send
        time.sleep(1e-3)
    time.sleep(0.02)  # past the probe the sleeper makes after raising its flag: only a ring can wake it now
    ob = mb.Outbox()
    ob.add(tp.isend_message(comm, 1, tp.KIND_DATA, (9,), (), [(0, torch.ones(3))]), 1)
    ob.drain(10.0)
    out["remote_rings"] = db.remote_rings
''' + TAIL


@pytest.mark.parametrize("mode", ["udp", "local", "bad"])
def test_ranks_on_other_nodes_are_rung_over_udp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """``HPCSPLIT_DOORBELL_ALL_REMOTE=1``: every other rank counts as on another node.  With UDP rings a
    rank in a 5 s sleep is woken by the ring.  With node-local rings only (``runtime.doorbell=local``), or
    with a network no interface is on (``runtime.doorbell_network``, reported), nothing rings it: it sleeps
    to its timeout."""
    if MPIEXEC is None:  # pragma: no cover
        pytest.skip("no mpiexec on PATH")
    monkeypatch.setenv("HPCSPLIT_DOORBELL_ALL_REMOTE", "1")
    monkeypatch.setenv("REMOTE", mode if mode != "udp" else "1")
    r0, r1 = run_job(tmp_path, REMOTE, 2, timeout_s=180)
    assert r1["got"] == [9]
    assert not r0["all_local"] and not r1["all_local"]  # UDP rings: quiet sleeps of 20 ms at most
    # a quiet rank sleeps 20 ms only when every rank elsewhere can ring it and its test ring came
    assert r0["quiet_sleep_s"] == r1["quiet_sleep_s"] == (0.02 if mode == "udp" else None)
    assert r0["stale"] is (mode == "udp")
    assert r1["stale_sleep_rung"] is False and r1["stale_sleep_s"] >= 0.15  # drained, not woken by it
    if mode == "udp":
        assert r0["remote_peers"] == r1["remote_peers"] == 1 and r0["address"] and not r0["note"] + r1["note"]
        assert r0["remote_rings"] == 2 and r1["wakeups"] == 1  # rings: the stale one, then the send's
        assert r1["woken_after_s"] < 3.0  # rung, not the 5 s timeout
    else:
        assert r0["remote_peers"] == 0 and r0["remote_rings"] == 0
        assert r1["wakeups"] == 0 and r1["woken_after_s"] >= 4.0  # nobody could ring it: its timeout
    if mode == "bad":
        for r in (r0, r1):
            assert "203.0.113.0/24" in r["note"] and "runtime.doorbell_network" in r["note"] and not r["address"]
    elif mode == "local":
        assert not r0["note"] and not r0["address"]
