"""``stage=all``: the stage table's ``in_all`` stages (export -> profile -> analyze -> allocate -> bench),
resumable, with ``summary.md``.

[Note: pipeline manifest]
``RUN_DIR/manifest.json`` records, per stage, the sha256 of its inputs (earlier stages' output
hashes and the config sections that change its result), the sha256 of its output, its status and
its result.  A stage is skipped when its status is ``done``, its inputs hash is unchanged and its
output still hashes to what was recorded; any change re-runs it and, because later stages hash
its output, everything after it.  Inputs per stage:

* export: ``model``, ``partition``, ``verify``, the calibration file's sha256 (the split rule reads it); output:
  sha256 of ``switchboard/layout.json``
  (= ``Switchboard.sha256``; every file ``layout.json`` records is checked against its size and
  sha256 before a reused switchboard is trusted);
* profile: switchboard hash, ``profile`` (grid, iterations, device), the cluster's hardware keys;
  output: sha256 of the HDF5 file (only a *complete* profile counts as done; an incomplete one is
  resumed by the profiler itself);
* analyze: profile hash; output: the analysis folder's table;
* allocate: profile hash, ``allocate``, the cluster without its ``slurm`` block, the calibration file's sha256
  (with ``allocate.rate_rps`` also ``runtime``, the switchboard's hash and whether the ranks are bound to cores,
  ``simulate.bind`` or ``launcher.mpiexec_args``: the choice simulates them); output: plan hash;
* bench: plan hash, switchboard hash, ``bench``, ``runtime``, launcher and cluster names.

File names come from :class:`~hpcsplit.core.paths.RunPaths`.  Continuing a run folder: ``resume=RUN_DIR`` (rewritten to ``hydra.run.dir=RUN_DIR`` by
:func:`hpcsplit.launch.config.rewrite_argv`); ``+force=[profile]`` (or ``+force=all``) re-runs named stages.
"""

from __future__ import annotations

import copy
import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hpcsplit.core.paths import RunPaths
from hpcsplit.core.sim_model import binds_cores
from hpcsplit.errors import ConfigError, HpcsplitError, LaunchError, ProfileError
from hpcsplit.launch.stages import PIPELINE
from hpcsplit.launch.summary import plots_of, write_summary
from hpcsplit.switchboard import layout as L

__all__ = ["PIPELINE", "load_manifest", "run_pipeline"]

_SCHEMA = 1
_HW_KEYS = ("name", "nodes", "gpus_per_node", "gpu_name", "gpu_mem_gb", "slices_gb", "mig_profiles",
            "cores_per_node", "mem_gb_per_node", "cpu_threads")
_PROFILE_SKIP = ("path", "progress", "analysis_dir", "ranks")

Echo = Callable[[str], None]


def _sha_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def _sha_file(path: Path) -> str | None:
    if not path.is_file():
        return None
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def load_manifest(path: Path) -> dict[str, Any]:
    """The manifest at ``path`` (``RunPaths.manifest``; an empty one when there is none or it is unreadable)."""
    try:
        m = json.loads(Path(path).read_text())
        if isinstance(m, dict) and m.get("schema_version") == _SCHEMA and isinstance(m.get("stages"), dict):
            return m
    except (OSError, ValueError):
        pass
    return {"schema_version": _SCHEMA, "stages": {}}


def _save_manifest(path: Path, m: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(m, indent=2, default=str))
    tmp.replace(path)


class _Files:
    """What each stage of the pipeline reads and writes (given inputs win over the run folder's)."""

    def __init__(self, cfg: dict[str, Any], run_dir: Path) -> None:
        self.paths = RunPaths.from_config(cfg, run_dir)
        self.switchboard = self.paths.switchboard
        self.sb_given = self.paths.switchboard_given
        self.profile = self.paths.profile
        self.plan = self.paths.own_plan  # bench serves the plan this run's allocate wrote
        self.analysis = self.paths.analysis_dir
        self.bench_summary = self.paths.bench_summary


def _inputs(stage: str, cfg: dict[str, Any], out_sha: dict[str, str | None], p: _Files) -> dict[str, Any]:
    cluster = dict(cfg.get("cluster") or {})
    if stage == "export":  # the split rule reads the calibration (a run folder's or calibration=PATH)
        return {**{k: cfg.get(k) for k in ("model", "partition", "verify")},
                "calibration": _sha_file(p.paths.calibration)}
    if stage == "profile":
        prof = {k: v for k, v in (cfg.get("profile") or {}).items() if k not in _PROFILE_SKIP}
        return {"switchboard": out_sha["export"], "profile": prof, "cluster": {k: cluster.get(k) for k in _HW_KEYS}}
    if stage == "analyze":
        return {"profile": out_sha["profile"]}
    if stage == "allocate":  # the time-sharing pass and allocate.rate_rps read the calibration
        cluster.pop("slurm", None)
        out = {"profile": out_sha["profile"], "allocate": cfg.get("allocate"), "cluster": cluster,
               "calibration": _sha_file(p.paths.calibration)}
        if (cfg.get("allocate") or {}).get("rate_rps") is not None:  # it simulates the runtime's policy, dataflow
            out.update(runtime=cfg.get("runtime"), switchboard=out_sha["export"], bind_cores=binds_cores(cfg))
        return out
    return {
        "plan": out_sha["allocate"],
        "switchboard": out_sha["export"],
        "bench": cfg.get("bench"),
        "runtime": cfg.get("runtime"),
        "launcher": (cfg.get("launcher") or {}).get("name"),
        "cluster": cluster.get("name"),
    }


