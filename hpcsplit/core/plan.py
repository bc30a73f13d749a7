"""The placement plan: which MPI rank runs what, where.

Pure data (no torch, no mpi4py): the allocate stage writes it, the runtime reads it.

[Note: plan contract]
A JSON file with ``schema_version`` and

- ``model``, ``switchboard_sha256``, ``device_kind`` ("cuda" | "cpu"), ``nodes``;
- ``ranks``: one :class:`RankEntry` per MPI rank, ``ranks[i].rank == i``.  Rank 0 is the frontend
  (``role="frontend"``, ``component=None``, ``gpu=None``, ``slice_gb=None``, ``batch_size=1``,
  ``replica=0``, on node 0).  Component ranks follow, ordered by (node, gpu, slice), so that a block
  distribution of ranks over nodes (srun's default) puts each rank on its planned node.
  On CPU (``device_kind="cpu"``) ``gpu`` and ``slice_gb`` are null and ``threads`` is the rank's
  thread count; on CUDA ``gpu`` is the GPU index within the node and ``slice_gb`` the memory slice.
  ``replica`` numbers the ranks of one component 0..k-1 over the whole job.
- ``predicted_throughput_rps``: component -> requests/s predicted by the allocator (sum over its replicas);
- ``utilization``: ``"n<node>/g<gpu>"`` (CPU: ``"n<node>/cpu"``) -> predicted utilization 0..1 of that device;
- ``meta``: free-form JSON-able extras (cluster name, solver, objective, gap); readers must not need it.

``Plan.load`` validates and raises :class:`~hpcsplit.errors.PlanError` naming every problem.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hpcsplit.errors import PlanError

__all__ = ["PLAN_SCHEMA_VERSION", "Plan", "RankEntry", "device_key", "strict_json"]

PLAN_SCHEMA_VERSION = 1

_ROLES = ("frontend", "component")
_DEVICE_KINDS = ("cuda", "cpu")


def device_key(node: int, gpu: int | None) -> str:
    """Key of one device in :attr:`Plan.utilization`.

    Examples
    --------
    >>> device_key(1, 3)
    'n1/g3'
    >>> device_key(0, None)
    'n0/cpu'
    """
    return f"n{node}/cpu" if gpu is None else f"n{node}/g{gpu}"


@dataclass(frozen=True, slots=True)
class RankEntry:
    """One MPI rank of the plan.

    Attributes
    ----------
    rank : int
        MPI rank in COMM_WORLD.
    role : str
        ``"frontend"`` (rank 0 only) or ``"component"``.
    node : int
        Node index 0..nodes-1.
    gpu : int or None
        GPU index within the node; None on CPU and for the frontend.
    slice_gb : float or None
        Memory slice (GB) of the GPU this rank may use; None on CPU and for the frontend.
    threads : int
        CPU threads the rank should use (``torch.set_num_threads``).
    component : str or None
        Component this rank serves; None for the frontend.
    batch_size : int
        Batch size the rank runs its component at (1 for the frontend: unused).
    replica : int
        Index of this rank among the replicas of its component (0..k-1).
    """

    rank: int
    role: str
    node: int
    gpu: int | None
    slice_gb: float | None
    threads: int
    component: str | None
    batch_size: int
    replica: int

    @property
    def device(self) -> str:
        """The :func:`device_key` of the device this rank runs on."""
        return device_key(self.node, self.gpu)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RankEntry:
        if not isinstance(d, dict):
            raise PlanError(f"a rank entry is a JSON object, found {type(d).__name__}")
        keys = set(cls.__dataclass_fields__)
        missing = sorted(keys - set(d))
        extra = sorted(map(str, set(d) - keys))
        if missing or extra:
            raise PlanError(
                f"rank entry {_short(d)}: missing keys {missing}, unknown keys {extra}; "
                f"a rank entry has exactly {sorted(keys)}"
            )
        where = f"rank entry {_short(d.get('rank'))}"
        return cls(
            rank=_whole(d["rank"], f"{where}: rank", 0, MAX_RANKS - 1),
            role=_text(d["role"], f"{where}: role"),
            node=_whole(d["node"], f"{where}: node", 0, MAX_NODES - 1),
            gpu=None if d["gpu"] is None else _whole(d["gpu"], f"{where}: gpu", 0, MAX_GPUS_PER_NODE - 1),
            slice_gb=None if d["slice_gb"] is None else _real(d["slice_gb"], f"{where}: slice_gb", MAX_SLICE_GB),
            threads=_whole(d["threads"], f"{where}: threads", 1, MAX_THREADS),
            component=None if d["component"] is None else _text(d["component"], f"{where}: component"),
            batch_size=_whole(d["batch_size"], f"{where}: batch_size", 1, MAX_BATCH),
            replica=_whole(d["replica"], f"{where}: replica", 0, MAX_RANKS - 1),
        )


# Bounds of what a plan may ask for: far above any real site, low enough that a typo or a crafted
# file cannot make a rank start 100,000 threads or batch 1e12 samples.
MAX_RANKS = 1 << 20
MAX_NODES = 1 << 16
MAX_GPUS_PER_NODE = 64
MAX_THREADS = 1024
MAX_BATCH = 1 << 20
MAX_SLICE_GB = 1 << 16
MAX_PLAN_BYTES = 64 << 20


def strict_json(v: Any) -> Any:
    """``v`` with every non-finite float (a simulated p99 of a candidate that answered nothing) as None: what
    ``json.dumps`` writes of it is then strict JSON (no ``Infinity``/``NaN``, which other readers refuse)."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: strict_json(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [strict_json(x) for x in v]
    return v


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


