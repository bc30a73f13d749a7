"""Write a switchboard: capture, measure, partition, cut, re-export, save and verify.

``export`` is ``hpcsplit.export``; :mod:`hpcsplit.switchboard.reader` reads what it writes (see
docs/export.md).  The stage ``export`` (:func:`hpcsplit.switchboard.stage.run_export`) calls it.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

from hpcsplit.errors import SwitchboardError
from hpcsplit.switchboard import layout as L
from hpcsplit.switchboard.graph import ComputeGraph, capture, dataflow_graph, measure_nodes
from hpcsplit.switchboard.reader import Switchboard
from hpcsplit.switchboard.regions import find_regions, partition
from hpcsplit.switchboard.split import export_piece, run_pieces, split_graph
from hpcsplit.switchboard.verify import compare_outputs

DEFAULT_ATOL = L.DEFAULT_ATOL
DEFAULT_RTOL = L.DEFAULT_RTOL
_LAYOUT = L.LAYOUT_FILE
_GOLDEN = L.GOLDEN_FILE

__all__ = ["export"]


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


def _save_program(ep: Any, path: Path) -> None:
    """``torch.export.save`` without the pickled example inputs (weights are raw bytes, graph JSON)."""
    ep.example_inputs = None
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
    min_branch_fraction: float = 0.05,
    max_branches: int = 8,
    cut_slack: float = 0.25,
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
    timing_batch, timing_repeats, cost, device
        The timing pass: batch, passes, ``"measured"`` latency or ``"flops"``, device.
    min_branch_fraction, max_branches, cut_slack
        The partition's options (see :func:`hpcsplit.switchboard.regions.partition`).
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
    g = dataflow_graph(cg, costs, cost=cost)
    partition_options: dict[str, Any] = {
        "min_branch_fraction": min_branch_fraction, "max_branches": max_branches, "cut_slack": cut_slack
    }
    regions = find_regions(g, min_branch_fraction=min_branch_fraction, max_branches=max_branches)
    comps = partition(
        g, stages=stages, max_stage_ms=max_stage_ms, min_branch_fraction=min_branch_fraction,
        max_branches=max_branches, cut_slack=cut_slack,
    )
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
        _save_program(cg.exported, tmp / "programs" / "whole.pt2")
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
                "graph_nodes": g.number_of_nodes(),
                "total_work": sum(w for _, w in g.nodes(data="work")),
                "regions": [
                    {
                        "entry": r.entry,
                        "exit": r.exit,
                        "kind": r.kind,
                        "branch_sizes": [len(b) for b in r.branches],
                        "benefit": r.benefit,
                    }
                    for r in regions
                ],
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
        verification = {
            **report.to_json(),
            "whole_max_abs_diff": whole_rep.max_abs_diff,
            "export_seconds": time.perf_counter() - t_start,
            "phases_s": phases,
        }
        d = json.loads((tmp / _LAYOUT).read_text())
        d["verification"] = verification
        (tmp / _LAYOUT).write_text(json.dumps(d, indent=2) + "\n")
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

