"""``cluster=auto``: this machine's GPUs from NVML, and the cluster spec and rank binding they give.

[Note: cluster auto]
``conf/cluster/auto.yaml`` is ``conf/cluster/local.yaml`` (the CPU spec) named ``auto``.  Before any
work (:func:`hpcsplit.launch.app.main`) :func:`resolve_cluster` asks NVML (the ``pynvml`` module of
nvidia-ml-py) what GPUs this machine has and prints what it found and why:

* no ``pynvml``, NVML that does not start (no driver), no GPU, ``CUDA_VISIBLE_DEVICES`` hiding them,
  or a CPU-only torch build (``torch 2.13.0+cpu``, read from its package metadata: the login side
  does not import torch): the cluster is exactly ``cluster=local`` (name ``local``), as before;
* whole GPUs (MIG off): ``gpus_per_node`` = their count, ``gpu_name``, ``gpu_mem_gb`` (the smallest
  GPU's memory in GiB, rounded down to 0.1), ``slices_gb`` = 1/8, 1/4, 1/2 and all of it (memory
  fractions per process, ``[Note: device timing]``), ``mig_profiles`` empty, ``slice_layouts`` null;
* MIG GPUs: ``slices_gb`` = the sizes (GiB) of the MIG instances that exist, ``mig_profiles`` their
  profile names (``1g.10gb``, one per size, same order), ``slice_layouts`` the layouts the GPUs have
  now (so a plan places no more instances of a size on a GPU than it has);
* GPUs of different models: the smallest memory, named in the message; MIG and whole GPUs mixed:
  the whole GPUs only (a plan's slices on one GPU are all memory fractions or all MIG instances).

A key given on the command line (``cluster.slices_gb=[10,20]``) keeps its value: only keys still at
``auto.yaml``'s value are filled in; ``cluster.gpus_per_node=N`` (``auto.yaml`` has null: detect) takes
the spec as written, and ``0`` is the CPU on a GPU machine.  GB = GiB.

[Note: local GPU binding]
``launcher=local`` outside SLURM binds ranks to GPUs as SLURM's ``--gpus-per-node`` does
(:func:`rank_gpu_env`): every rank sees the detected GPUs in NVML (PCI bus) order,
``CUDA_VISIBLE_DEVICES=GPU-<uuid>,...`` and ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, so a plan's ``gpu``
index is the torch device index.  A MIG instance can only be reached by naming it alone, so with MIG
each rank gets its own instance: a component rank the instance of its plan entry's GPU and slice size
(each instance once), other ranks (profile workers, the frontend) the instances in turn, largest
first; ``HPCSPLIT_RANK_CUDA_DEVICES`` (a JSON list, one entry per rank) carries them and
:func:`bind_rank_devices` sets the rank's ``CUDA_VISIBLE_DEVICES`` before torch is imported.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from hpcsplit.core.cluster import GIB
from hpcsplit.core.settings import group_defaults
from hpcsplit.errors import LaunchError

__all__ = [
    "AUTO",
    "RANK_DEVICES_VAR",
    "Detection",
    "GpuInfo",
    "MigInstance",
    "bind_rank_devices",
    "detect_gpus",
    "rank_gpu_env",
    "resolve_cluster",
    "torch_build",
]

AUTO = "auto"
RANK_DEVICES_VAR = "HPCSPLIT_RANK_CUDA_DEVICES"
_FRACTIONS = (1 / 8, 1 / 4, 1 / 2, 1.0)
_MIN_SLICE_GB = 1.0
_PROFILE = re.compile(r"(\d+g\.\d+gb(?:\+me)?)", re.IGNORECASE)
# the keys detection fills in (the rest of the cluster node is auto.yaml's, i.e. local.yaml's)
_GPU_KEYS = ("gpus_per_node", "gpu_name", "gpu_mem_gb", "slices_gb", "mig_profiles", "slice_layouts")


@dataclass(frozen=True, slots=True)
class MigInstance:
    """One MIG instance: its ``MIG-`` UUID, profile (``1g.10gb``) and memory (GiB)."""

    uuid: str
    profile: str
    mem_gb: float


@dataclass(frozen=True, slots=True)
class GpuInfo:
    """One GPU as NVML sees it (``index``: NVML's, i.e. PCI bus order)."""

    index: int
    uuid: str
    name: str
    mem_gb: float
    mig: bool = False
    instances: tuple[MigInstance, ...] = ()


@dataclass(frozen=True, slots=True)
class Detection:
    """What NVML found: the GPUs hpcsplit uses, and why (or why none)."""

    gpus: tuple[GpuInfo, ...] = ()
    why: str = ""
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def mig(self) -> bool:
        return bool(self.gpus) and self.gpus[0].mig

    def cluster_fields(self) -> dict[str, Any]:
        """The cluster keys this machine's GPUs give (empty without GPUs)."""
        if not self.gpus:
            return {}
        mem = min(g.mem_gb for g in self.gpus)
        fields: dict[str, Any] = {
            "gpus_per_node": len(self.gpus),
            "gpu_name": self.gpus[0].name,
            "gpu_mem_gb": mem,
            "mig_profiles": [],
            "slice_layouts": None,
        }
        if self.mig:
            sizes: dict[float, str] = {}
            for g in self.gpus:
                for inst in g.instances:
                    sizes.setdefault(inst.mem_gb, inst.profile)
            order = sorted(sizes)
            fields["slices_gb"] = order
            fields["mig_profiles"] = [sizes[s] for s in order]
            layouts = {tuple(sorted((i.mem_gb for i in g.instances), reverse=True)) for g in self.gpus}
            fields["slice_layouts"] = [list(lay) for lay in sorted(layouts, reverse=True)]
        else:
            fields["slices_gb"] = sorted({s for s in (_round_down(mem * f) for f in _FRACTIONS)
                                          if s >= min(_MIN_SLICE_GB, mem)})
        return fields

    def describe(self) -> str:
        """One paragraph: what was found, what hpcsplit uses, and why."""
        if not self.gpus:
            return f"no GPU ({self.why}): CPU, as cluster=local"
        names = sorted({g.name for g in self.gpus})
        f = self.cluster_fields()
        if self.mig:
            inst = [f"{i.profile} ({i.mem_gb:g} GiB)" for g in self.gpus for i in g.instances]
            head = (f"{len(self.gpus)} MIG GPU(s) {', '.join(names)} with {len(inst)} instance(s): "
                    f"{', '.join(inst)}; slices_gb {f['slices_gb']} = the MIG instances "
                    f"(profiles {f['mig_profiles']}, layouts {f['slice_layouts']})")
        else:
            head = (f"{len(self.gpus)} GPU(s) {', '.join(names)}, {f['gpu_mem_gb']:g} GiB each; "
                    f"slices_gb {f['slices_gb']} (1/8 .. all of the memory, a per-process memory fraction)")
        return head + (f" ({self.why})" if self.why else "") + "".join(f"; {n}" for n in self.notes)

    def to_dict(self) -> dict[str, Any]:
        return {
            "why": self.why,
            "notes": list(self.notes),
            "gpus": [{"index": g.index, "uuid": g.uuid, "name": g.name, "mem_gb": g.mem_gb, "mig": g.mig,
                      "instances": [{"uuid": i.uuid, "profile": i.profile, "mem_gb": i.mem_gb}
                                    for i in g.instances]} for g in self.gpus],
            "cluster": self.cluster_fields(),
        }


def _round_down(gb: float) -> float:
    return math.floor(gb * 10 + 1e-6) / 10


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def torch_build() -> str:
    """The installed torch's version from its package metadata (``2.13.0+cpu``), without importing it."""
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return ""


def _visible_filter(env: Mapping[str, str]) -> tuple[set[str] | None, str]:
    """The entries of ``CUDA_VISIBLE_DEVICES`` (None when unset)."""
    raw = env.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return None, ""
    items = {x.strip() for x in raw.split(",") if x.strip()}
    return items, raw


def detect_gpus(nvml: Any = None, env: Mapping[str, str] | None = None,
                torch_version: str | None = None) -> Detection:
    """This machine's GPUs from NVML (``nvml``: the ``pynvml`` module, or a stand-in for tests).

    Never raises: every failure becomes a :class:`Detection` without GPUs that says why
    (``[Note: cluster auto]``).
    """
    env = os.environ if env is None else env
    if nvml is None:
        try:
            import pynvml  # nvidia-ml-py
        except ImportError as e:
            return Detection(why=f"NVML unavailable: cannot import pynvml ({e}); pip install nvidia-ml-py")
        nvml = pynvml
    try:
        nvml.nvmlInit()
    except Exception as e:  # noqa: BLE001 - no driver / no libnvidia-ml: CPU
        return Detection(why=f"NVML did not start: {type(e).__name__}: {e} (no NVIDIA driver here)")
    try:
        return _query(nvml, env, torch_build() if torch_version is None else torch_version)
    except Exception as e:  # noqa: BLE001 - a driver that answers oddly: CPU, and say so
        return Detection(why=f"NVML query failed: {type(e).__name__}: {e}")
    finally:
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()


def _query(nvml: Any, env: Mapping[str, str], torch_version: str) -> Detection:
    count = int(nvml.nvmlDeviceGetCount())
    if count == 0:
        return Detection(why="NVML found 0 GPUs")
    visible, raw = _visible_filter(env)
    found: list[GpuInfo] = []
    for i in range(count):
        h = nvml.nvmlDeviceGetHandleByIndex(i)
        uuid = _text(nvml.nvmlDeviceGetUUID(h))
        name = _text(nvml.nvmlDeviceGetName(h))
        mem = _round_down(int(nvml.nvmlDeviceGetMemoryInfo(h).total) / GIB)
        mig = False
        try:
            current, _pending = nvml.nvmlDeviceGetMigMode(h)
            mig = current == getattr(nvml, "NVML_DEVICE_MIG_ENABLE", 1)
        except Exception:  # noqa: BLE001 - not MIG-capable
            mig = False
        instances: list[MigInstance] = []
        if mig:
            for k in range(int(nvml.nvmlDeviceGetMaxMigDeviceCount(h))):
                try:
                    m = nvml.nvmlDeviceGetMigDeviceHandleByIndex(h, k)
                except Exception:  # noqa: BLE001, S112 - an empty slot
                    continue
                m_uuid = _text(nvml.nvmlDeviceGetUUID(m))
                m_mem = _round_down(int(nvml.nvmlDeviceGetMemoryInfo(m).total) / GIB)
                hit = _PROFILE.search(_text(nvml.nvmlDeviceGetName(m)))
                profile = hit.group(1).lower() if hit else f"{m_mem:g}gb"
                if visible is None or m_uuid in visible or uuid in visible or str(i) in visible:
                    instances.append(MigInstance(m_uuid, profile, m_mem))
            instances.sort(key=lambda x: (-x.mem_gb, x.uuid))
        if visible is not None and not mig and not (str(i) in visible or uuid in visible):
            continue
        if visible is not None and mig and not instances:
            continue
        found.append(GpuInfo(i, uuid, name, mem, mig, tuple(instances)))
    notes: list[str] = []
    if visible is not None:
        notes.append(f"CUDA_VISIBLE_DEVICES={raw!r} leaves {len(found)} of {count}")
    if not found:
        return Detection(why=f"NVML found {count} GPU(s), but CUDA_VISIBLE_DEVICES={raw!r} hides them all")
    empty = [g.index for g in found if g.mig and not g.instances]
    if empty:
        notes.append(f"GPU(s) {empty} have MIG on but no instances (create them with nvidia-smi mig -cgi ...): "
                     "left out")
        found = [g for g in found if not (g.mig and not g.instances)]
    kinds = {g.mig for g in found}
    if len(kinds) > 1:
        mig_ids = [g.index for g in found if g.mig]
        notes.append(f"MIG GPU(s) {mig_ids} left out: the whole GPUs are used (one slice kind per node)")
        found = [g for g in found if not g.mig]
    if not found:
        return Detection(why=f"NVML found {count} GPU(s) but none usable", notes=tuple(notes))
    if len({(g.name, g.mem_gb) for g in found}) > 1:
        notes.append(f"GPUs differ ({', '.join(sorted({f'{g.name} {g.mem_gb:g} GiB' for g in found}))}): "
                     "the spec takes the smallest memory")
    if torch_version.endswith("+cpu"):
        return Detection(
            why=(f"NVML found {len(found)} GPU(s) ({found[0].name}) but torch {torch_version} is a CPU-only build: "
                 "install the CUDA wheel (HPCSPLIT_TORCH_INDEX=https://download.pytorch.org/whl/cu128 "
                 "scripts/gpu-check.sh, or pip install torch==<version> --index-url ...)"),
            notes=tuple(notes),
        )
    return Detection(gpus=tuple(found), why="NVML", notes=tuple(notes))


def resolve_cluster(node: Any, echo: Callable[[str], None] | None = None,
                    detection: Detection | None = None) -> Any:
    """The cluster node with ``cluster=auto`` filled in from this machine (``[Note: cluster auto]``).

    Any other node is returned as it is.  Keys whose value differs from ``conf/cluster/auto.yaml``'s
    (given on the command line) are kept.
    """
    if not isinstance(node, Mapping) or node.get("name") != AUTO:
        return node
    base = group_defaults("cluster", AUTO)
    given = {k for k in node if k != "name" and (k not in base or node[k] != base[k])}
    det = detect_gpus() if detection is None else detection
    fields = det.cluster_fields()
    if "gpus_per_node" in given:
        fields = {}  # the user said how many GPUs (0: CPU): take their spec as written
    out = dict(node)
    out.update({k: v for k, v in fields.items() if k not in given})
    if out.get("gpus_per_node") is None:
        out["gpus_per_node"] = 0
    out["name"] = AUTO if int(out.get("gpus_per_node") or 0) > 0 else "local"
    if echo is not None:
        kept = sorted(given & set(_GPU_KEYS))
        echo(f"[hpcsplit] cluster=auto: {det.describe()}"
             + (f"; kept from the command line: {', '.join(f'cluster.{k}' for k in kept)}" if kept else "")
             + f" -> cluster {out['name']!r} ({'cuda' if out['name'] == AUTO else 'cpu'})")
    return out


# ---------------------------------------------------------------------------------- rank -> GPU binding


def rank_gpu_env(det: Detection, ranks: int, entries: Sequence[Any] | None = None) -> tuple[dict[str, str], list[str]]:
    """The environment that binds ``ranks`` local ranks to the detected GPUs (``[Note: local GPU binding]``).

    Parameters
    ----------
    det : Detection
    ranks : int
        World size.
    entries : sequence, optional
        The plan's rank entries (``role``, ``gpu``, ``slice_gb``) for a plan's job; None for other jobs.

    Returns
    -------
    (env, lines)
        Variables to add to the ranks' environment, and one line per binding for the log.

    Raises
    ------
    LaunchError
        When a plan entry names a GPU or a MIG slice this machine does not have (free).
    """
    if not det.gpus:
        return {}, []
    if not det.mig:
        visible = ",".join(g.uuid for g in det.gpus)
        seen = ", ".join(f"{g.index} {g.name}" for g in det.gpus)
        line = f"every rank sees GPU(s) {seen} (CUDA_VISIBLE_DEVICES={visible})"
        return {"CUDA_VISIBLE_DEVICES": visible, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}, [line]
    pool = [(g.index, pos, inst) for pos, g in enumerate(det.gpus) for inst in g.instances]
    taken: set[str] = set()
    chosen: list[str | None] = [None] * ranks
    lines: list[str] = []
    for e in entries or ():
        if getattr(e, "role", None) != "component" or e.rank >= ranks:
            continue
        if e.gpu is None or not 0 <= e.gpu < len(det.gpus):
            raise LaunchError(f"plan rank {e.rank}: gpu {e.gpu} is not one of this machine's "
                              f"{len(det.gpus)} MIG GPU(s); allocate with cluster=auto here")
        fits = [i for g, pos, i in pool if pos == e.gpu and i.uuid not in taken and e.slice_gb is not None
                and abs(i.mem_gb - float(e.slice_gb)) < 1e-6]
        if not fits:
            raise LaunchError(
                f"plan rank {e.rank} (component {e.component}) needs a {e.slice_gb} GiB MIG instance on GPU {e.gpu}, "
                f"but none is free there (instances: "
                f"{[f'{i.profile} {i.mem_gb:g}' for _g, p, i in pool if p == e.gpu]}); re-allocate with cluster=auto")
        taken.add(fits[0].uuid)
        chosen[e.rank] = fits[0].uuid
        lines.append(f"rank {e.rank} ({e.component}) -> GPU {det.gpus[e.gpu].index} MIG {fits[0].profile} "
                     f"{fits[0].uuid}")
    order = sorted(pool, key=lambda x: (-x[2].mem_gb, x[0], x[2].uuid))
    k = 0
    for r in range(ranks):
        if chosen[r] is None:
            inst = order[k % len(order)][2]
            k += 1
            chosen[r] = inst.uuid
            lines.append(f"rank {r} -> MIG {inst.profile} {inst.uuid}")
    return {RANK_DEVICES_VAR: json.dumps(chosen)}, lines


def bind_rank_devices(rank: int, env: Any = None) -> str | None:
    """Set this rank's ``CUDA_VISIBLE_DEVICES`` from ``HPCSPLIT_RANK_CUDA_DEVICES`` (before torch is imported).

    Returns the value set, or None when the variable is not there.
    """
    env = os.environ if env is None else env
    raw = env.get(RANK_DEVICES_VAR)
    if not raw:
        return None
    try:
        devices = json.loads(raw)
        value = str(devices[rank])
    except (ValueError, IndexError, TypeError, KeyError):
        raise LaunchError(f"{RANK_DEVICES_VAR}={raw!r} has no entry for rank {rank}: a launcher bug, "
                          "or the variable leaked from another job (unset it)") from None
    env["CUDA_VISIBLE_DEVICES"] = value
    return value


def main() -> int:
    """``python -m hpcsplit.core.detect``: what ``cluster=auto`` finds here, as JSON and one line."""
    det = detect_gpus()
    print(json.dumps(det.to_dict(), indent=2))
    print(f"cluster=auto: {det.describe()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
