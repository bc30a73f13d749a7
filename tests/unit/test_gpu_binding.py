"""A rank's GPU binding with ``torch.cuda`` stood in for (this machine has no GPU; the real path runs in
the ``gpu`` tests): which device, which memory cap, which float32 math."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from hpcsplit.core.cluster import GIB
from hpcsplit.errors import RuntimeStageError
from hpcsplit.runtime.component import load_variant
from hpcsplit.runtime.rank import bind_device
from hpcsplit.runtime.routing import WHOLE


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    calls: dict[str, Any] = {"device": None, "fraction": None}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=80 * GIB))
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.__setitem__("device", d))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                        lambda f, d: calls.__setitem__("fraction", (f, d)))
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield calls
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def _entry(gpu: int, slice_gb: float) -> SimpleNamespace:
    return SimpleNamespace(role="component", gpu=gpu, slice_gb=slice_gb, component="vision")


def test_rank_binds_its_gpu_with_the_profiled_cap(fake_cuda: dict[str, Any]) -> None:
    dev = bind_device(SimpleNamespace(device_kind="cuda"), _entry(2, 20), rank=3)
    assert dev == torch.device("cuda", 2) and fake_cuda["device"] == dev
    assert fake_cuda["fraction"] == (0.25, dev)  # 20 GiB of 80 GiB, as apply_slice capped the profile
    assert not torch.backends.cudnn.allow_tf32 and not torch.backends.cuda.matmul.allow_tf32


def test_rank_outside_the_visible_gpus_says_so(fake_cuda: dict[str, Any]) -> None:
    with pytest.raises(RuntimeStageError, match=r"plan says GPU 5 but this rank sees 4 GPU\(s\)"):
        bind_device(SimpleNamespace(device_kind="cuda"), _entry(5, 20), rank=1)
    assert fake_cuda["fraction"] is None


def test_a_rank_with_its_own_mig_instance_binds_cuda_0(fake_cuda: dict[str, Any],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # launcher=local gave this rank one MIG instance of physical GPU 1: it is the process's only device.
    monkeypatch.setenv("HPCSPLIT_RANK_CUDA_DEVICES", '["MIG-a", "MIG-b"]')
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    dev = bind_device(SimpleNamespace(device_kind="cuda"), _entry(1, 20), rank=1)
    assert dev == torch.device("cuda", 0) and fake_cuda["device"] == dev
    monkeypatch.delenv("HPCSPLIT_RANK_CUDA_DEVICES")
    with pytest.raises(RuntimeStageError, match=r"plan says GPU 1 but this rank sees 1 GPU\(s\)"):
        bind_device(SimpleNamespace(device_kind="cuda"), _entry(1, 20), rank=1)


def test_cpu_plans_and_the_frontend_stay_on_the_cpu(fake_cuda: dict[str, Any]) -> None:
    assert bind_device(SimpleNamespace(device_kind="cpu"), _entry(0, 20), rank=1) == torch.device("cpu")
    front = SimpleNamespace(role="frontend", gpu=None, slice_gb=None, component=None)
    assert bind_device(SimpleNamespace(device_kind="cuda"), front, rank=0) == torch.device("cpu")
    assert fake_cuda["device"] is None and torch.backends.cudnn.allow_tf32


def test_gpu_plan_without_cuda_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeStageError, match="CUDA is not available here"):
        bind_device(SimpleNamespace(device_kind="cuda"), _entry(0, 20), rank=1)


class _TooBig:
    """A switchboard whose programs do not fit: what loading onto a GPU slice raises when they do not."""

    def load_component(self, name: str, device: Any = None) -> Any:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\n(details)")

    def load_whole(self, device: Any = None) -> Any:
        raise RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED: out of memory")


def test_a_program_too_big_for_its_slice_names_the_slice_and_the_fix() -> None:
    def ctx_on(device: torch.device) -> Any:
        return SimpleNamespace(rank=2, device=device, on_gpu=device.type == "cuda", switchboard=_TooBig(),
                               runtime=SimpleNamespace(verify=True))

    ctx = ctx_on(torch.device("cuda", 0))
    df = SimpleNamespace(batch_size_of=lambda rank: 8)
    with pytest.raises(RuntimeStageError, match=r"rank 2: component 'vision' does not fit in this rank's GPU memory "
                                                r"slice \(10 GB\) at batch 8: CUDA out of memory\. Tried to allocate "
                                                r"2\.00 GiB\. Give the cluster larger cluster\.slices_gb"):
        load_variant(ctx, df, "split", "vision", 10)
    with pytest.raises(RuntimeStageError, match=r"the unsplit model .* or serve without the baseline"):
        load_variant(ctx, df, "whole", WHOLE, 10)
    ctx = ctx_on(torch.device("cpu"))  # on the CPU it is not about slices: the error passes as it is
    with pytest.raises(torch.OutOfMemoryError):
        load_variant(ctx, df, "split", "vision", 10)
