"""Configuration helpers that need no Hydra: where ``conf/`` is, argv shortcuts, validation.

[Note: input shortcuts]
``resume=RUN_DIR`` becomes ``hydra.run.dir=/abs/RUN_DIR``: the run writes into that folder again and
``stage=all`` skips the stages whose inputs are unchanged (``[Note: pipeline manifest]``).
``python -m hpcsplit stage=analyze profile=PATH`` is rewritten before Hydra parses it:
``profile`` is a config group, so a value that is not one of its options but looks like a path
becomes ``profile.path=/abs/PATH``.  ``plan``, ``switchboard`` and ``calibration`` are top-level keys; their paths
are made absolute (``plan=/abs/PATH``) so that SLURM jobs started from another folder find them.
Option names (``profile=default``), ``null``, sweeps (``a,b``) and dotted keys are left alone.

Validation collects every problem of the launch-related config (``stage`` against the stage table,
the ``launcher`` group through its settings class, ``cluster.slurm`` for ``launcher=slurm``), of the
values every stage reads, and of the *keys* of every group (:func:`key_problems`), and raises one
:class:`~hpcsplit.errors.ConfigError` before any work starts; each stage's ``from_config`` checks its
own group again (types, ranges) when it runs.

[Note: up-front key check]
``python -m hpcsplit`` refuses an unknown key in any group (``+runtime.max_infligth=3``) and at the top
level (``+sede=1``) before any work, with the closest valid key suggested, as the stage's own settings
class would when it runs -- but without importing the stage modules (they import torch or mpi4py,
which the login side must not).  The valid keys of a group are the keys of its option files in
``conf/<group>/`` (narrowed to the options whose ``name`` matches when the group's options carry one),
which ``tests/unit/test_settings_keys.py`` keeps equal to the fields of the group's settings
dataclass; a nested mapping (``cluster.slurm``, ``runtime.trace``) is checked against the union of
that mapping's keys over the group's options.  Top-level keys are ``conf/config.yaml``'s own keys,
its groups, ``hydra`` and ``local`` (an optional site file).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from hpcsplit.allocation.settings import AllocateSettings
from hpcsplit.core.cluster import ClusterSpec
from hpcsplit.core.paths import RunPaths
from hpcsplit.core.plan import Plan
from hpcsplit.core.settings import closest, conf_dir, group_defaults
from hpcsplit.errors import ConfigError, PlanError
from hpcsplit.launch.calibrate import CalibrateSettings
from hpcsplit.launch.simulate import SimulateSettings
from hpcsplit.launch.stages import STAGE_NAMES, launcher_problems
from hpcsplit.runtime.settings import BenchSettings, RuntimeSettings

__all__ = [
    "check_plan_on_cluster",
    "conf_dir",
    "key_problems",
    "launch_problems",
    "plan_cluster_problems",
    "plan_roles",
    "rewrite_argv",
    "settings_problems",
    "slurm_problems",
    "validate",
    "value_problems",
]

SRUN_MPI = ("pmi2", "pmix", "pmix_v2", "pmix_v3", "pmix_v4", "pmix_v5", "pmi", "cray_shasta", "none")

# Keys of the argv shortcut: key -> True when it is a config group (value goes to KEY.path).
_SHORTCUTS = {"profile": True, "plan": False, "switchboard": False, "calibration": False}
_SAFE_VALUE = re.compile(r"^[A-Za-z0-9_./:+@~%-]+$")


def _group_options(key: str, conf: Path | None) -> set[str] | None:
    """Option names of config group ``key`` (None when ``key`` is not a group folder)."""
    if conf is None:
        return None
    folder = conf / key
    if not folder.is_dir():
        return None
    return {p.stem for p in folder.glob("*.yaml")}


def _looks_like_path(value: str, base: Path) -> bool:
    return "/" in value or "." in value or value.startswith("~") or (base / value).exists()


def _quote(value: str) -> str:
    if _SAFE_VALUE.match(value):
        return value
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def rewrite_argv(argv: Sequence[str], conf: Path | None = None, cwd: Path | None = None) -> list[str]:
    """Rewrite the ``profile=PATH`` / ``plan=PATH`` / ``switchboard=PATH`` shortcuts.

    See ``[Note: input shortcuts]``.

    Parameters
    ----------
    argv : sequence of str
        Command-line overrides (without the program name).
    conf : Path, optional
        The conf folder (default :func:`conf_dir`), used to list group options.
    cwd : Path, optional
        Base of relative paths (default the current folder).

    Returns
    -------
    list of str

    Examples
    --------
    >>> rewrite_argv(["stage=analyze", "profile=runs/p.h5"], conf=None, cwd=Path("/w"))
    ['stage=analyze', 'profile.path=/w/runs/p.h5']
    >>> rewrite_argv(["plan=out/plan.json", "profile=default", "+experiment=clip"], conf=None, cwd=Path("/w"))
    ['plan=/w/out/plan.json', 'profile=default', '+experiment=clip']
    >>> rewrite_argv(["resume=outputs/x"], conf=None, cwd=Path("/w"))
    ['hydra.run.dir=/w/outputs/x']
    """
    if conf is None:
        try:
            conf = conf_dir()
        except ConfigError:
            conf = None
    base = Path.cwd() if cwd is None else cwd
    out: list[str] = []
    for arg in argv:
        key, eq, value = arg.partition("=")
        if key == "resume" and eq and value not in ("", "null"):
            folder = Path(os.path.expanduser(value))
            folder = folder if folder.is_absolute() else base / folder
            out.append(f"hydra.run.dir={_quote(os.path.normpath(folder))}")
            continue
        if not eq or key not in _SHORTCUTS or value in ("", "null") or "," in value or "(" in value:
            out.append(arg)
            continue
        options = _group_options(key, conf)
        is_group = _SHORTCUTS[key] or options is not None
        if options is not None and value in options:
            out.append(arg)
            continue
        if is_group and not _looks_like_path(value, base):
            out.append(arg)  # let Hydra list the group's options
            continue
        path = Path(os.path.expanduser(value))
        path = path if path.is_absolute() else base / path
        target = f"{key}.path" if is_group else key
        out.append(f"{target}={_quote(os.path.normpath(path))}")
    return out


def _get(cfg: Mapping[str, Any] | None, dotted: str, default: Any = None) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return default
        node = node[part]
    return node


def _check_int(errs: list[str], name: str, value: Any, lo: int, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        more = " or null" if allow_none else ""
        errs.append(f"{name} = {value!r}: needs an integer >= {lo}{more}")


def _check_num(errs: list[str], name: str, value: Any, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        errs.append(f"{name} = {value!r}: needs a number > 0" + (" or null" if allow_none else ""))


def launch_problems(cfg: Mapping[str, Any]) -> list[str]:
    """Every problem of the launch-related config (stage, launcher, cluster.slurm); empty when valid."""
    errs: list[str] = []
    stage = cfg.get("stage")
    if stage not in STAGE_NAMES:
        errs.append(f"stage = {stage!r}: needs one of {list(STAGE_NAMES)}")
    launcher, problems = launcher_problems(cfg)
    errs.extend(problems)
    if _get(cfg, "profile.ranks") is not None:
        _check_int(errs, "profile.ranks", _get(cfg, "profile.ranks"), 1)
    if launcher is not None and launcher.name == "slurm":
        errs.extend(slurm_problems(cfg))
    errs.extend(value_problems(cfg))
    return errs


def _check_list(errs: list[str], name: str, value: Any, lo: float, ints: bool) -> None:
    if value is None:
        return
    items = value if isinstance(value, list) else [value]
    kind = int if ints else (int, float)
    bad = [v for v in items if isinstance(v, bool) or not isinstance(v, kind) or v < lo or (not ints and v == 0)]
    if bad or (isinstance(value, list) and not value):
        what = "integers >= 1" if ints else "numbers > 0"
        errs.append(f"{name} = {value!r}: needs a non-empty list of {what}")


def value_problems(cfg: Mapping[str, Any]) -> list[str]:
    """Problems of the values every stage reads (batch sizes, loads, grids, cluster hardware).

    Only keys that are present are checked, so partial configs (tests, plain sbatch) pass.
    """
    errs: list[str] = []
    if _get(cfg, "model.batch_size") is not None:
        _check_int(errs, "model.batch_size", _get(cfg, "model.batch_size"), 1)
    if _get(cfg, "bench.qps") is not None:
        _check_list(errs, "bench.qps", _get(cfg, "bench.qps"), 0, ints=False)
    for key in ("bench.duration_s", "runtime.request_timeout_s", "allocate.time_limit_s"):
        if _get(cfg, key) is not None:
            _check_num(errs, key, _get(cfg, key), allow_none=False)
    for key in ("bench.min_requests", "bench.floor_runs"):
        if _get(cfg, key) is not None:
            _check_int(errs, key, _get(cfg, key), 0)
    if _get(cfg, "bench.warmup_s") is not None and not (
        isinstance(_get(cfg, "bench.warmup_s"), int | float) and _get(cfg, "bench.warmup_s") >= 0
    ):
        errs.append(f"bench.warmup_s = {_get(cfg, 'bench.warmup_s')!r}: needs a number >= 0")
    if _get(cfg, "profile.max_batch") is not None:
        _check_int(errs, "profile.max_batch", _get(cfg, "profile.max_batch"), 1)
    if _get(cfg, "profile.iters") is not None:
        _check_int(errs, "profile.iters", _get(cfg, "profile.iters"), 1)
    if _get(cfg, "profile.warmup") is not None:
        _check_int(errs, "profile.warmup", _get(cfg, "profile.warmup"), 0)
    _check_list(errs, "profile.batch_sizes", _get(cfg, "profile.batch_sizes"), 1, ints=True)
    _check_list(errs, "profile.threads", _get(cfg, "profile.threads"), 1, ints=True)
    if _get(cfg, "runtime.max_inflight") is not None:
        _check_int(errs, "runtime.max_inflight", _get(cfg, "runtime.max_inflight"), 1)
    cluster = cfg.get("cluster")
    if isinstance(cluster, Mapping):
        if "nodes" in cluster:
            _check_int(errs, "cluster.nodes", cluster.get("nodes"), 1)
        _check_int(errs, "cluster.cores_per_node", cluster.get("cores_per_node"), 1, allow_none=True)
        if cluster.get("gpus_per_node") is not None:
            _check_int(errs, "cluster.gpus_per_node", cluster.get("gpus_per_node"), 0)
        if cluster.get("cpu_threads"):
            _check_list(errs, "cluster.cpu_threads", cluster.get("cpu_threads"), 1, ints=True)
    elif cluster is not None:
        errs.append(f"cluster = {cluster!r}: needs a preset name from conf/cluster/ (cluster=auto|local|dev|perlmutter)")
    return errs


def slurm_problems(cfg: Mapping[str, Any]) -> list[str]:
    """Problems of ``cluster.slurm`` for ``launcher=slurm``."""
    errs: list[str] = []
    cluster = cfg.get("cluster")
    name = _get(cfg, "cluster.name")
    slurm = _get(cfg, "cluster.slurm")
    if not isinstance(cluster, Mapping) or not isinstance(slurm, Mapping):
        errs.append(
            f"launcher=slurm needs a cluster with a `slurm:` block, but cluster={name!r} has none; "
            "use a preset from conf/cluster/ (cluster=dev, cluster=perlmutter) or add a slurm block"
        )
        return errs
    _check_int(errs, "cluster.nodes", cluster.get("nodes", 1), 1)
    _check_int(errs, "cluster.slurm.nodes", slurm.get("nodes"), 1, allow_none=True)
    _check_int(errs, "cluster.slurm.time_min", slurm.get("time_min", 30), 1)
    _check_int(errs, "cluster.slurm.tasks_per_node", slurm.get("tasks_per_node", 1), 1)
    _check_int(errs, "cluster.slurm.cpus_per_task", slurm.get("cpus_per_task", 1), 1)
    _check_int(errs, "cluster.slurm.gpus_per_node", slurm.get("gpus_per_node", 0), 0, allow_none=True)
    _check_num(errs, "cluster.slurm.mem_gb", slurm.get("mem_gb"))
    mpi = slurm.get("srun_mpi", "pmi2")
    if mpi is not None and str(mpi) not in SRUN_MPI:
        errs.append(f"cluster.slurm.srun_mpi = {mpi!r}: needs one of {list(SRUN_MPI)} (MPICH: pmi2)")
    setup = slurm.get("setup") or []
    if not isinstance(setup, list) or not all(isinstance(s, str) for s in setup):
        errs.append(f"cluster.slurm.setup = {setup!r}: needs a list of shell lines")
    for key in ("partition", "account", "qos", "constraint"):
        v = slurm.get(key)
        if v is not None and (not isinstance(v, str) or not v.strip() or any(c.isspace() for c in v)):
            errs.append(f"cluster.slurm.{key} = {v!r}: needs a name without spaces, or null")
    extra = slurm.get("sbatch_args")
    if extra is not None and not isinstance(extra, Mapping):
        errs.append(f"cluster.slurm.sbatch_args = {extra!r}: needs a mapping of sbatch option -> value")
    return errs


def validate(
    cfg: Mapping[str, Any],
    checks: Iterable[Callable[[Mapping[str, Any]], list[str]]] = (),
) -> None:
    """Raise one :class:`ConfigError` listing every problem found by :func:`launch_problems` and ``checks``.

    Examples
    --------
    >>> validate({"stage": "probe", "launcher": {"name": "local"}})
    >>> try:
    ...     validate({"stage": "nope", "launcher": {"name": "local", "ranks": 0}})
    ... except ConfigError as e:
    ...     print(str(e).splitlines()[0])
    2 config problem(s):
    """
    keys = key_problems(cfg)
    errs = keys + launch_problems(cfg) + settings_problems(cfg, skip={e.split(".")[0] for e in keys})
    for check in checks:
        errs.extend(check(cfg))
    errs = list(dict.fromkeys(errs))  # a value two checks find is listed once
    if errs:
        lines = "\n".join(f"  - {e}" for e in errs)
        raise ConfigError(
            f"{len(errs)} config problem(s):\n{lines}\n"
            "Fix them on the command line (key=value) or in conf/; `python -m hpcsplit --cfg job` shows the config."
        )


# ------------------------------------------------------------------------------------ up-front keys

# Groups whose settings classes import no heavy library, built up front (types and ranges too); the
# others (model, partition, verify, profile) live in modules that import torch and are built when their
# stage runs (their unknown keys are still refused up front by key_problems).
_LIGHT: dict[str, Callable[[Mapping[str, Any]], Any]] = {
    "allocate": AllocateSettings.from_config,
    "paths": lambda cfg: RunPaths.from_config(cfg, "."),
    "runtime": RuntimeSettings.from_config,
    "bench": BenchSettings.from_config,
    "calibrate": CalibrateSettings.from_config,
    "simulate": SimulateSettings.from_config,
}


def settings_problems(cfg: Mapping[str, Any], skip: Iterable[str] = ()) -> list[str]:
    """The problems the light settings classes (``_LIGHT``) find, one line each; groups in ``skip`` and
    groups the config does not have are left out."""
    errs: list[str] = []
    skipped = set(skip)
    for group, read in _LIGHT.items():
        if group in skipped or not isinstance(cfg.get(group), Mapping):
            continue
        try:
            read(cfg)
        except ConfigError as e:
            lines = str(e).split("\n  - ")
            errs += lines[1:] if len(lines) > 1 and lines[0].rstrip().endswith(":") else [str(e)]
    return errs

_NOT_GROUPS = ("hydra", "experiment")
_EXTRA_TOP = ("hydra", "local", "force")  # force: +force=[stage,...] of stage=all


def _options_of(group: str, conf: Path) -> dict[str, dict[str, Any]]:
    """``conf/<group>/*.yaml``: option -> its settings (``defaults`` dropped)."""
    out: dict[str, dict[str, Any]] = {}
    for f in sorted((conf / group).glob("*.yaml")):
        try:
            out[f.stem] = group_defaults(group, f.stem)
        except ConfigError:
            continue
    return out


def _top_keys(conf: Path) -> tuple[list[str], list[str]]:
    """``conf/config.yaml``'s own keys and the groups it composes."""
    import yaml

    try:
        data = yaml.safe_load((conf / "config.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"cannot read {conf / 'config.yaml'}: {e}") from e
    groups: list[str] = []
    for item in data.pop("defaults", None) or []:
        if isinstance(item, Mapping):
            for k in item:
                groups.append(str(k).removeprefix("optional ").removeprefix("override ").strip("/"))
    return [str(k) for k in data], groups


def _unknown(where: str, given: Mapping[str, Any], valid: set[str]) -> list[str]:
    return [
        f"{where}{key} is not a setting{closest(str(key), valid)}; valid: {', '.join(sorted(valid))}"
        for key in sorted(set(map(str, given)) - valid)
    ]


def key_problems(cfg: Mapping[str, Any], conf: Path | None = None) -> list[str]:
    """Unknown keys at the top level and in every config group (``[Note: up-front key check]``).

    Examples
    --------
    >>> key_problems({"runtime": {"max_infligth": 3}})[0].split(";")[0]
    "runtime.max_infligth is not a setting (did you mean 'max_inflight'?)"
    >>> key_problems({"sede": 1})[0].split(";")[0]
    "sede is not a setting (did you mean 'seed'?)"
    """
    try:
        conf = conf or conf_dir()
    except ConfigError:
        return []
    own, groups = _top_keys(conf)
    folders = {d.name for d in conf.iterdir() if d.is_dir() and d.name not in _NOT_GROUPS}
    errs = _unknown("", cfg, set(own) | set(groups) | folders | set(_EXTRA_TOP))
    for group in sorted(folders):
        node = cfg.get(group)
        if not isinstance(node, Mapping):
            continue
        options = _options_of(group, conf)
        if not options:
            continue
        named = [o for o in options.values() if "name" in o and o.get("name") == node.get("name")]
        pick = named or list(options.values())
        errs += _unknown(f"{group}.", node, {str(k) for o in pick for k in o})
        for key, value in node.items():
            nested = [o[key] for o in options.values() if isinstance(o.get(key), Mapping) and o[key]]
            if isinstance(value, Mapping) and nested:
                errs += _unknown(f"{group}.{key}.", value, {str(k) for n in nested for k in n})
    return errs


# ------------------------------------------------------------------------------ plan on the cluster


def plan_roles(plan: Plan) -> dict[int, str]:
    """MPI rank -> what it runs, for messages: ``{0: 'frontend, node 0', 1: 'component enc, replica 0, node 0'}``."""
    out = {}
    for r in plan.ranks:
        what = "frontend" if r.role == "frontend" else f"component {r.component}, replica {r.replica}"
        out[r.rank] = f"{what}, node {r.node}" + ("" if r.gpu is None else f", gpu {r.gpu}")
    return out


def plan_cluster_problems(plan: Plan, cluster: ClusterSpec) -> tuple[list[str], list[str]]:
    """What stops ``plan`` from running on ``cluster`` (refused), and what only makes it slow (warnings).

    Refused: more nodes than the cluster has, a CUDA plan on a CPU cluster, a GPU index the nodes do not
    have, a slice larger than the GPU's memory, one rank with more threads than a node has cores.
    Warned (they run, slower or with less headroom than the allocator assumed): the ranks of a node
    sharing more threads than it has cores (as ``allocate.cpu_oversubscribe`` allows), slices not in
    ``cluster.slices_gb``, the slices on one GPU adding up to more than its memory.
    """
    refuse: list[str] = []
    warn: list[str] = []
    name = cluster.name
    if plan.nodes > cluster.nodes:
        refuse.append(f"the plan uses {plan.nodes} node(s) but cluster {name!r} has {cluster.nodes}: "
                      f"allocate for this cluster (stage=allocate cluster={name}) or launch on a larger one")
    if plan.device_kind == "cuda" and not cluster.is_gpu:
        refuse.append(f"the plan is for GPUs (device_kind cuda) but cluster {name!r} has none "
                      "(gpus_per_node 0): allocate a CPU plan here, or pick the GPU cluster (cluster=...)")
    threads: dict[int, int] = {}
    per_gpu: dict[tuple[int, int], float] = {}
    for r in plan.ranks:
        where = f"plan rank {r.rank} ({r.component or r.role}, node {r.node})"
        threads[r.node] = threads.get(r.node, 0) + int(r.threads)
        if r.threads > cluster.cores_per_node:
            refuse.append(f"{where} asks for {r.threads} threads but a node of {name!r} has "
                          f"{cluster.cores_per_node} cores")
        if r.gpu is None or not cluster.is_gpu:
            continue
        if not 0 <= r.gpu < cluster.gpus_per_node:
            refuse.append(f"{where} uses gpu {r.gpu} but the nodes of {name!r} have {cluster.gpus_per_node} "
                          f"(0..{cluster.gpus_per_node - 1})")
        if r.slice_gb is not None:
            if r.slice_gb > cluster.gpu_mem_gb:
                refuse.append(f"{where}: slice {r.slice_gb:g} GB is larger than the {cluster.gpu_mem_gb:g} GB "
                              f"of a GPU of {name!r}")
            elif cluster.slices_gb and r.slice_gb not in cluster.slices_gb:
                warn.append(f"{where}: slice {r.slice_gb:g} GB is not one of cluster.slices_gb "
                            f"{list(cluster.slices_gb)}")
            per_gpu[(r.node, r.gpu)] = per_gpu.get((r.node, r.gpu), 0.0) + float(r.slice_gb)
    for node, n in sorted(threads.items()):
        if n > cluster.cores_per_node:
            warn.append(f"node {node}: the plan's ranks use {n} threads on {cluster.cores_per_node} cores "
                        "(oversubscribed: they share cores and run slower than predicted)")
    for (node, gpu), gb in sorted(per_gpu.items()):
        if gb > cluster.gpu_mem_gb + 1e-9:
            warn.append(f"node {node} gpu {gpu}: the plan's slices add up to {gb:g} GB on a {cluster.gpu_mem_gb:g} "
                        "GB GPU (ranks may run out of memory)")
    return refuse, warn


def check_plan_on_cluster(plan: Plan, cluster: ClusterSpec, echo: Callable[[str], None] = print) -> None:
    """Refuse a plan that cannot run on ``cluster``; echo a warning for each thing that only slows it.

    Raises
    ------
    PlanError
        Listing every reason the plan cannot run here.
    """
    refuse, warn = plan_cluster_problems(plan, cluster)
    for w in warn:
        echo(f"[hpcsplit] warning: {w}")
    if refuse:
        raise PlanError(f"this plan cannot run on cluster {cluster.name!r}:\n  - " + "\n  - ".join(refuse))
