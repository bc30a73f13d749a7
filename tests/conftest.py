"""Shared pytest setup (keep it small).

Tests run as ``.venv/bin/python -m pytest`` without an activated venv: put this Python's bin folder
(``mpiexec`` from the mpich wheel) first on PATH so that MPI tests find it and subprocesses match.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from hpcsplit.core.settings import conf_dir

_BIN = str(Path(sys.executable).parent)
if _BIN not in os.environ.get("PATH", "").split(os.pathsep):
    os.environ["PATH"] = _BIN + os.pathsep + os.environ.get("PATH", "")


def compose_config(*overrides: str, run_dir: str | Path = "run") -> dict[str, Any]:
    """The resolved config as ``python -m hpcsplit OVERRIDES`` sees it, composed by Hydra from ``conf/``
    (never read file by file); ``paths.run_dir`` (Hydra's output dir outside an app) is ``run_dir``."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
            cfg = hydra_compose("config", overrides=list(overrides))
    finally:
        GlobalHydra.instance().clear()
    cfg.paths.run_dir = str(run_dir)
    plain = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(plain, dict)
    return plain  # type: ignore[return-value]


@pytest.fixture
def compose(tmp_path: Path) -> Callable[..., dict[str, Any]]:
    """``compose("+experiment=toy", "cluster=dev")``: :func:`compose_config` with the run folder in tmp_path."""
    return lambda *overrides: compose_config(*overrides, run_dir=tmp_path / "run")


# [Note: test switchboards] One builder for every test that needs a real switchboard: the toy MLP
# (conf/model/toy_mlp.yaml's sizes unless ``dims`` are given) or tiny CLIP, example batch 2, seed 0.
# Exports use the deterministic FLOP cost unless a test asks for another: the measured cost makes the
# split depend on the machine's load (issue 17), and a test must not. They force the split (tiny models).
def export_switchboard(out: Path, model: str = "toy_mlp", *, dims: tuple[int, int, int] | None = None,
                       **options: Any) -> Path:
    """Export ``toy_mlp`` or ``clip_tiny`` into ``out`` (``options`` go to :func:`hpcsplit.export`)."""
    from hpcsplit.switchboard.models import build_clip, build_toy, example_inputs
    from hpcsplit.switchboard.writer import export

    if model == "toy_mlp":
        m = build_toy(*dims) if dims else build_toy()
    elif model == "clip_tiny":
        m = build_clip("tiny")
    else:  # pragma: no cover - a test's typo
        raise ValueError(f"no test switchboard for model {model!r}")
    options.setdefault("cost", "flops")
    # the toy and tiny CLIP do not pay for their split (issue 17: export keeps them whole); the tests
    # need their components, so they force it
    options.setdefault("force", True)
    export(m, example_inputs(model, 2, model=m), out=out, name=model, **options)
    return out


@pytest.fixture(scope="session")
def switchboards(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``switchboards("toy_mlp", stages=2)`` -> the path of that export, made once per test session."""
    made: dict[str, Path] = {}

    def get(model: str = "toy_mlp", **options: Any) -> Path:
        key = repr((model, sorted(options.items())))
        if key not in made:
            made[key] = export_switchboard(tmp_path_factory.mktemp(model) / "switchboard", model, **options)
        return made[key]

    return get


@pytest.fixture()
def burner() -> Iterator[None]:
    """Two processes (one per core, at least two) spinning for the duration of the test: the export's
    timing pass then measures other latencies than on a quiet machine."""
    spin = "import time\nend = time.time() + 600\nwhile time.time() < end:\n    pass\n"
    procs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(max(2, os.cpu_count() or 2))]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait(timeout=30)
