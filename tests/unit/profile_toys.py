"""Small stand-ins for a Switchboard (same duck type) used by the profile tests.

Importable from subprocesses started in the repository root (``tests.unit.profile_toys``).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class ToySpec:
    name: str
    inputs: list[dict[str, Any]]
    outputs: list[dict[str, Any]]
    param_bytes: int


class _Sleepy(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module, sleep_s: float) -> None:
        super().__init__()
        self.inner, self.sleep_s = inner, sleep_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sleep_s:
            time.sleep(self.sleep_s)
        return self.inner(x)


class ToySwitchboard:
    """Two components ``enc`` (Linear+ReLU) -> ``head`` (Linear), optionally slow.

    ``oom_above``: the head raises an out-of-memory error for batch sizes above it.
    """

    def __init__(self, width: int = 32, sleep_s: float = 0.0, oom_above: int | None = None) -> None:
        torch.manual_seed(0)
        self.width, self.oom_above = width, oom_above
        self.mods = {
            "enc": _Sleepy(torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU()), sleep_s),
            "head": _Sleepy(torch.nn.Linear(width, 4), sleep_s),
        }
        outs = {"enc": width, "head": 4}
        self.components = {
            n: ToySpec(
                n,
                [{"name": "x", "dtype": "float32", "bytes_per_sample": width * 4}],
                [{"name": "y", "dtype": "float32", "bytes_per_sample": outs[n] * 4}],
                sum(p.numel() * p.element_size() for p in m.parameters()),
            )
            for n, m in self.mods.items()
        }
        self.order = list(self.components)
        self.sha256 = "0" * 63 + "1"
        self.model_name = "toy"

    def load_component(self, name: str) -> Any:
        m = self.mods[name]

        def run(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
            if name == "head" and self.oom_above is not None and xs[0].shape[0] > self.oom_above:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated by the toy switchboard)")
            return (m(*xs),)

        return run

    def component_example_inputs(self, batch_size: int) -> dict[str, tuple[torch.Tensor, ...]]:
        g = torch.Generator().manual_seed(batch_size)
        x = torch.randn(batch_size, self.width, generator=g)
        enc = self.mods["enc"].inner
        with torch.no_grad():  # the profiler may have moved enc to the GPU; activations stay on the CPU
            h = enc(x.to(next(enc.parameters()).device)).cpu()
        return {"enc": (x,), "head": (h,)}


def main(argv: list[str]) -> int:
    """``python -m tests.unit.profile_toys OUT SLEEP_S``: profile the toy (used to kill it mid-run)."""
    from hpcsplit.profiling.runner import profile_components

    out, sleep_s = Path(argv[0]), float(argv[1])
    summary = profile_components(
        ToySwitchboard(sleep_s=sleep_s), batch_sizes=[1, 2, 4, 8], slices=[1, 2], warmup=1, iters=3, out=out
    )
    print("SUMMARY", summary, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))


def mpi_main(cfg: dict[str, Any], run_dir: str, comm: Any | None = None) -> dict[str, Any] | None:
    """Like :func:`hpcsplit.profiling.stage.mpi_main`, on the toy switchboard (``cfg["toy"]`` options).

    ``cfg["toy"]["fail_on"]``: a component name whose every run raises a (non-OOM) error.
    """
    from hpcsplit.core.mpi import get_comm
    from hpcsplit.core.paths import RunPaths
    from hpcsplit.profiling.runner import profile_components_mpi
    from hpcsplit.profiling.stage import ProfileSettings

    toy = dict(cfg.get("toy") or {})
    sb = ToySwitchboard(sleep_s=float(toy.get("sleep_s", 0.0)), oom_above=toy.get("oom_above"))
    if toy.get("fail_on"):
        bad = str(toy["fail_on"])

        def broken(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
            raise RuntimeError(f"component {bad} is broken (toy)")

        orig = sb.load_component
        sb.load_component = lambda name: broken if name == bad else orig(name)  # type: ignore[method-assign]
    s = ProfileSettings.from_config(cfg)
    return profile_components_mpi(sb, s, RunPaths.from_config(cfg, run_dir).profile, comm=get_comm(comm),
                                  rank_silence_s=s.rank_silence_s)
