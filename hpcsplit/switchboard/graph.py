"""Capture a model with ``torch.export`` (symbolic batch) and describe its dataflow.

``capture`` gives a :class:`ComputeGraph`: the exported program, its unlifted ``GraphModule``
(parameters as ``get_attr``) and the example inputs. ``measure_nodes`` runs a short timing pass
of that module on the local device, and ``dataflow_graph`` turns it into the networkx graph that
:func:`hpcsplit.switchboard.regions.partition` analyses.

[Note: data nodes]
A node *carries data* when it produces a tensor (or a tuple of tensors) computed from at least one
model input. Parameters, buffers and constants (``get_attr``), constants computed from them
(``logit_scale.exp()``, ``arange`` positions), shape reads (``sym_size``), asserts and export's
``_guards_fn`` carry none: they stay out of the graph that is analysed, and the switchboard puts
each of them into the component of its users (``torch-export-facts.md``: left in, the guards
would join CLIP's towers at the entry).
"""

from __future__ import annotations

import copy
import inspect
import operator
import os
import re
import time
import traceback
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import networkx as nx
import torch
from torch import fx
from torch.export.passes import move_to_device_pass
from torch.utils import _pytree as pytree

from hpcsplit.errors import CaptureError
from hpcsplit.switchboard.verify import tile_batch

__all__ = [
    "ComputeGraph",
    "NodeCost",
    "capture",
    "data_nodes",
    "dataflow_graph",
    "live_data_nodes",
    "measure_nodes",
    "module_path",
]

BATCH = "batch"


@dataclass(frozen=True, slots=True)
class ComputeGraph:
    """A captured model.

    Attributes
    ----------
    exported
        The ``torch.export.ExportedProgram`` (batch dim symbolic when ``dynamic_batch``).
    module
        ``exported.module()``: an unlifted ``fx.GraphModule`` taking flat inputs.
    flat_inputs
        Example inputs, flattened in model input order (all tensors).
    input_names, output_names
        Names of the flat inputs and outputs.
    in_spec, out_spec
        pytree specs of ``(args, kwargs)`` and of the model's output.
    batch_size
        Batch size of ``flat_inputs`` (at least 2 when the batch is symbolic).
    dynamic_batch
        Whether dim 0 of every input is symbolic.
    model_name
        Class name of the model.
    """

    exported: Any
    module: fx.GraphModule
    flat_inputs: tuple[torch.Tensor, ...]
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    in_spec: Any
    out_spec: Any
    batch_size: int
    dynamic_batch: bool
    model_name: str


@dataclass(frozen=True, slots=True)
class NodeCost:
    """Per-node figures from the timing pass (``latency_ms`` at ``batch_size``)."""

    latency_ms: float
    flops: float
    bytes_per_sample: int


def _leaf_name(path: tuple[Any, ...], prefix: str) -> str:
    s = pytree.keystr(path)
    s = re.sub(r"[^A-Za-z0-9_]+", "_", s).strip("_")
    return s or prefix


def _output_names(out_spec: Any) -> tuple[str, ...]:
    dummy = pytree.tree_unflatten(list(range(out_spec.num_leaves)), out_spec)
    leaves = pytree.tree_flatten_with_path(dummy)[0]
    if len(leaves) == 1 and not pytree.keystr(leaves[0][0]):
        return ("output",)
    names = []
    for path, _ in leaves:
        n = _leaf_name(path, "output")
        names.append(f"output_{n}" if n[0].isdigit() else n)
    return tuple(names)


def _user_frame(e: BaseException) -> traceback.FrameSummary | None:
    """The innermost frame of the traceback outside torch (where the model's own code raised)."""
    torch_dir = os.path.dirname(torch.__file__) + os.sep
    frames = [f for f in traceback.extract_tb(e.__traceback__) if not f.filename.startswith(torch_dir)]
    return frames[-1] if frames else None


def _in_generate(e: BaseException) -> traceback.FrameSummary | None:
    """The frame of a generate loop (transformers' ``generate`` or a ``generate`` of the model's own) the
    error came from, if any."""
    for f in traceback.extract_tb(e.__traceback__):
        if f.name == "generate" or f"{os.sep}generation{os.sep}" in f.filename and "transformers" in f.filename:
            return f
    return None


