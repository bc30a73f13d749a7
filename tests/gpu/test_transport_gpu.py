"""GPU tensors between real MPI ranks: staged through pinned host buffers (no CUDA-aware MPI), and landing
on the receiver's GPU, equal to what was sent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.mpi.jobs import MPIEXEC

pytestmark = [pytest.mark.gpu, pytest.mark.mpi]

_JOB = """
import json, torch
from mpi4py import MPI
from hpcsplit.runtime import transport as tp
comm = MPI.COMM_WORLD
rank = comm.Get_rank()
dev = torch.device("cuda", 0)
out = {"aware": list(tp.cuda_aware_mpi())}
if rank == 0:
    t = (torch.arange(6 * 1000, dtype=torch.float32, device=dev) * 0.5).view(6, 1000)
    b = torch.ones(6, 3, dtype=torch.bfloat16, device=dev)
    tp.send_message(comm, 1, tp.KIND_DATA, list(range(6)), [[1]] * 6, [(0, t), (1, b)])
    out["sum"] = float(t.sum())
else:
    msg = tp.recv_message(comm, source=0, device=dev, timeout_s=60)
    out["devices"] = [str(x.device) for x in msg.tensors]
    out["dtypes"] = [str(x.dtype) for x in msg.tensors]
    out["sum"] = float(msg.tensors[0].sum())
    ref = (torch.arange(6 * 1000, dtype=torch.float32, device=dev) * 0.5).view(6, 1000)
    out["equal"] = bool(torch.equal(msg.tensors[0], ref)) and bool((msg.tensors[1] == 1).all())
res = comm.gather(out)
if rank == 0:
    print("RESULT " + json.dumps(res), flush=True)
"""


def test_cuda_tensors_cross_ranks_through_pinned_buffers(tmp_path: Path) -> None:
    if MPIEXEC is None:
        pytest.skip("no mpiexec")
    (tmp_path / "job.py").write_text(_JOB)
    env = dict(os.environ, HPCSPLIT_CUDA_AWARE_MPI="0", PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    p = subprocess.run([MPIEXEC, "-n", "2", sys.executable, str(tmp_path / "job.py")], capture_output=True,
                       text=True, timeout=180, env=env, check=False)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    res = json.loads(next(x for x in p.stdout.splitlines() if x.startswith("RESULT "))[7:])
    assert res[0]["aware"] == [False, "HPCSPLIT_CUDA_AWARE_MPI"]
    assert res[1]["devices"] == ["cuda:0", "cuda:0"] and res[1]["dtypes"] == ["torch.float32", "torch.bfloat16"]
    assert res[1]["equal"] and res[1]["sum"] == res[0]["sum"]


def test_send_buffers_are_pinned_host_copies() -> None:
    import torch

    from hpcsplit.runtime import buffers as bf

    t = torch.randn(257, 33, device="cuda")
    _buf, keep = bf.send_buffer(t, cuda_aware=False)
    assert keep and keep[0].is_pinned() and not keep[0].is_cuda
    assert torch.equal(keep[0].view(torch.float32).view(257, 33), t.cpu())