def _output_sha(stage: str, p: _Files) -> str | None:
    if stage == "export":
        return _sha_file(p.switchboard / L.LAYOUT_FILE)
    if stage == "profile":
        return _sha_file(p.profile)
    if stage == "analyze":
        tables = sorted(p.analysis.glob("*.md")) if p.analysis.is_dir() else []
        return _sha_file(tables[0]) if tables else None
    if stage == "allocate":
        return _sha_file(p.plan)
    return _sha_file(p.bench_summary)


def _forced(cfg: dict[str, Any]) -> set[str]:
    f = cfg.get("force")
    if f in (None, False, "", []):
        return set()
    names = {str(f)} if isinstance(f, str | bool) else {str(x) for x in f}
    if names & {"all", "True", "true"}:
        return set(PIPELINE)
    unknown = names - set(PIPELINE)
    if unknown:
        raise ConfigError(f"force = {sorted(unknown)}: needs stage names from {list(PIPELINE)} or 'all'")
    return names


def _check_reused_switchboard(p: _Files, echo: Echo) -> None:
    """Every file ``layout.json`` records has its recorded size and sha256 (``Switchboard.load(check_all=True)``'s
    file checks, without importing torch into this process); raises SwitchboardError naming the bad file."""
    layout = L.read_layout(p.switchboard / L.LAYOUT_FILE)
    for c in layout.components:
        L.check_file(p.switchboard, c, f"program of component {c.name!r}", full=True)
    L.check_file(p.switchboard, layout.whole, "whole-model program", full=True)
    L.check_file(p.switchboard, layout.golden, "golden", full=True)
    echo(f"[hpcsplit] switchboard {p.switchboard}: every file matches layout.json")


def _set_aside_old_profile(p: _Files, prev: dict[str, Any], inputs_sha: str, forced: bool, run_dir: Path,
                           echo: Echo) -> None:
    """A profile of other inputs (or a forced re-run) is renamed, never resumed into or deleted.

    The same inputs (an interrupted profile) are left in place: the profiler resumes them.
    """
    old_inputs = prev.get("inputs_sha256")
    if not p.profile.exists() or p.profile.parent != run_dir or not (forced or old_inputs not in (None, inputs_sha)):
        return
    keep = p.profile.with_name(f"{p.profile.stem}.{str(old_inputs or 'old')[:8]}{p.profile.suffix}")
    p.profile.replace(keep)
    for part in p.profile.parent.glob(p.profile.name + ".part*"):
        part.replace(keep.with_name(keep.name + part.name[len(p.profile.name):]))
    echo(f"[hpcsplit] the profile's inputs changed{' (forced)' if forced else ''}: kept the old one as {keep}")


def _stage_cfg(stage: str, cfg: dict[str, Any], p: _Files) -> dict[str, Any]:
    c = copy.deepcopy(cfg)
    c["stage"] = "bench" if stage == "bench" else stage
    if stage != "export":
        c["switchboard"] = str(p.switchboard)
    if stage in ("analyze", "allocate", "bench") and isinstance(c.get("profile"), dict):
        c["profile"]["path"] = str(p.profile)
    if stage == "bench":
        c["plan"] = str(p.plan)
    return c


def _check_result(stage: str, result: Any, p: _Files, run_dir: Path) -> None:
    if stage == "profile" and isinstance(result, dict) and not result.get("complete", True):
        raise ProfileError(
            f"the profile stopped before the end: {result.get('cells_missing')} of {result.get('cells_total')} "
            f"cells still missing in {p.profile} (interrupted: {result.get('interrupted')}). What was measured "
            f"is kept: run the same command with resume={run_dir} to measure only the missing cells."
        )