def _whole(v: Any, what: str, lo: int, hi: int) -> int:
    """A JSON integer in ``[lo, hi]`` (not a boolean, string or fraction)."""
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or int(v) != v:
        raise PlanError(f"{what} = {_short(v)}: needs an integer in [{lo}, {hi}]")
    if not lo <= v <= hi:
        raise PlanError(f"{what} = {_short(v)}: needs an integer in [{lo}, {hi}]")
    return int(v)


def _real(v: Any, what: str, hi: float, lo: float = 0.0) -> float:
    """A finite JSON number in ``(lo, hi]``."""
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or not lo < v <= hi:
        raise PlanError(f"{what} = {_short(v)}: needs a finite number in ({lo:g}, {hi:g}]")
    return float(v)


def _text(v: Any, what: str) -> str:
    if not isinstance(v, str) or not v or len(v) > 256:
        raise PlanError(f"{what} = {_short(v)}: needs a non-empty string (at most 256 characters)")
    return v


def _number_map(v: Any, what: str) -> dict[str, float]:
    if not isinstance(v, dict):
        raise PlanError(f"{what} = {_short(v)}: needs an object of numbers")
    out = {}
    for k, x in v.items():
        if isinstance(x, bool) or not isinstance(x, int | float):
            raise PlanError(f"{what}[{_short(k)}] = {_short(x)}: needs a number")
        out[str(k)] = float(x)
    return out


