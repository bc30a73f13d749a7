"""Profiling on a GPU with memory slices: cells that do not fit their slice are marked out-of-memory, the
run goes on and completes; utilization comes from NVML."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.unit.profile_toys import ToySwitchboard

pytestmark = pytest.mark.gpu


def test_cells_that_do_not_fit_a_slice_are_marked_not_crashes(tmp_path: Path) -> None:
    import torch

    from hpcsplit.core.profile_format import read_profile
    from hpcsplit.profiling.runner import profile_components

    sb = ToySwitchboard(width=4096)  # enc: 64 MiB of weights, more than the 0.05 GiB slice holds
    out = tmp_path / "p.h5"
    try:
        summary = profile_components(sb, out=out, batch_sizes=[1, 64], slices=[0.05, 2.0], warmup=1, iters=3,
                                     util_window_ms=200, util_sample_ms=10, progress=False)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)  # the last slice's cap stays on the process
    assert summary["complete"]
    prof = read_profile(out)
    enc, head = prof.components["enc"], prof.components["head"]
    assert enc.oom[:, 0].all() and not enc.oom[:, 1].any()  # too big for 0.05 GiB, fits 2 GiB
    assert np.isfinite(enc.latency_ms[:, 1]).all()
    assert not head.oom.any() and np.isfinite(head.latency_ms).all()
    assert prof.meta.device_kind == "cuda" and prof.meta.slice_unit == "gb"
    util = enc.utilization[:, 1]
    assert np.isfinite(util).all() and ((util >= 0) & (util <= 1)).all(), util  # NVML read back
    assert torch.cuda.memory_allocated() < 2**26  # the components' copies were given back
