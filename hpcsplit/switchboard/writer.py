"""Write a switchboard: capture, measure, partition, cut, re-export, save and verify.

``export`` is ``hpcsplit.export``; :mod:`hpcsplit.switchboard.reader` reads what it writes (see
docs/export.md).  The stage ``export`` (:func:`hpcsplit.switchboard.stage.run_export`) calls it.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

from hpcsplit.core.calibration import DEFAULT_GB_S, DEFAULT_GFLOPS, DEFAULT_HOP_MS
from hpcsplit.errors import PartitionError, SwitchboardError
from hpcsplit.switchboard import layout as L
from hpcsplit.switchboard.graph import ComputeGraph, capture, dataflow_graph, measure_nodes
from hpcsplit.switchboard.picture import write_picture
from hpcsplit.switchboard.reader import Switchboard
from hpcsplit.switchboard.regions import RuntimeCost, decide
from hpcsplit.switchboard.split import export_piece, functional, run_pieces, split_graph
from hpcsplit.switchboard.verify import compare_outputs

DEFAULT_ATOL = L.DEFAULT_ATOL
DEFAULT_RTOL = L.DEFAULT_RTOL
_LAYOUT = L.LAYOUT_FILE
_GOLDEN = L.GOLDEN_FILE

__all__ = ["export", "region_table"]

# Defaults of the benefit-vs-cost rule: the documented defaults of hpcsplit.core.calibration (the 2-core
# development VM's figures); stage=export takes a calibration's instead (stage=calibrate, docs/simulate.md)
COMPUTE_GFLOPS = DEFAULT_GFLOPS
TRANSPORT_GB_S = DEFAULT_GB_S
HOP_MS = DEFAULT_HOP_MS


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _shape(t: torch.Tensor, batch_dims: Sequence[int]) -> tuple[int | str, ...]:
    return tuple(L.BATCH if i in batch_dims else int(s) for i, s in enumerate(t.shape))


def _param_bytes(ep: Any) -> int:
    total = 0
    seen: set[int] = set()
    for t in list(ep.state_dict.values()) + list(getattr(ep, "constants", {}).values()):
        if isinstance(t, torch.Tensor) and id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def _arch_hash(cg: ComputeGraph) -> str:
    h = hashlib.sha256(cg.exported.graph_module.code.encode())
    for k, v in sorted(cg.exported.state_dict.items()):
        h.update(f"{k}:{tuple(v.shape)}:{v.dtype}".encode())
    return h.hexdigest()


# [Note: programs byte for byte]
# torch.export keeps, per graph node, where it came from: ``stack_trace`` (the source lines that made it, with
# this install's absolute paths) and, for a component cut out of the whole graph, ``from_node`` (the passes it
# went through, each naming its graph by ``id()``: a memory address of this process).  ``torch.export.save``
# writes both into the program's JSON, so the same model exported twice gave other bytes for every component,
# hence another switchboard sha256, and a profile or calibration of the first did not apply to the second.
# They are debugging provenance, read by nothing that runs a program; they are dropped before saving.
# The export's own durations vary from run to run too: they go to a side file beside layout.json
# (``export_times.json``), which the layout neither names nor hashes, like the picture.
_UNSTABLE_META = ("stack_trace", "from_node")
EXPORT_TIMES_FILE = "export_times.json"


def _save_program(ep: Any, path: Path) -> None:
    """``torch.export.save`` without the pickled example inputs (weights are raw bytes, graph JSON) and without
    the provenance that differs from process to process (``[Note: programs byte for byte]``)."""
    ep.example_inputs = None
    for gm in ep.graph_module.modules():
        if isinstance(gm, torch.fx.GraphModule):
            for node in gm.graph.nodes:
                for k in _UNSTABLE_META:
                    node.meta.pop(k, None)
    torch.export.save(ep, str(path))


# ---------------------------------------------------------------------------- export


def export(
    model: torch.nn.Module,
    args: Sequence[Any],
    kwargs: Mapping[str, Any] | None = None,
    *,
    out: str | Path,
    name: str | None = None,
    stages: int | None = None,
    max_stage_ms: float | None = None,
    atol: float = DEFAULT_ATOL,
    rtol: float = DEFAULT_RTOL,
    dynamic_batch: bool = True,
    timing_batch: int | None = None,
    timing_repeats: int = 3,
    cost: str = "measured",
    device: str | None = None,
    overwrite: bool = True,
    min_branch_fraction: float = 0.1,
    max_branches: int = 8,
    cut_slack: float = 0.25,
    min_component_fraction: float = 0.02,
    force: bool = False,
    compute_gflops: float = COMPUTE_GFLOPS,
    transport_gb_s: float = TRANSPORT_GB_S,
    hop_ms: float = HOP_MS,
    tie_margin: float = 0.25,
    constants: str = "",
) -> Switchboard:
    """Split ``model`` into components and write a verified switchboard to ``out``.

    Parameters
    ----------
    model, args, kwargs
        The model and example inputs (tensors; dim 0 is the batch).
    out
        Directory to write (replaced when ``overwrite``).
    name
        Model name in ``layout.json`` (default: the class name).
    stages, max_stage_ms
        Sequential cuts (see :func:`hpcsplit.switchboard.regions.partition`).
    atol, rtol
        Verification tolerance against the eager model's outputs.
    dynamic_batch
        One program for every batch size (``Dim("batch")`` on dim 0).
    timing_batch, timing_repeats, device
        The timing pass: batch (also the batch the split is decided at), passes, device.
    cost
        What balances sequential cuts and fills ``work_ms``: ``"measured"`` latency or ``"flops"``
        (at ``compute_gflops``). Regions and branches are always decided on FLOPs (deterministic).
    min_branch_fraction, min_component_fraction, max_branches, cut_slack, tie_margin
        The partition's options (see :func:`hpcsplit.switchboard.regions.decide`).
    force
        Split every region the structure allows, even when its benefit does not beat its cost.
    compute_gflops, transport_gb_s, hop_ms
        The benefit-vs-cost rule: FLOPs to ms, activation bytes to ms, ms per added component edge.
    constants
        Where those three figures come from (a calibration, the settings, the defaults): in the region table.
    overwrite
        Replace an existing switchboard at ``out``.

    Returns
    -------
    Switchboard
        The loaded result.

    Raises
    ------
    CaptureError, PartitionError, VerificationError
    """
    final = Path(out)
    _runtime_cost(compute_gflops, transport_gb_s, hop_ms, 1)  # bad figures fail before the capture
    if final.exists():
        _check_out(final, overwrite)
    t_start = time.perf_counter()
    phases: dict[str, float] = {}

    def lap(name: str, t0: list[float] = [t_start]) -> None:  # noqa: B006 - a running clock
        now = time.perf_counter()
        phases[name] = round(now - t0[0], 3)
        t0[0] = now

    cg = capture(model, args, kwargs, dynamic_batch=dynamic_batch)
    lap("capture")
    costs = measure_nodes(cg, batch_size=timing_batch, repeats=timing_repeats, device=device)
    lap("timing")
    g = dataflow_graph(cg, costs, cost=cost, compute_gflops=compute_gflops)
    partition_options: dict[str, Any] = {
        "min_branch_fraction": min_branch_fraction, "max_branches": max_branches, "cut_slack": cut_slack,
        "min_component_fraction": min_component_fraction, "force": force, "compute_gflops": compute_gflops,
        "transport_gb_s": transport_gb_s, "hop_ms": hop_ms, "tie_margin": tie_margin,
    }
    if constants:
        partition_options["constants"] = constants
    decision_batch = timing_batch or cg.batch_size
    runtime = _runtime_cost(compute_gflops, transport_gb_s, hop_ms, decision_batch)
    result = decide(
        g, stages=stages, max_stage_ms=max_stage_ms, min_branch_fraction=min_branch_fraction,
        max_branches=max_branches, cut_slack=cut_slack, min_component_fraction=min_component_fraction,
        runtime=runtime, force=force, tie_margin=tie_margin,
    )
    comps = result.components
    lap("partition")
    split = split_graph(cg, comps)
    # golden activations: run the pieces as fx modules on the capture inputs
    env = dict(zip(split.input_names, cg.flat_inputs, strict=True))
    with torch.no_grad():
        run_pieces(
            [p.module for p in split.pieces], [(p.input_names, p.output_names) for p in split.pieces], env
        )
        a, k = pytree.tree_unflatten(list(cg.flat_inputs), cg.in_spec)  # capture may have tiled a batch of 1
        reference = model(*a, **k)
    ref_flat = [t.detach().contiguous() for t in pytree.tree_flatten(reference)[0]]

    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=final.parent))
    tmp.chmod(0o755)
    try:
        (tmp / "programs").mkdir()
        comp_specs = []
        for p in split.pieces:
            ep = export_piece(p, [env[n] for n in p.input_names], dynamic_batch=dynamic_batch)
            rel = f"programs/{p.name}.pt2"
            _save_program(ep, tmp / rel)
            comp_specs.append(
                L.ComponentSpec(
                    name=p.name,
                    kind=p.kind,
                    inputs=tuple(
                        L.spec_of(n, _dtype_name(env[n]), _shape(env[n], d))
                        for n, d in zip(p.input_names, p.batch_dims, strict=True)
                    ),
                    outputs=tuple(
                        L.spec_of(n, _dtype_name(env[n]), _shape(env[n], d))
                        for n, d in zip(p.output_names, p.out_batch_dims, strict=True)
                    ),
                    param_bytes=_param_bytes(ep),
                    work_ms=round(p.work, 6) if cost == "measured" else 0.0,
                    program=rel,
                    sha256=L.sha256_file(tmp / rel),
                    file_bytes=(tmp / rel).stat().st_size,
                )
            )
        lap("cut_and_export_components")
        _save_program(functional(cg.exported), tmp / "programs" / "whole.pt2")
        whole = _ref(tmp, "programs/whole.pt2")
        golden = _write_golden(tmp / _GOLDEN, cg, split, env, ref_flat, comp_specs)
        layout = L.Layout(
            schema_version=L.SCHEMA_VERSION,
            model=name or cg.model_name,
            arch_hash=_arch_hash(cg),
            inputs=tuple(
                L.spec_of(n, _dtype_name(t), _shape(t, (0,) if dynamic_batch and t.dim() else ()))
                for n, t in zip(cg.input_names, cg.flat_inputs, strict=True)
            ),
            input_spec=pytree.treespec_dumps(cg.in_spec),
            outputs=tuple(
                L.spec_of(n, _dtype_name(t), _shape(t, _out_batch_dims(split, v, comp_specs)))
                for n, t, v in zip(cg.output_names, ref_flat, split.output_values, strict=True)
            ),
            output_values=split.output_values,
            output_spec=pytree.treespec_dumps(cg.out_spec),
            components=tuple(comp_specs),
            edges=_edges(cg, split, comp_specs),
            order=tuple(c.name for c in comp_specs),
            whole=whole,
            whole_param_bytes=_param_bytes(cg.exported),
            golden=golden,
            golden_batch_size=cg.batch_size,
            dynamic_batch=dynamic_batch,
            verification={},
            partition={
                "stages": stages,
                "max_stage_ms": max_stage_ms,
                "cost": cost,
                "options": dict(partition_options),
                "graph_nodes": g.number_of_nodes() - len(result.dead),
                "dead_nodes": len(result.dead),
                "decision_batch": decision_batch,
                "total_flops": sum(w for v, w in g.nodes(data="work") if v not in set(result.dead)),
                "regions": [d.to_json() for d in result.decisions],
                "stage_cuts": [c.to_json() for c in result.stage_cuts],
            },
            torch_version=torch.__version__,
        )
        layout.write(tmp / _LAYOUT)
        sb = Switchboard.load(tmp)
        lap("write")
        report = sb.verify(atol, rtol)
        lap("verify_components")
        whole_rep = compare_outputs(sb.load_whole()(*sb.example_inputs()), sb.golden_outputs(), atol, rtol)
        lap("verify_whole")
        verification = {**report.to_json(), "whole_max_abs_diff": whole_rep.max_abs_diff}
        times = {"export_seconds": time.perf_counter() - t_start, "verify_seconds": verification.pop("seconds"),
                 "phases_s": phases}
        d = json.loads((tmp / _LAYOUT).read_text())
        d["verification"] = verification
        (tmp / _LAYOUT).write_text(json.dumps(d, indent=2) + "\n")
        (tmp / EXPORT_TIMES_FILE).write_text(json.dumps(times, indent=2) + "\n")  # a side file: not hashed
        write_picture(tmp)  # a side file, not in the layout ([Note: the picture is a side file])
        if final.exists():
            _check_out(final, overwrite)
            shutil.rmtree(final)
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Switchboard.load(final)


def _check_out(final: Path, overwrite: bool) -> None:
    """Only an existing switchboard (or an empty folder) may be replaced, and only with ``overwrite``."""
    is_switchboard = (final / _LAYOUT).is_file() or (final.is_dir() and not any(final.iterdir()))
    if not overwrite or not is_switchboard:
        raise SwitchboardError(
            f"found existing {final}"
            + ("" if is_switchboard else " (not a switchboard: no layout.json)")
            + "; needed a new or switchboard directory (and overwrite=True); choose another `out`"
        )


def _ref(root: Path, rel: str) -> L.FileRef:
    return L.FileRef(rel, L.sha256_file(root / rel), (root / rel).stat().st_size)


def _out_batch_dims(split: Any, value: str, comps: Sequence[L.ComponentSpec]) -> tuple[int, ...]:
    for c in comps:
        for t in c.outputs:
            if t.name == value:
                return t.batch_dims
    return (0,) if split.input_names and value in split.input_names else ()


def _write_golden(
    path: Path, cg: ComputeGraph, split: Any, env: dict, ref_flat: list, comps: list
) -> L.FileRef:
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    for n, t in zip(cg.input_names, cg.flat_inputs, strict=True):
        tensors[f"input.{n}"] = t.detach().contiguous().clone()
    for n, t in zip(cg.output_names, ref_flat, strict=True):
        tensors[f"output.{n}"] = t.clone()
    inputs = set(cg.input_names)
    for c in comps:
        for t in c.inputs:
            if t.name not in inputs:
                tensors[f"act.{t.name}"] = env[t.name].detach().contiguous().clone()
    save_file(tensors, str(path))
    return _ref(path.parent, path.name)


def _edges(cg: ComputeGraph, split: Any, comps: Sequence[L.ComponentSpec]) -> tuple[L.Edge, ...]:
    producer = {n: "input" for n in cg.input_names}
    edges = []
    for c in comps:
        for t in c.inputs:
            edges.append(L.Edge(producer[t.name], t.name, c.name, t.name))
        for t in c.outputs:
            producer[t.name] = c.name
    for n, v in zip(cg.output_names, split.output_values, strict=True):
        edges.append(L.Edge(producer[v], v, "output", n))
    return tuple(edges)



def _runtime_cost(compute_gflops: float, transport_gb_s: float, hop_ms: float, batch: int) -> RuntimeCost:
    for name, v in (("compute_gflops", compute_gflops), ("transport_gb_s", transport_gb_s)):
        if not (isinstance(v, int | float) and v > 0):
            raise PartitionError(f"found {name}={v!r}; needed a positive number")
    if not (isinstance(hop_ms, int | float) and hop_ms >= 0):
        raise PartitionError(f"found hop_ms={hop_ms!r}; needed a number >= 0")
    return RuntimeCost(
        ms_per_work=1.0 / (compute_gflops * 1e6),
        ms_per_byte=batch / (transport_gb_s * 1e6),
        hop_ms=float(hop_ms),
    )


def _human_flops(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.3g}"


def _absorbed(items: Sequence[Any]) -> str:
    """``entry 4 (216k)``: how many small branches joined each side, and their FLOPs."""
    sides: dict[str, list[float]] = {}
    for side, w in items:
        sides.setdefault(str(side), []).append(float(w))
    return ", ".join(f"{s} {len(ws)} ({_human_flops(sum(ws))})" for s, ws in sides.items()) or "-"


def region_table(partition: Mapping[str, Any]) -> str:
    """Why each candidate region was or was not split: ``layout.json``'s ``partition`` as text.

    One row per region: entry -> exit, the kept branches' FLOPs, the absorbed small branches (side and
    FLOPs), the bytes per sample that would cross, benefit and cost in ms, and the decision.
    """
    regions = list(partition.get("regions") or [])
    batch = partition.get("decision_batch")
    head = f"regions (decided on FLOPs at batch {batch}; cost = added edges x hop + crossing bytes / bandwidth)"
    opts = partition.get("options") or {}
    if opts.get("constants"):
        head += (f"\n  {opts['constants']}: hop {float(opts.get('hop_ms', math.nan)):.3g} ms, "
                 f"{float(opts.get('transport_gb_s', math.nan)):.3g} GB/s, "
                 f"{float(opts.get('compute_gflops', math.nan)):.3g} GFLOP/s")
    if not regions:
        return head + "\n  none: the graph has no parallel branches" + _stage_cut_table(partition)
    rows = [("region", "branch FLOPs", "absorbed", "crossing B/sample", "benefit ms", "cost ms", "decision")]
    for d in regions:
        costed = bool(d.get("added_edges") or d.get("cost_ms") or d.get("benefit_ms"))
        rows.append((
            f"{d.get('entry') or 'inputs'} -> {d.get('exit') or 'outputs'} ({d.get('kind')})",
            " | ".join(_human_flops(float(w)) for w in d.get("branch_work") or []) or "-",
            _absorbed(d.get("absorbed") or []),
            str(d.get("crossing_bytes", 0)) if costed else "-",
            f"{float(d.get('benefit_ms', 0.0)):.3g}" if costed else "-",
            f"{float(d.get('cost_ms', 0.0)):.3g} ({d.get('added_edges', 0)} edges)" if costed else "-",
            ("split: " if d.get("split") else "whole: ") + str(d.get("reason", "")),
        ))
    return head + "\n" + _columns(rows) + _stage_cut_table(partition)


def _columns(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  " + "  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def _stage_cut_table(partition: Mapping[str, Any]) -> str:
    """The stage cuts asked for (``partition.stages``/``max_stage_ms``): made or not, and why."""
    cuts = list(partition.get("stage_cuts") or [])
    if not cuts:
        return ""
    rows = [("stages of", "asked", "made", "cut first at (towers)", "slowest stage ms", "whole ms", "decision")]
    for c in cuts:
        rows.append((str(c.get("component")), str(c.get("requested")), str(c.get("made")),
                     ", ".join(c.get("towers") or []) or "-", f"{float(c.get('slowest_ms', 0.0)):.3g}",
                     f"{float(c.get('whole_ms', 0.0)):.3g}", str(c.get("reason", ""))))
    return "\nstage cuts (a pipeline serves at its slowest stage: compute + hop + received bytes)\n" + _columns(rows)
