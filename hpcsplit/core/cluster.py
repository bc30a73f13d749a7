"""Cluster descriptions (``conf/cluster/<name>.yaml``) as a validated frozen dataclass.

[Note: cluster contract]
Keys: ``name``, ``scheduler`` (local | slurm), ``nodes``, ``gpus_per_node``, ``gpu_name``,
``gpu_mem_gb`` (``gpus_per_node`` null: 0, as ``cluster=auto`` before detection), ``slices_gb`` (allowed memory slices), ``mig_profiles``, ``cores_per_node`` (null:
this machine's), ``mem_gb_per_node`` (null: this machine's), ``cpu_threads`` (allowed thread counts
per rank without GPU), ``slurm:`` (partition, account, qos, constraint, time_min, cpus_per_task,
tasks_per_node, gpus_per_node, mem_gb, setup, srun_mpi; other keys are kept in ``extra``), and the
optional ``slice_layouts``: the slice layouts a GPU may take, each a list of slice sizes (GB), e.g.
the MIG geometries a GPU model supports.  Without it any multiset of ``slices_gb`` whose sum is at
most ``gpu_mem_gb`` is a valid layout.  GB means GiB (2**30 bytes) throughout.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from hpcsplit.core.settings import closest
from hpcsplit.errors import ConfigError

__all__ = ["GIB", "ClusterSpec", "SlurmSpec", "machine_cores", "machine_mem_gb", "slice_fraction"]

GIB = 2**30


def slice_fraction(slice_gb: float, total_bytes: int) -> float:
    """The share of a GPU's memory that a slice of ``slice_gb`` GB is (GB = GiB everywhere in hpcsplit).

    What ``torch.cuda.set_per_process_memory_fraction`` takes; profiling and serving both call it, so a
    cell measured in a slice gets the same cap when served.

    Examples
    --------
    >>> slice_fraction(10, 80 * GIB), slice_fraction(100, 80 * GIB)
    (0.125, 1.0)
    """
    return min(1.0, float(slice_gb) * GIB / total_bytes)

_TOP_KEYS = (
    "name",
    "scheduler",
    "nodes",
    "gpus_per_node",
    "gpu_name",
    "gpu_mem_gb",
    "slices_gb",
    "mig_profiles",
    "cores_per_node",
    "mem_gb_per_node",
    "cpu_threads",
    "slurm",
    "slice_layouts",
)
_SLURM_KEYS = (
    "partition",
    "account",
    "qos",
    "constraint",
    "time_min",
    "tasks_per_node",
    "cpus_per_task",
    "gpus_per_node",
    "mem_gb",
    "srun_mpi",
    "setup",
)
_SCHEDULERS = ("local", "slurm")


def machine_cores() -> int:
    """CPU cores this process may use (affinity-aware)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - non-Linux
        return max(1, os.cpu_count() or 1)


