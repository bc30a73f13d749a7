"""A served plan with two memory slices on one GPU, through the launcher (``cluster=auto``, local GPU
binding, real mpiexec): the outputs equal the whole model's, each component rank ran on cuda:0."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import compose_config
from tests.mpi.jobs import MPIEXEC

pytestmark = [pytest.mark.gpu, pytest.mark.mpi]


@pytest.fixture(scope="module")
def clip_sb(switchboards: Callable[..., Path]) -> Path:
    pytest.importorskip("transformers")
    return switchboards("clip_tiny")


def test_a_plan_with_two_slices_on_one_gpu_serves_the_whole_models_outputs(tmp_path: Path, clip_sb: Path) -> None:
    import h5py
    import torch

    from hpcsplit.core.plan import Plan, RankEntry
    from hpcsplit.launch.app import main
    from hpcsplit.switchboard.reader import Switchboard

    if MPIEXEC is None:
        pytest.skip("no mpiexec")
    sb = Switchboard.load(clip_sb)
    slices = (1.0, 2.0)  # GiB: two memory-fraction slices side by side on GPU 0
    ranks = [RankEntry(0, "frontend", 0, None, None, 1, None, 1, 0)]
    for i, c in enumerate(sb.order):
        ranks.append(RankEntry(len(ranks), "component", 0, 0, slices[i % 2], 1, c, 4, 0))
    plan = Plan(sb.model_name, sb.sha256, "cuda", 1, tuple(ranks), dict.fromkeys(sb.order, 1.0), {"n0/g0": 0.5})
    plan.save(tmp_path / "plan.json")
    n = 9
    xs = sb.example_inputs(n)
    with h5py.File(tmp_path / "in.h5", "w") as f:
        for spec, x in zip(sb.layout.inputs, xs, strict=True):
            f.create_dataset(spec.name, data=x.numpy())
    cfg = compose_config("stage=serve", f"plan={tmp_path / 'plan.json'}", f"switchboard={clip_sb}",
                         f"runtime.input_path={tmp_path / 'in.h5'}", f"runtime.output_path={tmp_path / 'out.h5'}",
                         "launcher.timeout_min=5", run_dir=tmp_path / "run")
    lines: list[str] = []
    main(cfg, tmp_path / "run", echo=lines.append)
    assert any("cluster=auto:" in x and "(cuda)" in x for x in lines), lines
    assert any("every rank sees GPU(s)" in x for x in lines) or any("MIG" in x for x in lines), lines
    log = (tmp_path / "run" / "serve.log").read_text()
    assert log.count("device cuda:0") >= len(sb.order), log[-3000:]
    with h5py.File(tmp_path / "out.h5", "r") as f:
        done, got = f["done"][()], f["output"][()]
    assert done.all()
    whole = sb.load_whole()
    with torch.no_grad():
        want = np.stack([whole(*(x[i:i + 1] for x in xs))[0].movedim(sb.layout.outputs[0].batch_dims[0], 0)[0].numpy()
                         for i in range(n)])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