@dataclass(frozen=True, slots=True)
class Plan:
    """A placement of components onto MPI ranks (see ``[Note: plan contract]``)."""

    model: str
    switchboard_sha256: str | None
    device_kind: str
    nodes: int
    ranks: tuple[RankEntry, ...]
    predicted_throughput_rps: dict[str, float]
    utilization: dict[str, float]
    meta: dict[str, Any] = field(default_factory=dict)
    schema_version: int = PLAN_SCHEMA_VERSION

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranks", tuple(self.ranks))
        problems = self.problems()
        if problems:
            raise PlanError("invalid plan:\n  - " + "\n  - ".join(problems))

    # ----------------------------------------------------------------- queries
    @property
    def world_size(self) -> int:
        """Number of MPI ranks the plan needs (frontend included)."""
        return len(self.ranks)

    @property
    def frontend(self) -> RankEntry:
        return self.ranks[0]

    @property
    def components(self) -> tuple[str, ...]:
        """Components in order of first appearance in ``predicted_throughput_rps``, then ranks."""
        seen: dict[str, None] = dict.fromkeys(self.predicted_throughput_rps)
        for r in self.ranks:
            if r.component is not None:
                seen.setdefault(r.component, None)
        return tuple(seen)

    def replicas(self, component: str) -> tuple[RankEntry, ...]:
        """Ranks serving ``component``, ordered by replica index.

        Raises
        ------
        PlanError
            If the plan has no rank for ``component``.
        """
        out = sorted((r for r in self.ranks if r.component == component), key=lambda r: r.replica)
        if not out:
            raise PlanError(
                f"plan has no rank for component {component!r}; it has {list(self.components)}. "
                "Re-run the allocate stage with the switchboard you serve."
            )
        return tuple(out)

    def rank_entry(self, rank: int) -> RankEntry:
        if not 0 <= rank < self.world_size:
            raise PlanError(f"rank {rank} is outside the plan's world size {self.world_size}")
        return self.ranks[rank]

    # -------------------------------------------------------------- validation
    def problems(self) -> list[str]:
        """All internal inconsistencies of the plan (empty when valid)."""
        p: list[str] = []
        if self.schema_version != PLAN_SCHEMA_VERSION:
            p.append(f"schema_version {self.schema_version} is not {PLAN_SCHEMA_VERSION}")
        if self.device_kind not in _DEVICE_KINDS:
            p.append(f"device_kind {self.device_kind!r} is not one of {_DEVICE_KINDS}")
        if self.nodes < 1:
            p.append(f"nodes = {self.nodes}, needs >= 1")
        if len(self.ranks) < 2:
            p.append(f"{len(self.ranks)} rank(s): a plan needs a frontend and at least one component rank")
        for i, r in enumerate(self.ranks):
            where = f"rank entry {i}"
            if r.rank != i:
                p.append(f"{where} has rank {r.rank}; ranks must be listed 0..{len(self.ranks) - 1} in order")
            if r.role not in _ROLES:
                p.append(f"{where}: role {r.role!r} is not one of {_ROLES}")
            if (i == 0) != (r.role == "frontend"):
                p.append(f"{where}: role {r.role!r}; rank 0 and only rank 0 is the frontend")
            if not 0 <= r.node < max(self.nodes, 1):
                p.append(f"{where}: node {r.node} outside 0..{self.nodes - 1}")
            if r.threads < 1:
                p.append(f"{where}: threads = {r.threads}, needs >= 1")
            if r.batch_size < 1:
                p.append(f"{where}: batch_size = {r.batch_size}, needs >= 1")
            if r.role == "frontend":
                if r.component is not None:
                    p.append(f"{where}: the frontend has component {r.component!r}, needs null")
                continue
            if not r.component:
                p.append(f"{where}: a component rank needs a component name")
            if self.device_kind == "cuda":
                if r.gpu is None or r.gpu < 0:
                    p.append(f"{where}: device_kind cuda needs a gpu index >= 0, found {r.gpu}")
                if r.slice_gb is None or not r.slice_gb > 0:
                    p.append(f"{where}: device_kind cuda needs slice_gb > 0, found {r.slice_gb}")
            elif self.device_kind == "cpu" and (r.gpu is not None or r.slice_gb is not None):
                p.append(f"{where}: device_kind cpu needs gpu and slice_gb null, found {r.gpu}, {r.slice_gb}")
        by_comp: dict[str, list[int]] = {}
        for r in self.ranks:
            if r.component is not None:
                by_comp.setdefault(r.component, []).append(r.replica)
        for comp, reps in by_comp.items():
            if sorted(reps) != list(range(len(reps))):
                p.append(f"component {comp!r}: replica indices {sorted(reps)}, need 0..{len(reps) - 1}")
        for comp, rps in self.predicted_throughput_rps.items():
            if comp not in by_comp:
                p.append(f"predicted_throughput_rps names {comp!r}, which has no rank")
            if not (isinstance(rps, int | float) and math.isfinite(rps) and rps >= 0):
                p.append(f"predicted_throughput_rps[{comp!r}] = {rps!r}, needs a finite number >= 0")
        for key, u in self.utilization.items():
            if not (isinstance(u, int | float) and math.isfinite(u) and u >= 0):
                p.append(f"utilization[{key!r}] = {u!r}, needs a finite number >= 0")
        return p

    # ------------------------------------------------------------ (de)serialise
    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version,
            "model": self.model,
            "switchboard_sha256": self.switchboard_sha256,
            "device_kind": self.device_kind,
            "nodes": self.nodes,
            "world_size": self.world_size,
            "predicted_throughput_rps": dict(self.predicted_throughput_rps),
            "utilization": dict(self.utilization),
            "meta": dict(self.meta),
            "ranks": [r.to_dict() for r in self.ranks],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        if not isinstance(d, dict):
            raise PlanError(f"a plan is a JSON object, found {type(d).__name__}")
        version = d.get("schema_version")
        if type(version) is not int or version != PLAN_SCHEMA_VERSION:
            raise PlanError(
                f"plan schema_version {version!r}, this hpcsplit reads {PLAN_SCHEMA_VERSION}; "
                "re-run the allocate stage to write a current plan"
            )
        required = ("model", "device_kind", "nodes", "ranks", "predicted_throughput_rps", "utilization")
        missing = [k for k in required if k not in d]
        if missing:
            raise PlanError(f"plan misses keys {missing}; a plan needs {list(required)}")
        if not isinstance(d["ranks"], list) or len(d["ranks"]) > MAX_RANKS:
            raise PlanError(f"ranks = {_short(d['ranks'])}: needs a list of rank entries")
        sha = d.get("switchboard_sha256")
        if sha is not None and not (isinstance(sha, str) and len(sha) == 64 and all(c in "0123456789abcdef" for c in sha)):
            raise PlanError(f"switchboard_sha256 = {_short(sha)}: needs null or 64 hex digits")
        meta = d.get("meta") or {}
        if not isinstance(meta, dict):
            raise PlanError(f"meta = {_short(meta)}: needs an object")
        ranks = tuple(RankEntry.from_dict(r) for r in d["ranks"])
        plan = cls(
            model=_text(d["model"], "model"),
            switchboard_sha256=sha,
            device_kind=_text(d["device_kind"], "device_kind"),
            nodes=_whole(d["nodes"], "nodes", 1, MAX_NODES),
            ranks=ranks,
            predicted_throughput_rps=_number_map(d["predicted_throughput_rps"], "predicted_throughput_rps"),
            utilization=_number_map(d["utilization"], "utilization"),
            meta=dict(meta),
            schema_version=int(version),
        )
        if "world_size" in d and d["world_size"] != plan.world_size:
            raise PlanError(f"plan says world_size {_short(d['world_size'])} but lists {plan.world_size} ranks")
        return plan

    def save(self, path: str | Path) -> Path:
        """Write the plan as JSON (atomically) and return the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(strict_json(self.to_dict()), indent=2, allow_nan=False) + "\n")
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """Read and validate a plan file.

        Raises
        ------
        PlanError
            If the file is missing, not JSON, of another schema version, or inconsistent.
        """
        path = Path(path)
        try:
            if path.stat().st_size > MAX_PLAN_BYTES:
                raise PlanError(f"{path} is {path.stat().st_size} bytes, more than a plan ({MAX_PLAN_BYTES}); "
                                "pass the plan.json the allocate stage wrote")
            d = json.loads(path.read_bytes().decode("utf-8"))
        except FileNotFoundError as e:
            raise PlanError(f"no plan file at {path}; run `python -m hpcsplit stage=allocate` first") from e
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise PlanError(f"{path} is not valid JSON ({e}); re-run the allocate stage") from e
        except RecursionError:
            raise PlanError(f"{path} nests JSON too deeply to be a plan; re-run the allocate stage") from None
        except OSError as e:
            raise PlanError(f"cannot read the plan {path}: {e.strerror or e}") from e
        try:
            return cls.from_dict(d)
        except PlanError as e:
            raise PlanError(f"{path}: {e}") from e

    # ------------------------------------------------------------------ display
    def format(self) -> str:
        """A readable table: one line per rank, then throughput per component and device utilization."""
        head = f"{'rank':>4}  {'role':<9} {'node':>4} {'gpu':>4} {'slice':>6} {'thr':>3}  {'component':<24} {'batch':>5} {'rep':>4}"
        lines = [
            f"plan for {self.model!r}: {self.world_size} ranks on {self.nodes} node(s), device {self.device_kind}",
            head,
            "-" * len(head),
        ]
        for r in self.ranks:
            gpu = "-" if r.gpu is None else str(r.gpu)
            sl = "-" if r.slice_gb is None else f"{r.slice_gb:g}GB"
            comp = r.component or "-"
            lines.append(
                f"{r.rank:>4}  {r.role:<9} {r.node:>4} {gpu:>4} {sl:>6} {r.threads:>3}  {comp:<24} "
                f"{r.batch_size:>5} {r.replica:>4}"
            )
        lines.append("predicted throughput (req/s):")
        for comp, rps in self.predicted_throughput_rps.items():
            n = sum(1 for r in self.ranks if r.component == comp)
            lines.append(f"  {comp:<24} {rps:>12.2f}  ({n} replica{'s' if n != 1 else ''})")
        if self.utilization:
            lines.append("predicted utilization per device:")
            lines.extend(f"  {k:<10} {u:6.1%}" for k, u in self.utilization.items())
        return "\n".join(lines)

    def __str__(self) -> str:  # pragma: no cover - convenience
        return self.format()