def machine_mem_gb() -> float:
    """Physical memory of this machine in GiB."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 8.0


@dataclass(frozen=True, slots=True)
class SlurmSpec:
    """The ``slurm:`` block of a cluster description."""

    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    time_min: int = 30
    tasks_per_node: int = 1
    cpus_per_task: int = 1
    gpus_per_node: int = 0
    mem_gb: float | None = None
    srun_mpi: str = "pmi2"
    setup: tuple[str, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    """A site: nodes, GPUs, memory slices and CPU cores (see ``[Note: cluster contract]``).

    Build it with :meth:`from_config`, which fills machine defaults and validates.
    """

    name: str
    scheduler: str
    nodes: int
    gpus_per_node: int
    gpu_name: str | None
    gpu_mem_gb: float
    slices_gb: tuple[float, ...]
    mig_profiles: tuple[str, ...]
    cores_per_node: int
    mem_gb_per_node: float
    cpu_threads: tuple[int, ...]
    slurm: SlurmSpec | None = None
    slice_layouts: tuple[tuple[float, ...], ...] | None = None

    CONFIG_KEYS: ClassVar[tuple[str, ...]] = _TOP_KEYS  # the keys of conf/cluster/*.yaml

    @property
    def is_gpu(self) -> bool:
        """True when the nodes have GPUs (``gpus_per_node > 0``)."""
        return self.gpus_per_node > 0

    @property
    def device_kind(self) -> str:
        """``"cuda"`` or ``"cpu"``, as in profiles and plans."""
        return "cuda" if self.is_gpu else "cpu"

    @property
    def total_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def mem_bytes_per_node(self) -> int:
        return int(self.mem_gb_per_node * GIB)

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> ClusterSpec:
        """Validate a cluster description; every problem is listed in one :class:`ConfigError`.

        Parameters
        ----------
        cfg : mapping
            The ``cluster`` node of the resolved config. ``cores_per_node`` / ``mem_gb_per_node``
            null take this machine's values.

        Raises
        ------
        ConfigError
            Naming each invalid key, what was found and what is allowed.

        Examples
        --------
        >>> spec = ClusterSpec.from_config({"name": "t", "nodes": 1, "gpus_per_node": 0,
        ...     "cores_per_node": 4, "mem_gb_per_node": 8, "cpu_threads": [1, 2]})
        >>> spec.device_kind, spec.cpu_threads
        ('cpu', (1, 2))
        """
        if not isinstance(cfg, Mapping):
            raise ConfigError(f"cluster config must be a mapping, found {type(cfg).__name__}")
        errs: list[str] = []
        name = str(cfg.get("name") or "unnamed")
        for key in sorted(set(cfg) - set(_TOP_KEYS), key=str):
            errs.append(f"unknown key {key!r}{closest(str(key), _TOP_KEYS)}; valid keys are {list(_TOP_KEYS)}")

        def _int(key: str, default: Any, lo: int) -> int:
            v = cfg.get(key, default)
            if isinstance(v, bool) or not isinstance(v, int | float) or int(v) != v or v < lo:
                errs.append(f"{key} = {v!r}, needs an integer >= {lo}")
                return lo
            return int(v)

        def _num(key: str, default: Any, lo: float) -> float:
            v = cfg.get(key, default)
            if isinstance(v, bool) or not isinstance(v, int | float) or v < lo:
                errs.append(f"{key} = {v!r}, needs a number >= {lo}")
                return float(lo)
            return float(v)

        scheduler = str(cfg.get("scheduler", "local"))
        if scheduler not in _SCHEDULERS:
            errs.append(f"scheduler = {scheduler!r}, needs one of {list(_SCHEDULERS)}")
        nodes = _int("nodes", 1, 1)
        gpus = 0 if cfg.get("gpus_per_node") is None else _int("gpus_per_node", 0, 0)  # null: cluster=auto unresolved
        gpu_mem = _num("gpu_mem_gb", 0, 0) if cfg.get("gpu_mem_gb") is not None else 0.0
        cores = machine_cores() if cfg.get("cores_per_node") is None else _int("cores_per_node", 1, 1)
        mem = machine_mem_gb() if cfg.get("mem_gb_per_node") is None else _num("mem_gb_per_node", 0, 0)
        if mem <= 0:
            errs.append(f"mem_gb_per_node = {mem}, needs > 0 (or null for this machine's)")

        slices = _num_list(cfg.get("slices_gb") or [], "slices_gb", errs)
        threads_f = _num_list(cfg.get("cpu_threads") or [], "cpu_threads", errs)
        threads = tuple(int(t) for t in threads_f)
        if any(int(t) != t for t in threads_f):
            errs.append(f"cpu_threads = {list(threads_f)}: thread counts must be integers")
        mig = tuple(str(m) for m in (cfg.get("mig_profiles") or []))
        layouts_cfg = cfg.get("slice_layouts")
        layouts: tuple[tuple[float, ...], ...] | None = None

        if gpus > 0:
            if gpu_mem <= 0:
                errs.append(
                    f"gpus_per_node = {gpus} but gpu_mem_gb = {cfg.get('gpu_mem_gb')!r}; give the GPU memory in GB"
                )
            if not slices:
                errs.append(
                    f"gpus_per_node = {gpus} but slices_gb is empty; list the allowed slices, e.g. [{gpu_mem:g}]"
                )
            too_big = [s for s in slices if gpu_mem > 0 and s > gpu_mem]
            if too_big:
                errs.append(
                    f"slices_gb {too_big} exceed gpu_mem_gb = {gpu_mem:g}; drop them or raise gpu_mem_gb"
                )
            if mig and len(mig) != len(slices):
                errs.append(
                    f"mig_profiles has {len(mig)} entries but slices_gb has {len(slices)}; "
                    "give one MIG profile per slice size (same order) or an empty list"
                )
            if layouts_cfg is not None:
                layouts = _layouts(layouts_cfg, slices, gpu_mem, errs)
        else:
            if not threads:
                errs.append(
                    "gpus_per_node = 0 (CPU) but cpu_threads is empty; list thread counts per rank, e.g. [1, 2]"
                )
            big = [t for t in threads if t > cores]
            if big:
                errs.append(
                    f"cpu_threads {big} exceed cores_per_node = {cores}; drop them or set cores_per_node"
                )
            if layouts_cfg:
                errs.append("slice_layouts is set but gpus_per_node = 0; layouts apply to GPUs only")

        slurm = None
        slurm_cfg = cfg.get("slurm")
        if scheduler == "slurm" and not slurm_cfg:
            errs.append("scheduler = 'slurm' needs a slurm: block (partition, account, time_min, ...)")
        if slurm_cfg:
            slurm = _slurm(slurm_cfg, errs)
        if errs:
            raise ConfigError(f"cluster {name!r} is invalid:\n  - " + "\n  - ".join(errs))
        return cls(
            name=name,
            scheduler=scheduler,
            nodes=nodes,
            gpus_per_node=gpus,
            gpu_name=None if cfg.get("gpu_name") is None else str(cfg.get("gpu_name")),
            gpu_mem_gb=gpu_mem,
            slices_gb=tuple(dict.fromkeys(slices)),
            mig_profiles=mig,
            cores_per_node=cores,
            mem_gb_per_node=mem,
            cpu_threads=tuple(sorted(set(threads))),
            slurm=slurm,
            slice_layouts=layouts,
        )


def _num_list(v: Any, key: str, errs: list[str]) -> tuple[float, ...]:
    if isinstance(v, int | float) and not isinstance(v, bool):
        v = [v]
    if not isinstance(v, list | tuple):
        errs.append(f"{key} = {v!r}, needs a list of positive numbers")
        return ()
    out = []
    for x in v:
        if isinstance(x, bool) or not isinstance(x, int | float) or x <= 0:
            errs.append(f"{key} contains {x!r}; every entry must be a positive number")
        else:
            out.append(float(x))
    return tuple(out)


def _layouts(
    v: Any, slices: tuple[float, ...], gpu_mem: float, errs: list[str]
) -> tuple[tuple[float, ...], ...]:
    if not isinstance(v, list | tuple) or not v:
        errs.append(f"slice_layouts = {v!r}, needs a non-empty list of lists of slice sizes (GB)")
        return ()
    out = []
    for i, lay in enumerate(v):
        sizes = _num_list(lay, f"slice_layouts[{i}]", errs)
        bad = [s for s in sizes if s not in slices]
        if bad:
            errs.append(
                f"slice_layouts[{i}] = {list(sizes)} uses {bad}, which are not in slices_gb {list(slices)}"
            )
        if sum(sizes) > gpu_mem + 1e-9:
            errs.append(
                f"slice_layouts[{i}] = {list(sizes)} sums to {sum(sizes):g} GB > gpu_mem_gb {gpu_mem:g}"
            )
        if sizes:
            out.append(tuple(sorted(sizes, reverse=True)))
    return tuple(out)


def _slurm(v: Any, errs: list[str]) -> SlurmSpec | None:
    if not isinstance(v, Mapping):
        errs.append(f"slurm = {v!r}, needs a mapping")
        return None
    known = {k: v[k] for k in _SLURM_KEYS if k in v and v[k] is not None}
    extra = {k: v[k] for k in v if k not in _SLURM_KEYS}
    for k in ("time_min", "tasks_per_node", "cpus_per_task", "gpus_per_node"):
        x = known.get(k)
        if x is not None and (isinstance(x, bool) or not isinstance(x, int) or x < 0):
            errs.append(f"slurm.{k} = {x!r}, needs an integer >= 0")
            known.pop(k)
    setup = known.pop("setup", ())
    if isinstance(setup, str):
        setup = [setup]
    return SlurmSpec(**known, setup=tuple(str(s) for s in setup), extra=extra)