def _where(f: traceback.FrameSummary | None) -> str:
    return f" (at {f.filename}:{f.lineno} in {f.name}: {(f.line or '').strip()[:120]})" if f is not None else ""


def _explain(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}"
    low = text.lower()
    gen = _in_generate(e)
    if gen is not None:
        hint = (
            f"forward runs a generate loop{_where(gen)}: one forward per new token until a stop token, a loop "
            "whose length depends on the tensors it makes; export one forward step instead (the model itself: "
            "model=hf with its ...ForCausalLM / ...ForConditionalGeneration class gives the logits of one step) "
            "and run the decoding loop outside hpcsplit, one request per step"
        )
    elif "data-dependent" in low or "datadependent" in low or "guardondatadependent" in low:
        hint = (
            f"the model branches on tensor values (data-dependent control flow){_where(_user_frame(e))}; "
            "move the branch out of forward, or use torch.cond / torch.where"
        )
    elif "constraint" in low or "specializ" in low or "batch" in low and "dim" in low:
        hint = (
            "the model fixes the batch size (e.g. a reshape or view with a literal batch); "
            "use x.shape[0] or -1 there, or capture with dynamic_batch=False"
        )
    elif "unsupported" in low or "not supported" in low:
        hint = "an operation is not supported by torch.export; replace it or wrap it in a custom op"
    else:
        hint = "make forward exportable with torch.export.export(model, args, strict=False) first"
    first = text.strip().splitlines()[0][:400] if text.strip() else type(e).__name__
    return f"{first}\n  what to change: {hint}"


def _written_placeholders(graph: fx.Graph) -> set[str]:
    """The placeholders an in-place operator writes into (``add_``, ``copy_``, ``mul_`` on a buffer or an
    input, or on a view of one): export's graph keeps such operators as they are."""
    root: dict[str, str] = {}
    written: set[str] = set()
    for n in graph.nodes:
        if n.op == "placeholder":
            root[n.name] = n.name
            continue
        schema = getattr(n.target, "_schema", None) if n.op == "call_function" else None
        if schema is None:
            continue
        for a, arg in zip(schema.arguments, n.args, strict=False):
            if a.alias_info is None or not isinstance(arg, fx.Node) or arg.name not in root:
                continue
            if a.alias_info.is_write:
                written.add(root[arg.name])
            root[n.name] = root[arg.name]  # a view or an in-place result: the same storage
    return written


def _refuse_mutations(ep: Any, model_name: str) -> None:
    """A forward that updates a buffer or an input in place is refused (see docs/export.md "What cannot be
    exported"): the switchboard's programs are pure functions of their inputs, so each component would
    update its own copy, and a request would see the updates of the requests before it."""
    sig = ep.graph_signature
    kind = {spec.arg.name: spec for spec in sig.input_specs if hasattr(spec.arg, "name")}
    written = _written_placeholders(ep.graph)
    buffers = sorted(set(sig.buffers_to_mutate.values()) | {
        str(kind[n].target) for n in written if n in kind and kind[n].kind.name == "BUFFER"})
    inputs = sorted(set(sig.user_inputs_to_mutate.values()) | {
        n for n in written if n in kind and kind[n].kind.name == "USER_INPUT"})
    if buffers:
        raise CaptureError(
            f"{model_name}.forward updates buffer(s) {', '.join(buffers)} in place (an in-place buffer "
            "update: running statistics, a step counter, a cache); needed: a forward that only reads its "
            "buffers; what to change: compute the value and return it, or update the buffer outside forward "
            "(e.g. in a training step), then export the model in eval mode"
        )
    if inputs:
        raise CaptureError(
            f"{model_name}.forward writes into its input(s) {', '.join(inputs)} in place; needed: inputs that "
            "forward only reads; what to change: work on a copy (x = x.clone()) or use the out-of-place op"
        )


def _bind(model: torch.nn.Module, args: Any, kwargs: Any) -> dict[str, Any] | None:
    try:
        sig = inspect.signature(model.forward)
        bound = sig.bind(*args, **kwargs)
    except (TypeError, ValueError):
        return None
    return dict(bound.arguments)


