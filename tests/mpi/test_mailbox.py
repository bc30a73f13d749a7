"""The mailbox under real ``mpiexec``: one poll matches every message already waiting.

A component polls its inbox once between batches, so whatever one ``Inbox.poll`` returns is the next
batch.  MPICH moves one waiting message into its match queues per probe (``[Note: probing past
misses]``); a poll that stopped at the first empty probe took one message per two calls, and a loaded
component ran batches of one request.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.mpi.jobs import run_job

pytestmark = pytest.mark.mpi

SCRIPT = r'''
import json, time
import torch
from mpi4py import MPI
from hpcsplit.runtime import transport as tp
from hpcsplit.runtime import mailbox as mb

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
N = 8
out = {}
for case, nbytes in (("large", 3 * 224 * 224 * 4), ("small", 4096)):
    comm.Barrier()
    if rank == 0:
        # N messages of two tensors each, then no MPI call at all while rank 1 looks (a busy sender);
        # the 600 KB payloads go by CMA, which the receiver completes alone
        hs = [tp.isend_message(comm, 1, tp.KIND_DATA, (k,), (), [(0, torch.full((nbytes // 4,), float(k))),
                                                                 (1, torch.arange(3) + k)]) for k in range(N)]
        time.sleep(0.5)
        while not all(h.test() for h in hs):
            time.sleep(1e-3)
    else:
        time.sleep(0.2)  # "computing" while the messages arrive
        inbox = mb.Inbox(comm)
        first = inbox.poll()
        got = [(m.header.request_ids[0], float(m.tensors[0][0]), m.tensors[1].tolist()) for m, _ in first]
        out[case] = {"first_call": len(first), "headers_first_call": len(first) + len(inbox.pending)}
        deadline = time.perf_counter() + 30.0  # the sender may have to call into MPI for the rest
        while len(got) < N and time.perf_counter() < deadline:
            time.sleep(1e-3)
            got += [(m.header.request_ids[0], float(m.tensors[0][0]), m.tensors[1].tolist())
                    for m, _ in inbox.poll()]
        out[case]["got"] = got
        out[case]["after"] = len(inbox.poll()) + len(inbox.pending)  # nothing left, nothing doubled
comm.Barrier()
res = comm.gather(out, root=0)
if rank == 0:
    print("RESULT " + json.dumps(res))
'''


def test_one_poll_takes_every_waiting_message(tmp_path: Path) -> None:
    _r0, r1 = run_job(tmp_path, SCRIPT, 2, timeout_s=120)
    for case in ("large", "small"):
        r = r1[case]
        assert r["headers_first_call"] == 8, (case, r)  # every waiting header matched in one call
        assert r["first_call"] >= 1, (case, r)
        assert r["got"] == [[k, float(k), [k, k + 1, k + 2]] for k in range(8)], case  # in order, intact
        assert r["after"] == 0
