"""``cluster=auto`` with NVML stood in (this machine has no GPU): a fake ``pynvml`` module with the layouts
that matter (no GPU, no NVML, NVML that does not start, 4 x A100-40GB, 1 x H100 with MIG 1g.10gb x 7 or
mixed profiles), the cluster spec they give, and how ``launcher=local`` binds ranks to them (real mpiexec)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hpcsplit.core.cluster import ClusterSpec
from hpcsplit.core.detect import (
    RANK_DEVICES_VAR,
    Detection,
    bind_rank_devices,
    detect_gpus,
    rank_gpu_env,
    resolve_cluster,
)
from hpcsplit.core.paths import RunPaths
from hpcsplit.core.plan import Plan, RankEntry
from hpcsplit.core.settings import group_defaults
from hpcsplit.errors import LaunchError

REPO = Path(__file__).resolve().parents[2]
MIB = 2**20
CUDA_TORCH = "2.13.0+cu128"


class NVMLError(Exception):
    pass


class FakeNvml:
    """The part of pynvml that detection uses, over a list of GPUs ``(name, MiB, mig)``; ``mig`` is None
    (MIG off) or the instances' ``(profile, MiB)``."""

    NVML_DEVICE_MIG_ENABLE = 1
    NVMLError = NVMLError

    def __init__(self, gpus: list[tuple[str, int, list[tuple[str, int]] | None]], init_error: str = "") -> None:
        self.gpus = gpus
        self.init_error = init_error
        self.shut = False

    def nvmlInit(self) -> None:
        if self.init_error:
            raise NVMLError(self.init_error)

    def nvmlShutdown(self) -> None:
        self.shut = True

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> tuple[int, int | None]:
        return (i, None)

    def nvmlDeviceGetUUID(self, h: tuple[int, int | None]) -> str:
        return f"GPU-{h[0]:04d}" if h[1] is None else f"MIG-{h[0]:02d}{h[1]:02d}"

    def nvmlDeviceGetName(self, h: tuple[int, int | None]) -> bytes:
        name, _mib, mig = self.gpus[h[0]]
        return (name if h[1] is None else f"{name} MIG {mig[h[1]][0]}").encode()  # type: ignore[index]

    def nvmlDeviceGetMemoryInfo(self, h: tuple[int, int | None]) -> Any:
        _name, mib, mig = self.gpus[h[0]]
        total = mib if h[1] is None else mig[h[1]][1]  # type: ignore[index]
        return type("Mem", (), {"total": total * MIB})()

    def nvmlDeviceGetMigMode(self, h: tuple[int, int | None]) -> tuple[int, int]:
        on = int(self.gpus[h[0]][2] is not None)
        return on, on

    def nvmlDeviceGetMaxMigDeviceCount(self, h: tuple[int, int | None]) -> int:
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h: tuple[int, int | None], k: int) -> tuple[int, int]:
        mig = self.gpus[h[0]][2] or []
        if k >= len(mig):
            raise NVMLError("Not Found")
        return (h[0], k)


A100 = ("NVIDIA A100-SXM4-40GB", 40536, None)
H100 = "NVIDIA H100 80GB HBM3"
LAYOUTS: dict[str, list[tuple[str, int, list[tuple[str, int]] | None]]] = {
    "4xA100": [A100] * 4,
    "H100-mig-7x1g": [(H100, 81559, [("1g.10gb", 9984)] * 7)],
    "H100-mig-mixed": [(H100, 81559, [("3g.40gb", 40448), ("2g.20gb", 19968), ("1g.10gb", 9984)])],
}


def detected(layout: str, env: dict[str, str] | None = None) -> Detection:
    return detect_gpus(FakeNvml(LAYOUTS[layout]), env=env or {}, torch_version=CUDA_TORCH)


def auto_node(**given: Any) -> dict[str, Any]:
    return {**group_defaults("cluster", "auto"), **given}


LOCAL = group_defaults("cluster", "local")


# ----------------------------------------------------------------------------------- no GPU: cluster=local