def capture(
    model: torch.nn.Module,
    args: Sequence[Any],
    kwargs: Mapping[str, Any] | None = None,
    *,
    dynamic_batch: bool = True,
) -> ComputeGraph:
    """Trace ``model`` with ``torch.export`` (``strict=False``), dim 0 of every input symbolic.

    Parameters
    ----------
    model
        The model; put into eval mode.
    args, kwargs
        Example inputs. Every leaf must be a tensor. With ``dynamic_batch`` dim 0 of every
        tensor is the batch; a batch of 1 is tiled to 2 (export specialises size-1 dims).
    dynamic_batch
        Mark dim 0 symbolic (``Dim("batch")``) so one program serves every batch size.

    Returns
    -------
    ComputeGraph

    Raises
    ------
    CaptureError
        Non-tensor inputs, differing batch sizes, or torch.export failing (the message names
        the cause and what to change).
    """
    args = tuple(args)
    kwargs = dict(kwargs or {})
    model.eval()
    leaves, _ = pytree.tree_flatten_with_path((args, kwargs))
    bad = [pytree.keystr(p) for p, v in leaves if not isinstance(v, torch.Tensor)]
    if bad:
        raise CaptureError(
            f"found non-tensor inputs at {', '.join(bad)}; needed tensors only; "
            "bind other arguments in a wrapper module (or functools.partial) before exporting"
        )
    if not leaves:
        raise CaptureError("found no tensor inputs; needed at least one example input tensor")
    batch = 0
    if dynamic_batch:
        sizes = {pytree.keystr(p): (v.shape[0] if v.dim() else None) for p, v in leaves}
        distinct = set(sizes.values())
        if None in distinct or len(distinct) != 1:
            raise CaptureError(
                f"found dim-0 sizes {sizes}; needed the same batch size on dim 0 of every input "
                "tensor; fix the example inputs or capture with dynamic_batch=False"
            )
        batch = int(next(iter(distinct)) or 0)
        if batch < 2:
            reps = 2 // max(batch, 1)
            args, kwargs = pytree.tree_map(lambda t: t.repeat(reps, *([1] * (t.dim() - 1))), (args, kwargs))
            batch = 2
    else:
        batch = int(leaves[0][1].shape[0]) if leaves[0][1].dim() else 1
    dynamic_shapes: Any = None
    if dynamic_batch:
        dim = torch.export.Dim(BATCH)
        bound = _bind(model, args, kwargs)

        def spec(t: torch.Tensor) -> dict[int, Any]:
            return {0: dim}

        if bound is not None:
            dynamic_shapes = {k: pytree.tree_map(spec, v) for k, v in bound.items()}
        else:
            dynamic_shapes = pytree.tree_map(spec, args)
    try:
        with torch.no_grad():
            ep = torch.export.export(
                model, tuple(args), dict(kwargs), dynamic_shapes=dynamic_shapes, strict=False
            )
    except Exception as e:
        raise CaptureError(f"torch.export could not trace {type(model).__name__}: {_explain(e)}") from e
    _refuse_mutations(ep, type(model).__name__)
    gm = ep.module()
    flat = tuple(pytree.tree_flatten((args, kwargs))[0])
    names = tuple(n.name for n in gm.graph.nodes if n.op == "placeholder")
    if len(names) != len(flat):  # pragma: no cover - export keeps one placeholder per leaf
        names = tuple(f"input_{i}" for i in range(len(flat)))
    return ComputeGraph(
        exported=ep,
        module=gm,
        flat_inputs=flat,
        input_names=names,
        output_names=_output_names(ep.call_spec.out_spec),
        in_spec=ep.call_spec.in_spec,
        out_spec=ep.call_spec.out_spec,
        batch_size=batch,
        dynamic_batch=dynamic_batch,
        model_name=type(model).__name__,
    )


# --------------------------------------------------------------------------- data nodes


def _is_tensorish(val: Any) -> bool:
    if isinstance(val, torch.Tensor):
        return True
    if isinstance(val, (tuple, list)) and val:
        return any(isinstance(x, torch.Tensor) for x in val)
    return False


