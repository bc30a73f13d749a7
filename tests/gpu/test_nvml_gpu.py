"""NVML on a real GPU: cluster=auto finds what torch sees, and utilization is read back while a kernel runs."""

from __future__ import annotations

import math
import time

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_cluster_auto_finds_the_gpus_torch_sees() -> None:
    from hpcsplit.core.cluster import GIB, ClusterSpec
    from hpcsplit.core.detect import detect_gpus, resolve_cluster
    from hpcsplit.core.settings import group_defaults

    det = detect_gpus()
    assert det.gpus, det.why
    lines: list[str] = []
    spec = ClusterSpec.from_config(resolve_cluster(group_defaults("cluster", "auto"), lines.append, det))
    assert spec.device_kind == "cuda" and lines and "-> cluster 'auto' (cuda)" in lines[0]
    if det.mig:
        assert torch.cuda.device_count() >= 1 and spec.mig_profiles
    else:
        assert spec.gpus_per_node == torch.cuda.device_count()
        total = min(torch.cuda.get_device_properties(i).total_memory for i in range(spec.gpus_per_node)) / GIB
        assert abs(spec.gpu_mem_gb - total) < 0.2 and max(spec.slices_gb) == spec.gpu_mem_gb
        assert spec.gpu_name == torch.cuda.get_device_name(0)


def test_nvml_utilization_is_read_back_while_a_kernel_runs() -> None:
    from hpcsplit.core.device import NvmlSampler

    a = torch.randn(4096, 4096, device="cuda")
    sampler = NvmlSampler(0, 20)
    assert sampler._handle is not None, "NVML found no handle for cuda:0 (UUID lookup)"
    deadline = time.perf_counter() + 1.0
    with sampler:
        while time.perf_counter() < deadline:
            a = (a @ a).clamp_(-1, 1)
            torch.cuda.synchronize()
    util = sampler.mean_fraction()
    assert not math.isnan(util) and 0.2 < util <= 1.0, util  # busy for a second: well above idle


def test_device_meta_names_the_gpu_and_driver() -> None:
    from hpcsplit.core.device import device_meta

    meta = device_meta("cuda", torch.device("cuda", 0))
    assert meta["device_name"] == torch.cuda.get_device_name(0) and meta["device_mem_bytes"] > 0
    assert meta["driver_version"] and "unknown" not in meta["driver_version"]
    assert meta["latency_timer"] == "cuda_events"
