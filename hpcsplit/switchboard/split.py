"""Cut a captured ``GraphModule`` into pieces along a partition and re-export each piece.

[Note: cutting the graph]
- Data nodes take the index of their component. Tensor nodes with no data (see [Note: data
  nodes] in capture.py: ``get_attr`` results, ``arange`` positions, ``logit_scale.exp()``) take the
  earliest component among their users, so no cycle appears (so does a data node read only for
  its shape); dead nodes (asserts, ``_guards_fn``, values no model output uses) are dropped.
- Parameters are copied into every piece that reads them (``torch.fx.passes.split_module`` would
  turn them into piece inputs instead, so the cut is done here, node by node).
- Symbolic sizes (``sym_size`` and arithmetic on it) never cross between pieces: each piece
  recomputes the sizes it needs from the shape of one of its own tensor inputs that carries the
  same symbol (the batch), falling back to the original tensor as an extra input.
- Each piece is exported again with ``Dim("batch")`` on every input dim whose size is the batch
  symbol, from activations recorded under ``torch.no_grad()`` (not ``inference_mode``).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import sympy
import torch
from torch import fx

from hpcsplit.errors import PartitionError
from hpcsplit.switchboard.graph import ComputeGraph, live_data_nodes
from hpcsplit.switchboard.regions import Component

__all__ = ["Piece", "SplitResult", "export_piece", "functional", "run_pieces", "split_graph"]


@dataclass(frozen=True, slots=True)
class Piece:
    """One component cut out of the graph: a ``GraphModule`` from tensors to a tuple of tensors.

    ``input_names``/``output_names`` are value names (fx node names of the captured graph);
    ``batch_dims[i]`` lists the dims of input ``i`` whose size is the batch.
    """

    name: str
    kind: str
    work: float
    module: fx.GraphModule
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    batch_dims: tuple[tuple[int, ...], ...]
    out_batch_dims: tuple[tuple[int, ...], ...]


@dataclass(frozen=True, slots=True)
class SplitResult:
    """All pieces in run order and, for each flat model output, the value that feeds it."""

    pieces: tuple[Piece, ...]
    input_names: tuple[str, ...]
    output_values: tuple[str, ...]


def _expr(v: Any) -> Any:
    return v.node.expr if isinstance(v, torch.SymInt) else None


def _is_sym_node(n: fx.Node) -> bool:
    return isinstance(n.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool))


def _batch_symbol(gm: fx.GraphModule) -> Any:
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            val = n.meta.get("val")
            if isinstance(val, torch.Tensor) and val.dim() and isinstance(_expr(val.shape[0]), sympy.Symbol):
                return _expr(val.shape[0])
    return None


def _dims_with(val: Any, expr: Any) -> list[int]:
    if expr is None or not isinstance(val, torch.Tensor):
        return []
    return [k for k, s in enumerate(val.shape) if _expr(s) == expr]


def _drop_dead(gm: fx.GraphModule) -> None:
    for n in reversed(list(gm.graph.nodes)):
        if n.op in ("call_function", "call_method", "call_module") and not n.users:
            gm.graph.erase_node(n)


def _assign(gm: fx.GraphModule, components: Sequence[Component]) -> dict[str, int]:
    keep = live_data_nodes(gm)  # a data node read only for its shape goes with its users, as a size does
    part: dict[str, int] = {}
    for i, c in enumerate(components):
        for v in c.nodes:
            part[str(v)] = i
    last = len(components) - 1
    for n in reversed(list(gm.graph.nodes)):
        if n.op in ("placeholder", "get_attr", "output") or n.name in part or _is_sym_node(n):
            continue
        if n.name in keep:
            raise PartitionError(
                f"found data node {n.name!r} in no component; needed every data node assigned"
            )
        users = [part[u.name] for u in n.users if u.name in part]
        if not users:  # used only by symbolic-size nodes or the output
            users = [part[w.name] for u in n.users for w in u.users if w.name in part] or [last]
        part[n.name] = min(users)
    return part


def _sym_sources(n: fx.Node, acc: list[fx.Node]) -> None:
    """The ``sym_size`` nodes a symbolic-size node is computed from."""
    if n.op == "call_function" and n.target is torch.ops.aten.sym_size.int:
        acc.append(n)
        return
    for a in n.all_input_nodes:
        if _is_sym_node(a):
            _sym_sources(a, acc)


def _build_piece(
    gm: fx.GraphModule, members: list[fx.Node], part: dict[str, int], idx: int, bsym: Any
) -> tuple:
    inside = {n.name for n in members}
    externals: dict[str, fx.Node] = {}
    syms: list[fx.Node] = []
    for n in members:
        for a in n.all_input_nodes:
            if a.name in inside or a.op == "get_attr":
                continue
            if _is_sym_node(a):
                _sym_sources(a, syms)
            else:
                externals.setdefault(a.name, a)
    # a sym_size needs a tensor in this piece carrying the same symbol
    for s in syms:
        src: Any = s.args[0]
        expr = _expr(s.meta.get("val"))
        ok = src.name in inside or src.name in externals
        ok = ok or any(_dims_with(e.meta.get("val"), expr) for e in externals.values())
        if not ok:
            externals.setdefault(src.name, src)
    g = fx.Graph()
    env: dict[str, fx.Node] = {}
    order = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    inputs = sorted(externals.values(), key=lambda n: order[n.name])
    for e in inputs:
        ph = g.placeholder(e.name)
        ph.meta = dict(e.meta)
        env[e.name] = ph

    def get(a: fx.Node) -> fx.Node:
        if a.name in env:
            return env[a.name]
        if a.op == "get_attr":
            env[a.name] = g.get_attr(a.target)  # type: ignore[arg-type]
            env[a.name].meta = dict(a.meta)
        elif a.op == "call_function" and a.target is torch.ops.aten.sym_size.int and a.name not in inside:
            src: Any = a.args[0]
            expr = _expr(a.meta.get("val"))
            if src.name not in env:
                for e in inputs:
                    dims = _dims_with(e.meta.get("val"), expr)
                    if dims:
                        src, a_dim = e, dims[0]
                        break
                else:  # pragma: no cover - externals were extended above
                    raise PartitionError(f"no tensor carries the size {a.name} ({expr})")
                env[a.name] = g.call_function(torch.ops.aten.sym_size.int, (env[src.name], a_dim))
            else:
                env[a.name] = g.call_function(torch.ops.aten.sym_size.int, (env[src.name], a.args[1]))
            env[a.name].meta = dict(a.meta)
        elif _is_sym_node(a) and a.name not in inside:
            for b in a.all_input_nodes:
                get(b)
            env[a.name] = g.node_copy(a, lambda b: env[b.name])
        else:
            raise PartitionError(f"value {a.name!r} is needed before it is computed; report this model")
        return env[a.name]

    for n in members:
        for a in n.all_input_nodes:
            get(a)
        env[n.name] = g.node_copy(n, lambda b: env[b.name])
    outputs = []
    for n in members:
        if _is_sym_node(n) or not isinstance(n.meta.get("val"), (torch.Tensor, tuple, list)):
            continue
        if any(u.op == "output" or part.get(u.name, idx) != idx for u in n.users):
            outputs.append(n)
    g.output(tuple(env[n.name] for n in outputs))
    module = fx.GraphModule(gm, g)
    in_dims = tuple(tuple(_dims_with(e.meta.get("val"), bsym)) for e in inputs)
    out_dims = tuple(tuple(_dims_with(n.meta.get("val"), bsym)) for n in outputs)
    return module, tuple(e.name for e in inputs), tuple(n.name for n in outputs), in_dims, out_dims


def split_graph(cg: ComputeGraph, components: Sequence[Component]) -> SplitResult:
    """Cut ``cg`` into one ``GraphModule`` per component (see [Note: cutting the graph]).

    Raises
    ------
    PartitionError
        When a value would be needed before it is computed, or a component yields no output.
    """
    gm = cg.exported.module()  # a fresh copy to cut; cg.module stays as captured
    if [n.name for n in gm.graph.nodes] != [n.name for n in cg.module.graph.nodes]:  # pragma: no cover
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            gm = copy.deepcopy(cg.module)
    _drop_dead(gm)
    bsym = _batch_symbol(gm) if cg.dynamic_batch else None
    part = _assign(gm, components)
    members: list[list[fx.Node]] = [[] for _ in components]
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "get_attr", "output") or _is_sym_node(n):
            continue
        members[part[n.name]].append(n)
    pieces = []
    for i, comp in enumerate(components):
        module, ins, outs, in_dims, out_dims = _build_piece(gm, members[i], part, i, bsym)
        if not outs:
            raise PartitionError(f"component {comp.name!r} produces nothing that is used; report this model")
        pieces.append(Piece(comp.name, comp.kind, comp.work, module, ins, outs, in_dims, out_dims))
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    flat = out_node.args[0]
    flat = flat if isinstance(flat, (tuple, list)) else (flat,)
    names = tuple(n.name for n in gm.graph.nodes if n.op == "placeholder")
    return SplitResult(pieces=tuple(pieces), input_names=names, output_values=tuple(o.name for o in flat))


def run_pieces(
    pieces: Sequence[Any],
    names: Sequence[tuple[tuple[str, ...], tuple[str, ...]]],
    env: dict[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """Run callables in order on ``env`` (value name -> tensor); ``names`` gives (inputs, outputs)."""
    for fn, (ins, outs) in zip(pieces, names, strict=True):
        res = fn(*[env[n] for n in ins])
        res = res if isinstance(res, (tuple, list)) else (res,)
        env.update(zip(outs, res, strict=True))
    return env


def functional(ep: Any) -> Any:
    """``ep`` in torch.export's functional IR: in-place and ``out=`` operators (``x += y``, ``relu_``,
    ``masked_fill_``) become their out-of-place forms, nothing is decomposed.  Loading refuses operators that
    write into their arguments ([Note: ATen allowlist] in :mod:`hpcsplit.switchboard.archive`); torch.export
    keeps them since torch 2.5, so ``ep`` comes back unchanged only when it has none.

    [Note: views after functionalization]
    ``run_decompositions`` retraces the program with fake tensors, and there ``reshape`` and ``contiguous``
    (which may alias, so torch cannot keep them) are decided by the fake tensors' strides: a copy, or a
    ``view`` where the fake tensor looks contiguous.  Those strides are not always the ones the kernels give
    at run time: the fake ``scaled_dot_product_attention`` returns the fused kernels' layout, so T5's
    ``attn.transpose(1, 2).contiguous().view(...)`` lost its copy and its ``view`` raised on the CPU
    kernel's output.  In a functional program nothing writes into a tensor, so whether a value aliases
    another cannot change a result: every ``view`` becomes ``reshape``, which is a view where the strides
    allow one and a copy where they do not."""
    if not any(n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable
               for n in ep.graph.nodes):
        return ep
    with torch.no_grad():
        ep = ep.run_decompositions({})
    aten = torch.ops.aten
    views = {aten.view.default, aten._unsafe_view.default}
    changed = False
    for n in ep.graph_module.graph.nodes:
        if n.op == "call_function" and n.target in views:
            n.target = aten.reshape.default
            changed = True
    if changed:
        ep.graph_module.recompile()
    return ep


def export_piece(piece: Piece, example_inputs: Sequence[torch.Tensor], *, dynamic_batch: bool = True) -> Any:
    """``torch.export`` one piece with ``Dim("batch")`` on its batch dims."""
    dyn: Any = None
    if dynamic_batch and any(piece.batch_dims):
        b = torch.export.Dim("batch")
        dyn = tuple({k: b for k in dims} or None for dims in piece.batch_dims)
    try:
        with torch.no_grad():
            return functional(torch.export.export(piece.module, tuple(example_inputs), dynamic_shapes=dyn,
                                                  strict=False))
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise PartitionError(
            f"component {piece.name!r} could not be exported on its own: {type(e).__name__}: {first}; "
            "cut elsewhere (change stages or max_stage_ms)"
        ) from e