def data_nodes(gm: fx.GraphModule) -> set[str]:
    """Names of the nodes that carry data (see [Note: data nodes])."""
    out: set[str] = set()
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            out.add(n.name)
        elif n.op in ("call_function", "call_method", "call_module"):
            if n.op == "call_module" and str(n.target).startswith("_guards"):
                continue
            if not _is_tensorish(n.meta.get("val")):
                continue
            if any(a.name in out for a in n.all_input_nodes):
                out.add(n.name)
    return out


def _output_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    out = next((n for n in gm.graph.nodes if n.op == "output"), None)
    if out is None:  # pragma: no cover - every GraphModule has one
        return []
    return [a for a in pytree.tree_flatten(out.args)[0] if isinstance(a, fx.Node)]


def live_data_nodes(gm: fx.GraphModule) -> set[str]:
    """The data nodes from which a model output is reached through data nodes (see [Note: data nodes]).

    A value computed but never used for an output (the averaged attention weights that
    ``nn.MultiheadAttention`` returns beside its output, a tensor read only for its shape) is dead
    for the analysis: left in, it would be a sink next to the outputs and hide every region.
    """
    keep = data_nodes(gm)
    live: set[str] = set()
    stack = [n for n in _output_nodes(gm) if n.name in keep]
    while stack:
        n = stack.pop()
        if n.name in live:
            continue
        live.add(n.name)
        stack.extend(a for a in n.all_input_nodes if a.name in keep and a.name not in live)
    return live


