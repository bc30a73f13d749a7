"""Components on CUDA give the CPU's outputs (clip_tiny, full float32); the export's timing pass and the
latency timer on CUDA events; a rank's binding to a real GPU slice."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def clip_sb(switchboards: Callable[..., Path]) -> Path:
    pytest.importorskip("transformers")
    return switchboards("clip_tiny")


def test_clip_tiny_components_on_cuda_equal_the_cpu(clip_sb: Path) -> None:
    from hpcsplit.core.device import full_fp32_on_gpu
    from hpcsplit.switchboard.reader import Switchboard

    full_fp32_on_gpu()
    sb = Switchboard.load(clip_sb)
    dev = torch.device("cuda", 0)
    xs = sb.example_inputs(3)
    env_cpu = {t.name: x for t, x in zip(sb.layout.inputs, xs, strict=True)}
    env_gpu = {k: v.to(dev) for k, v in env_cpu.items()}
    with torch.no_grad():
        for name in sb.order:
            spec = sb.components[name]
            outs_cpu = sb.load_component(name)(*[env_cpu[t.name] for t in spec.inputs])
            outs_gpu = sb.load_component(name, device=dev)(*[env_gpu[t.name] for t in spec.inputs])
            for t, a, b in zip(spec.outputs, outs_cpu, outs_gpu, strict=True):
                assert b.device == dev
                torch.testing.assert_close(b.cpu(), a, atol=1e-4, rtol=1e-4, msg=f"{name}.{t.name}")
                env_cpu[t.name], env_gpu[t.name] = a, b
        whole = sb.load_whole(device=dev)(*[x.to(dev) for x in xs])
    for v, w in zip(sb.layout.output_values, whole, strict=True):
        torch.testing.assert_close(w.cpu(), env_cpu[v], atol=1e-4, rtol=1e-4)


def test_timing_pass_and_latency_timer_on_cuda() -> None:
    from hpcsplit.core.device import time_latency_ms
    from hpcsplit.switchboard.graph import capture, measure_nodes
    from hpcsplit.switchboard.models import build_toy, example_inputs

    toy = build_toy()
    cg = capture(toy, example_inputs("toy_mlp", 2, model=toy))
    costs = measure_nodes(cg, batch_size=16, repeats=3, device="cuda")
    assert costs and all(c.latency_ms > 0 for c in costs.values())
    lin = torch.nn.Linear(512, 512).cuda()
    lat = time_latency_ms(lin, [torch.randn(64, 512, device="cuda")], warmup=2, iters=5, device="cuda")
    assert len(lat) == 5 and all(x > 0 for x in lat)


def test_a_rank_binds_its_gpu_and_its_slice_caps_allocations() -> None:
    import gc

    from hpcsplit.core.cluster import GIB
    from hpcsplit.runtime.rank import bind_device

    gc.collect()
    torch.cuda.empty_cache()  # what earlier tests cached would count against the slice
    dev = bind_device(SimpleNamespace(device_kind="cuda"),
                      SimpleNamespace(role="component", gpu=0, slice_gb=0.25, component="c"), rank=1)
    try:
        assert dev == torch.device("cuda", 0) and torch.cuda.current_device() == 0
        assert not torch.backends.cudnn.allow_tf32
        torch.empty(GIB // 16, dtype=torch.uint8, device=dev)  # 64 MiB: inside the 0.25 GiB slice
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(GIB // 2, dtype=torch.uint8, device=dev)  # 512 MiB: outside it
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, dev)
        torch.cuda.empty_cache()