@pytest.mark.parametrize(("case", "why"), [
    ("zero", "NVML found 0 GPUs"),
    ("missing", "NVML unavailable: cannot import pynvml"),
    ("init", "NVML did not start: NVMLError: Driver Not Loaded"),
    ("cpu-torch", "torch 2.13.0+cpu is a CPU-only build"),
    ("hidden", "CUDA_VISIBLE_DEVICES='' hides them all"),
])
def test_without_a_usable_gpu_auto_is_exactly_the_local_cpu_spec(
    case: str, why: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if case == "missing":
        monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
        det = detect_gpus(env={})
    else:
        nvml = FakeNvml([] if case == "zero" else LAYOUTS["4xA100"], init_error="Driver Not Loaded" * (case == "init"))
        det = detect_gpus(nvml, env={"CUDA_VISIBLE_DEVICES": ""} if case == "hidden" else {},
                          torch_version="2.13.0+cpu" if case == "cpu-torch" else CUDA_TORCH)
        assert nvml.shut or case == "init"
    lines: list[str] = []
    node = resolve_cluster(auto_node(), lines.append, det)
    assert node == LOCAL  # the same dict cluster=local composes: same spec, same name
    assert ClusterSpec.from_config(node) == ClusterSpec.from_config(LOCAL)
    assert len(lines) == 1 and lines[0].startswith("[hpcsplit] cluster=auto: no GPU (") and why in lines[0]
    assert lines[0].endswith("-> cluster 'local' (cpu)")


def test_auto_yaml_is_local_yaml_but_its_name() -> None:
    auto = group_defaults("cluster", "auto")
    assert auto["gpus_per_node"] is None  # null: detect
    assert {**auto, "name": "local", "gpus_per_node": 0} == LOCAL
    assert ClusterSpec.from_config(auto).device_kind == "cpu"  # read before detection: the CPU spec


def test_the_default_config_is_auto_and_resolves_to_local_here(compose: Callable[..., dict[str, Any]]) -> None:
    cfg = compose()
    assert cfg["cluster"]["name"] == "auto"
    # this machine: nvidia-ml-py is installed, but there is no driver (or a CPU torch): the CPU spec
    assert resolve_cluster(cfg["cluster"]) == compose("cluster=local")["cluster"]
    other = compose("cluster=dev")["cluster"]
    assert resolve_cluster(other) is other  # presets are left as they are


# --------------------------------------------------------------------------------------------- GPUs


def test_four_a100s_give_memory_fraction_slices() -> None:
    det = detected("4xA100")
    lines: list[str] = []
    spec = ClusterSpec.from_config(resolve_cluster(auto_node(), lines.append, det))
    assert (spec.name, spec.device_kind, spec.gpus_per_node, spec.gpu_name) == ("auto", "cuda", 4, A100[0])
    assert spec.gpu_mem_gb == 39.5  # 40536 MiB = 39.59 GiB, rounded down
    assert spec.slices_gb == (4.9, 9.8, 19.7, 39.5) and spec.mig_profiles == () and spec.slice_layouts is None
    assert "4 GPU(s) NVIDIA A100-SXM4-40GB, 39.5 GiB each; slices_gb [4.9, 9.8, 19.7, 39.5]" in lines[0]
    assert lines[0].endswith("-> cluster 'auto' (cuda)")


def test_h100_with_seven_1g10gb_instances() -> None:
    spec = ClusterSpec.from_config(resolve_cluster(auto_node(), None, detected("H100-mig-7x1g")))
    assert spec.gpus_per_node == 1 and spec.gpu_mem_gb == 79.6
    assert spec.slices_gb == (9.7,) and spec.mig_profiles == ("1g.10gb",)
    assert spec.slice_layouts == ((9.7,) * 7,)


def test_h100_with_mixed_mig_profiles() -> None:
    det = detected("H100-mig-mixed")
    spec = ClusterSpec.from_config(resolve_cluster(auto_node(), None, det))
    assert spec.slices_gb == (9.7, 19.5, 39.5) and spec.mig_profiles == ("1g.10gb", "2g.20gb", "3g.40gb")
    assert spec.slice_layouts == ((39.5, 19.5, 9.7),)
    assert "3 instance(s): 3g.40gb (39.5 GiB), 2g.20gb (19.5 GiB), 1g.10gb (9.7 GiB)" in det.describe()


def test_mixed_machines_say_what_they_leave_out() -> None:
    nvml = FakeNvml([A100, (H100, 81559, [("1g.10gb", 9984)]), ("NVIDIA A100-SXM4-80GB", 81920, None),
                     (H100, 81559, [])])
    det = detect_gpus(nvml, env={}, torch_version=CUDA_TORCH)
    assert [g.index for g in det.gpus] == [0, 2] and not det.mig
    text = det.describe()
    assert "GPU(s) [3] have MIG on but no instances" in text and "MIG GPU(s) [1] left out" in text
    assert "the spec takes the smallest memory" in text and det.cluster_fields()["gpu_mem_gb"] == 39.5


def test_cuda_visible_devices_narrows_what_is_found() -> None:
    det = detected("4xA100", env={"CUDA_VISIBLE_DEVICES": "1,GPU-0003"})
    assert [g.index for g in det.gpus] == [1, 3] and "CUDA_VISIBLE_DEVICES='1,GPU-0003' leaves 2 of 4" in det.describe()
    det = detected("H100-mig-7x1g", env={"CUDA_VISIBLE_DEVICES": "MIG-0002,MIG-0005"})
    assert [i.uuid for i in det.gpus[0].instances] == ["MIG-0002", "MIG-0005"]


def test_keys_given_on_the_command_line_are_kept() -> None:
    det = detected("4xA100")
    lines: list[str] = []
    node = resolve_cluster(auto_node(slices_gb=[10, 20]), lines.append, det)
    assert node["slices_gb"] == [10, 20] and node["gpus_per_node"] == 4
    assert "kept from the command line: cluster.slices_gb" in lines[0]
    assert resolve_cluster(auto_node(gpus_per_node=0), None, det) == LOCAL  # CPU on a GPU machine


# ----------------------------------------------------------------------------------- rank -> GPU binding


def _mig_plan(slices: list[float], gpu: int = 0) -> Plan:
    ranks = [RankEntry(0, "frontend", 0, None, None, 1, None, 1, 0)]
    ranks += [RankEntry(i + 1, "component", 0, gpu, s, 1, f"c{i}", 1, 0) for i, s in enumerate(slices)]
    return Plan("m", None, "cuda", 1, ranks, {f"c{i}": 1.0 for i in range(len(slices))},
                {"n0/g0": 0.5})


def test_whole_gpus_are_all_visible_to_every_rank_in_pci_order() -> None:
    env, lines = rank_gpu_env(detected("4xA100"), 5)
    assert env == {"CUDA_VISIBLE_DEVICES": "GPU-0000,GPU-0001,GPU-0002,GPU-0003", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert len(lines) == 1 and "every rank sees GPU(s) 0 NVIDIA A100" in lines[0]
    assert rank_gpu_env(Detection(why="none"), 3) == ({}, [])


def test_mig_ranks_get_the_instance_of_their_slice() -> None:
    det = detected("H100-mig-mixed")
    env, lines = rank_gpu_env(det, 4, _mig_plan([9.7, 39.5, 19.5]).ranks)
    per_rank = json.loads(env[RANK_DEVICES_VAR])
    assert per_rank[1:] == ["MIG-0002", "MIG-0000", "MIG-0001"]  # 1g, 3g, 2g as the plan's slices say
    assert per_rank[0] == "MIG-0000"  # the frontend: an instance in turn, largest first
    assert "rank 2 (c1) -> GPU 0 MIG 3g.40gb MIG-0000" in lines
    with pytest.raises(LaunchError, match=r"needs a 9.7 GiB MIG instance on GPU 0, but none is free"):
        rank_gpu_env(det, 3, _mig_plan([9.7, 9.7]).ranks)
    with pytest.raises(LaunchError, match="gpu 1 is not one of this machine's 1 MIG GPU"):
        rank_gpu_env(det, 2, _mig_plan([9.7], gpu=1).ranks)
    env, _ = rank_gpu_env(detected("H100-mig-7x1g"), 3)  # profile workers: one instance each
    assert len(set(json.loads(env[RANK_DEVICES_VAR]))) == 3


def test_a_rank_sets_its_own_cuda_visible_devices() -> None:
    env = {RANK_DEVICES_VAR: json.dumps(["MIG-a", "MIG-b"])}
    assert bind_rank_devices(1, env) == "MIG-b" and env["CUDA_VISIBLE_DEVICES"] == "MIG-b"
    assert bind_rank_devices(0, {}) is None
    with pytest.raises(LaunchError, match="has no entry for rank 2"):
        bind_rank_devices(2, dict(env))


_ENTRY = """
import os
def main(cfg, run_dir, comm):
    return comm.gather([os.environ.get("CUDA_VISIBLE_DEVICES"), os.environ.get("CUDA_DEVICE_ORDER")])
"""


@pytest.mark.mpi
@pytest.mark.parametrize("layout", ["4xA100", "H100-mig-mixed"])
def test_launcher_local_binds_real_ranks_as_slurm_would(
    layout: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hpcsplit.launch import local
    from hpcsplit.launch.stages import launcher_settings

    (tmp_path / "devices_entry.py").write_text(_ENTRY)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    for var in ("SLURM_JOB_ID", "CUDA_VISIBLE_DEVICES", RANK_DEVICES_VAR):
        monkeypatch.delenv(var, raising=False)
    det = detected(layout)
    monkeypatch.setattr(local, "detect_gpus", lambda env=None: det)  # NVML stood in; mpiexec and ranks real
    cfg = {"launcher": {"name": "local", "timeout_min": 2},
           "cluster": resolve_cluster(auto_node(), None, det)}
    paths = RunPaths.from_config(cfg, tmp_path / "run")
    paths.run_dir.mkdir(parents=True)
    if det.mig:
        _mig_plan([19.5, 9.7]).save(paths.plan)
    lines: list[str] = []
    got = local.run_mpi_local("devices_entry:main", cfg, paths, "serve" if det.mig else "profile", 3,
                              launcher_settings(cfg), echo=lines.append)
    if det.mig:
        assert [g[0] for g in got] == ["MIG-0000", "MIG-0001", "MIG-0002"]
        assert "[hpcsplit] serve: rank 1 (c0) -> GPU 0 MIG 2g.20gb MIG-0001" in lines
    else:
        assert got == [["GPU-0000,GPU-0001,GPU-0002,GPU-0003", "PCI_BUS_ID"]] * 3


# ---------------------------------------------------------------------------------------------- CLI

def test_the_cli_prints_what_it_detected(tmp_path: Path) -> None:
    """The default cluster on this machine (no NVIDIA driver): the CPU, and why, before anything else."""
    res = subprocess.run([sys.executable, "-m", "hpcsplit", "stage=nope", f"hydra.run.dir={tmp_path / 'run'}"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 1 and "stage = 'nope'" in res.stderr  # validation runs after the detection line
    assert "[hpcsplit] cluster=auto: no GPU (" in res.stdout and "-> cluster 'local' (cpu)" in res.stdout


# ------------------------------------------------------------------------------------ scripts/gpu-check.sh


@pytest.mark.parametrize("smi", [None, "failing"])
def test_gpu_check_on_a_cpu_machine_says_so_and_runs_nothing(smi: str | None, tmp_path: Path) -> None:
    """Run from a copy of the script (its folder's parent is its repository): nothing may appear there."""
    (tmp_path / "scripts").mkdir()
    script = tmp_path / "scripts" / "gpu-check.sh"
    script.write_text((REPO / "scripts" / "gpu-check.sh").read_text())
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "dirname", "date", "timeout", "grep", "mkdir"):  # what a bare machine has
        (bin_dir / tool).symlink_to(shutil.which(tool) or f"/bin/{tool}")
    if smi:  # the driver is not loaded: nvidia-smi is there but fails
        (bin_dir / "nvidia-smi").write_text('#!/bin/sh\necho "NVIDIA-SMI has failed because it couldn\'t '
                                            'communicate with the NVIDIA driver."\nexit 9\n')
        (bin_dir / "nvidia-smi").chmod(0o755)
    res = subprocess.run(["bash", str(script)], env={"PATH": str(bin_dir), "HOME": str(tmp_path)},
                         capture_output=True, text=True, timeout=60, check=False)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.startswith("gpu-check: no NVIDIA GPU here (") and "nothing was run" in res.stdout
    assert ("couldn't communicate" in res.stdout) if smi else ("no nvidia-smi on PATH" in res.stdout)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bin", "scripts"]  # no .venv, no outputs/


@pytest.mark.parametrize("layout", ["H100-mig-mixed", "H100-mig-7x1g"])
def test_a_plan_allocated_for_the_detected_mig_instances_binds_every_rank(layout: str) -> None:
    """The allocator on the spec cluster=auto gives, and the launcher's binding of the plan it makes."""
    from hpcsplit.allocation.solve import allocate
    from hpcsplit.allocation.synthetic import synthetic_profile

    det = detected(layout)
    spec = ClusterSpec.from_config(resolve_cluster(auto_node(cores_per_node=16), None, det))
    plan = allocate(synthetic_profile(3, slices=spec.slices_gb, seed=1), spec, time_limit_s=60).to_plan()
    comps = [r for r in plan.ranks if r.role == "component"]
    assert plan.device_kind == "cuda" and comps
    env, _lines = rank_gpu_env(det, plan.world_size, plan.ranks)
    per_rank = json.loads(env[RANK_DEVICES_VAR])
    size = {i.uuid: i.mem_gb for i in det.gpus[0].instances}
    assert len({per_rank[r.rank] for r in comps}) == len(comps)  # one instance per component rank
    assert all(size[per_rank[r.rank]] == r.slice_gb for r in comps)
