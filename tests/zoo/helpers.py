"""What the zoo tests read from a switchboard: which model parameters each component holds, the
component graph, and fresh inputs at another batch size."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import networkx as nx
import torch

import hpcsplit
from hpcsplit.switchboard.reader import Switchboard

# The zoo checks the structure the graph allows: tiny models do not pay for their splits in the
# runtime (benefit vs cost, docs/export.md), so the structure tests force them; one step of the
# timing pass keeps the zoo quick (the structure comes from FLOPs, not from timing).
OPTIONS: dict[str, Any] = {"force": True, "timing_repeats": 1}


def export(build: Callable[[], tuple[torch.nn.Module, tuple[torch.Tensor, ...]]], out: Path,
           **options: Any) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...], Switchboard]:
    torch.manual_seed(0)
    model, xs = build()
    sb = hpcsplit.export(model, xs, out=out, **{**OPTIONS, **options})
    return model, xs, sb


_PARAMS: dict[tuple[str, str, str], frozenset[str]] = {}


def params(sb: Switchboard, component: str) -> frozenset[str]:
    """The model parameter and buffer names a component's program holds (``tower_a.blocks.0...``)."""
    key = (str(sb.path), sb.sha256, component)
    if key not in _PARAMS:
        ep = sb._load_program(sb.components[component], f"program of {component!r}")
        _PARAMS[key] = frozenset(ep.state_dict) | frozenset(ep.constants)
    return _PARAMS[key]


def holders(sb: Switchboard, prefix: str) -> set[str]:
    """Components holding a parameter under module path ``prefix`` (``tower_a``, ``model.text_model``)."""
    return {c for c in sb.order if any(p == prefix or p.startswith(prefix + ".") for p in params(sb, c))}


def only_holder(sb: Switchboard, prefix: str) -> str:
    """The one component holding module ``prefix``'s parameters (asserts there is exactly one)."""
    found = holders(sb, prefix)
    assert len(found) == 1, f"{prefix}: parameters in {sorted(found)} (components {list(sb.order)})"
    return found.pop()


def graph(sb: Switchboard) -> nx.DiGraph:
    g = nx.DiGraph()
    g.add_nodes_from(sb.order)
    g.add_edges_from((e.src, e.dst) for e in sb.edges if e.src in sb.components and e.dst in sb.components)
    return g


def parallel(sb: Switchboard, *components: str) -> bool:
    """No component of ``components`` reaches another: they can run side by side."""
    g = graph(sb)
    return len(set(components)) == len(components) and all(
        not nx.has_path(g, a, b) for a in components for b in components if a != b
    )


def before(sb: Switchboard, a: str, b: str) -> bool:
    return nx.has_path(graph(sb), a, b) and a != b


def inputs(sb: Switchboard, component: str) -> set[str]:
    return {t.name for t in sb.components[component].inputs}


def signature(sb: Switchboard) -> list[tuple[Any, ...]]:
    """What "the same components" means: names, kinds, inputs, edges and the parameters of each."""
    return [(c.name, c.kind, tuple(t.name for t in c.inputs), tuple(t.name for t in c.outputs),
             tuple(sorted(params(sb, c.name)))) for c in sb.layout.components] + \
        sorted((e.src, e.src_name, e.dst, e.dst_name) for e in sb.edges)


def fresh_inputs(xs: tuple[torch.Tensor, ...], batch_size: int, seed: int = 7) -> tuple[torch.Tensor, ...]:
    """New random inputs like ``xs`` at ``batch_size`` (ids stay below the largest example id + 1)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for t in xs:
        shape = (batch_size, *t.shape[1:])
        if t.dtype.is_floating_point:
            out.append(torch.randn(shape, generator=g, dtype=t.dtype))
        elif t.dtype == torch.bool:
            out.append(torch.zeros(shape, dtype=torch.bool))
        else:
            out.append(torch.randint(int(t.min()), int(t.max()) + 1, shape, generator=g, dtype=t.dtype))
    return tuple(out)


def check_outputs(sb: Switchboard, model: torch.nn.Module, xs: tuple[torch.Tensor, ...]) -> None:
    """Equal to the model at the export batch and at 3x it: the export's own verification (at the
    export batch), and the components run through the reader against the eager model at both."""
    assert sb.layout.verification["passed"]
    b = xs[0].shape[0]
    for x in (xs, fresh_inputs(xs, 3 * b)):
        with torch.no_grad():
            want = model(*x)
        got = sb(*x)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