def module_path(node: fx.Node) -> str:
    """Innermost module path of a node (``""`` for code in the model's own forward)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path, _ = list(stack.values())[-1]
    path = str(path)
    # non-strict export sometimes spells paths as L['self'].a.b
    path = re.sub(r"^L\['self'\]\.?", "", path)
    path = re.sub(r"\[['\"]?([^'\"\]]+)['\"]?\]", r".\1", path).strip(".")
    return path


def _nbytes(val: Any) -> int:
    if isinstance(val, torch.Tensor):
        return val.numel() * val.element_size()
    if isinstance(val, (tuple, list)):
        return sum(_nbytes(v) for v in val)
    return 0


def _flops(node: fx.Node, args: tuple, out: Any) -> float:
    name = str(node.target)
    n_out = float(_nbytes(out)) / 4.0
    try:
        if "linear" in name and len(args) > 1:
            return 2.0 * n_out * args[1].shape[-1]
        if any(k in name for k in ("mm", "matmul", "bmm", "einsum")) and isinstance(args[0], torch.Tensor):
            return 2.0 * n_out * args[0].shape[-1]
        if "conv" in name and len(args) > 1:
            w = args[1]
            return 2.0 * n_out * (w.numel() / max(w.shape[0], 1))
        if "scaled_dot_product" in name:
            q, k = args[0], args[1]
            return 4.0 * q.numel() * k.shape[-2]
    except (AttributeError, IndexError, TypeError):
        pass
    return n_out


class _Timer(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, keep: set[str], sync: Any) -> None:
        super().__init__(gm)
        self.keep = keep
        self.sync = sync
        self.latency: dict[str, float] = {}
        self.flops: dict[str, float] = {}
        self.nbytes: dict[str, int] = {}

    def run_node(self, n: fx.Node) -> Any:
        if n.name not in self.keep or n.op == "placeholder":
            return super().run_node(n)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        self.sync()
        t0 = time.perf_counter()
        out = getattr(self, n.op)(n.target, args, kwargs)
        self.sync()
        dt = (time.perf_counter() - t0) * 1e3
        self.latency[n.name] = min(dt, self.latency.get(n.name, float("inf")))
        if n.name not in self.nbytes:
            self.nbytes[n.name] = _nbytes(out)
            self.flops[n.name] = _flops(n, args, out) if n.target is not operator.getitem else 0.0
        return out


def measure_nodes(
    cg: ComputeGraph,
    *,
    batch_size: int | None = None,
    repeats: int = 5,
    device: str | torch.device | None = None,
) -> dict[str, NodeCost]:
    """Time every data node of the captured graph (a short pass on the local device).

    Parameters
    ----------
    cg
        The captured graph.
    batch_size
        Batch to time at (inputs tiled along dim 0); default: the capture batch.
    repeats
        Timed passes after one warm-up; each node keeps its fastest time (robust to noise
        from other processes).
    device
        Where to run; default ``"cpu"``.

    Returns
    -------
    dict[str, NodeCost]
        By node name.
    """
    dev = torch.device(device or "cpu")
    bs = batch_size or cg.batch_size
    inputs = [(tile_batch(t, (0,) if t.dim() else (), bs) if cg.dynamic_batch else t).to(dev)
              for t in cg.flat_inputs]
    gm = cg.module
    if dev.type != "cpu":
        # a copy moved with export's own pass (it also rewrites device arguments inside the graph);
        # node names stay those of cg.module
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            gm = move_to_device_pass(copy.deepcopy(cg.exported), dev).module()
    keep = data_nodes(gm)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    timer = _Timer(gm, keep, sync)
    with torch.no_grad():
        timer.run(*inputs)  # warm-up: first calls pay for allocation and kernel selection
        timer.latency.clear()
        for _ in range(max(1, repeats)):
            timer.run(*inputs)
    per = max(bs, 1)
    return {
        k: NodeCost(
            latency_ms=timer.latency[k], flops=timer.flops[k], bytes_per_sample=timer.nbytes[k] // per
        )
        for k in timer.latency
    }


def _same_op_median(gm: fx.GraphModule, costs: Mapping[str, NodeCost], keep: set[str]) -> dict[str, float]:
    """Measured ms per node, each the median over the nodes doing the same operation (operator,
    FLOPs and output bytes: the same layer of every block of a chain).

    One timing pass on a loaded machine times each node once, a preempted one at many times its
    siblings; identical operations take the same time, so each gets their median, and a chain of
    equal blocks is cut between blocks however noisy the pass was.
    """
    target = {n.name: str(n.target) for n in gm.graph.nodes}
    same: dict[tuple[str, float, int], list[float]] = {}
    for k in keep:
        c = costs.get(k)
        if c is not None:
            same.setdefault((target[k], c.flops, c.bytes_per_sample), []).append(float(c.latency_ms))
    median = {key: sorted(v)[len(v) // 2] for key, v in same.items()}
    return {k: median[(target[k], c.flops, c.bytes_per_sample)] for k in keep if (c := costs.get(k)) is not None}


def dataflow_graph(
    cg: ComputeGraph, costs: Mapping[str, NodeCost], *, cost: str = "measured", compute_gflops: float = 30.0
) -> nx.DiGraph:
    """The dataflow graph analysed by :func:`hpcsplit.switchboard.regions.decide`.

    Only live data nodes (:func:`live_data_nodes`) are in it. Node ``work`` is the FLOP estimate
    (deterministic: shapes only), ``ms`` the measured latency (``cost="measured"``) or the FLOPs at
    ``compute_gflops`` (``cost="flops"``); ``output`` marks the nodes that are model outputs.

    Parameters
    ----------
    cg
        The captured graph.
    costs
        From :func:`measure_nodes`.
    cost
        What ``ms`` holds: ``"measured"`` latency or ``"flops"`` converted at ``compute_gflops``.
    compute_gflops
        Nominal compute throughput (GFLOP/s) for ``cost="flops"``.
    """
    if cost not in ("measured", "flops"):
        raise CaptureError(f"found cost={cost!r}; needed 'measured' or 'flops'")
    if not compute_gflops > 0:
        raise CaptureError(f"found compute_gflops={compute_gflops!r}; needed a positive number")
    keep = live_data_nodes(cg.module)
    outputs = {n.name for n in _output_nodes(cg.module)}
    measured = _same_op_median(cg.module, costs, keep) if cost == "measured" else {}
    g = nx.DiGraph()
    for n in cg.module.graph.nodes:
        if n.name not in keep:
            continue
        c = costs.get(n.name)
        flops = 0.0 if c is None else float(c.flops)
        ms = flops / (compute_gflops * 1e6) if cost == "flops" or c is None else measured[n.name]
        g.add_node(
            n.name,
            work=flops,
            ms=ms,
            bytes=0 if c is None else c.bytes_per_sample,
            module=module_path(n),
            input=n.op == "placeholder",
            output=n.name in outputs,
        )
        for a in n.all_input_nodes:
            if a.name in keep:
                g.add_edge(a.name, n.name)
    return g