def run_pipeline(cfg: dict[str, Any], run_dir: Path, echo: Echo, run_stage: Callable[..., Any]) -> dict[str, Any]:
    """Run every stage of ``stage=all`` that is not up to date; write ``manifest.json`` and ``summary.md``.

    Parameters
    ----------
    cfg : dict
        The resolved, validated config.
    run_dir : Path
        The run folder (may hold an earlier run: its up-to-date stages are skipped).
    echo : callable
        Where progress lines go.
    run_stage : callable
        ``run_stage(stage, cfg, run_dir, echo)`` of :mod:`hpcsplit.launch.app` (runs one stage).

    Returns
    -------
    dict
        ``stages`` (each stage's result), ``skipped`` (stage -> why), ``summary`` (path), ``plots``.

    Raises
    ------
    HpcsplitError
        The failing stage's error, with a line saying how to resume; ``summary.md`` and the
        manifest are written first.
    """
    p = _Files(cfg, run_dir)
    m = load_manifest(p.paths.manifest)
    m.update(
        model=(cfg.get("model") or {}).get("name"),
        launcher=(cfg.get("launcher") or {}).get("name"),
        cluster=(cfg.get("cluster") or {}).get("name"),
    )
    forced = _forced(cfg)
    out_sha: dict[str, str | None] = {}
    results: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    failure: str | None = None
    try:
        for stage in PIPELINE:
            inputs_sha = _sha_json(_inputs(stage, cfg, out_sha, p))
            prev = m["stages"].get(stage) or {}
            have = _output_sha(stage, p)
            if stage == "export" and p.sb_given:
                _check_reused_switchboard(p, echo)
                out_sha[stage] = have
                skipped[stage] = f"switchboard={p.switchboard} given"
                echo(f"[hpcsplit] stage export: skipped ({skipped[stage]})")
                m["stages"][stage] = {"status": "given", "inputs_sha256": inputs_sha, "outputs_sha256": have}
                continue
            up_to_date = (
                stage not in forced
                and prev.get("status") == "done"
                and prev.get("inputs_sha256") == inputs_sha
                and have is not None
                and prev.get("outputs_sha256") == have
            )
            if up_to_date:
                if stage == "export":
                    _check_reused_switchboard(p, echo)
                out_sha[stage] = have
                results[stage] = prev.get("result")
                skipped[stage] = "inputs unchanged"
                echo(f"[hpcsplit] stage {stage}: up to date (inputs {inputs_sha[:12]} unchanged); skipped")
                continue
            if stage == "profile":
                _set_aside_old_profile(p, prev, inputs_sha, stage in forced, run_dir, echo)
            m["stages"][stage] = {"status": "running", "inputs_sha256": inputs_sha, "started": time.time()}
            _save_manifest(p.paths.manifest, m)
            t0 = time.monotonic()
            echo(f"[hpcsplit] stage {stage}: starting")
            try:
                result = run_stage(stage, _stage_cfg(stage, cfg, p), run_dir, echo)
                _check_result(stage, result, p, run_dir)
            except BaseException as e:
                m["stages"][stage].update(status="failed", error=f"{type(e).__name__}: {e}"[:2000],
                                          wall_s=time.monotonic() - t0)
                raise
            wall = time.monotonic() - t0
            echo(f"[hpcsplit] stage {stage}: done in {wall:.1f} s")
            out_sha[stage] = _output_sha(stage, p)
            if out_sha[stage] is None:
                raise LaunchError(f"stage {stage} finished but wrote no output where the pipeline expects it "
                                  f"({p.switchboard if stage == 'export' else p.profile if stage == 'profile' else run_dir})")
            m["stages"][stage] = {"status": "done", "inputs_sha256": inputs_sha, "outputs_sha256": out_sha[stage],
                                  "wall_s": wall, "finished": time.time(), "result": result}
            results[stage] = result
            _save_manifest(p.paths.manifest, m)
    except HpcsplitError as e:
        failure = f"{type(e).__name__}: {e}"
        hint = (f"\n\nResults so far are kept in {run_dir} (see {p.paths.summary.name}, {p.paths.manifest.name}). After fixing "
                f"the problem, continue with the same command plus resume={run_dir}: finished stages are skipped.")
        try:
            again = type(e)(f"{e}{hint}")
        except Exception:  # noqa: BLE001 - an error class with another signature: keep it as it is
            raise e from None
        raise again from e
    except KeyboardInterrupt:
        failure = "interrupted (Ctrl-C)"
        raise
    except Exception as e:  # a bug, not a bad input: still keep the summary of what is there
        failure = f"{type(e).__name__}: {e}"
        raise
    finally:
        _save_manifest(p.paths.manifest, m)
        summary = write_summary(p.paths, m, switchboard=p.switchboard if p.switchboard.is_dir() else None,
                                profile=p.profile, plan=p.plan, bench_result=results.get("bench"),
                                failure=failure)
        echo(f"[hpcsplit] summary: {summary}")
    plots = [str(x) for x in plots_of(p.paths)]
    if plots:
        echo("[hpcsplit] plots:\n" + "\n".join(f"  {x}" for x in plots))
    return {"stages": results, "skipped": skipped, "summary": str(summary), "plots": plots}
