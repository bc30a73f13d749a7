"""tests/gpu: the GPU-only paths on a real CUDA device (``scripts/gpu-check.sh`` runs them with ``pytest -m gpu``).

Every test here is ``gpu``-marked and skipped, with the reason, where torch sees no CUDA device (this is
checked once, at collection; the marker alone does not skip).
"""

from __future__ import annotations

import pytest


def _cuda() -> tuple[bool, str]:
    try:
        import torch
    except ImportError as e:  # pragma: no cover
        return False, f"no torch ({e})"
    if not torch.cuda.is_available():
        build = "CPU-only torch build" if not torch.version.cuda else f"torch CUDA {torch.version.cuda}"
        return False, f"needs a CUDA GPU (torch {torch.__version__}: {build}, no device)"
    return True, ""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    ok, why = _cuda()
    here = str(config.rootpath / "tests" / "gpu")
    for item in items:
        if str(item.path).startswith(here):
            item.add_marker(pytest.mark.gpu)
            if not ok:
                item.add_marker(pytest.mark.skip(reason=why))
