"""A picture of the split: ``switchboard/graph.svg`` and ``graph.png`` (docs/export.md "The picture").

The dataflow graph condensed to its components (one box per component, coloured, with its kind,
parameters and FLOP share), the model's inputs and outputs, each edge labelled with the tensors and
bytes per sample it carries, and under it the region table's decisions and the stage cuts. Drawn with
graphviz's ``dot`` through its Python binding when the ``dot`` program is installed
(``apt-get install graphviz``), else with networkx's layered layout and matplotlib: the same content.

[Note: the picture is a side file]
``graph.svg``/``graph.png`` are written by the export beside ``layout.json`` but are not part of the
switchboard's layout: ``layout.json`` does not name or hash them, ``Switchboard.load`` never opens them,
and they do not change the switchboard's sha256 (the pictures differ with the graphviz version or its
absence; the switchboard must not). They are drawn from ``layout.json`` alone, so
:func:`write_picture` redraws them for any switchboard. A failed drawing is reported and skipped: a
picture never fails an export.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import networkx as nx

__all__ = ["PICTURE_PNG", "PICTURE_SVG", "picture_model", "renderer", "write_picture"]

PICTURE_SVG = "graph.svg"
PICTURE_PNG = "graph.png"
# Okabe-Ito / Tableau-like colours that stay apart in print and for colour-blind readers
_PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7",
            "#9c755f", "#bab0ac")
_REASON_CHARS = 90


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover - the loop returns


def _short(names: Sequence[str], keep: int = 2) -> str:
    return ", ".join(names[:keep]) + (f" +{len(names) - keep}" if len(names) > keep else "")


def picture_model(layout: Mapping[str, Any]) -> dict[str, Any]:
    """What the picture shows, from ``layout.json``'s dict: nodes, edges and the decision lines.

    Returns ``{"title", "nodes": [{id, label, kind, colour}], "edges": [{src, dst, label, bytes}],
    "decisions": [str]}``; nodes are the inputs, the components in run order and ``output``.
    """
    comps = list(layout.get("components") or [])
    part = layout.get("partition") or {}
    batch = part.get("decision_batch")
    nodes: list[dict[str, Any]] = []
    size = {t.get("name"): int(t.get("bytes_per_sample") or 0) for t in layout.get("inputs") or []}
    for t in layout.get("inputs") or []:
        nodes.append({"id": f"in:{t['name']}", "label": f"{t['name']}\n{t.get('dtype')} {t.get('shape')}",
                      "kind": "input", "colour": "#dddddd"})
    for i, c in enumerate(comps):
        for t in c.get("outputs") or []:
            size[t.get("name")] = int(t.get("bytes_per_sample") or 0)
        ms = float(c.get("work_ms") or 0.0)
        share = f"\n{ms:.3g} ms at batch {batch} (timing pass)" if ms > 0 else ""
        nodes.append({"id": f"c:{c['name']}",
                      "label": f"{c['name']}\n{c.get('kind')}, {_human_bytes(float(c.get('param_bytes') or 0))} "
                               f"params{share}",
                      "kind": str(c.get("kind")), "colour": _PALETTE[i % len(_PALETTE)]})
    nodes.append({"id": "out", "label": "outputs\n" + _short([t.get("name", "?") for t in layout.get("outputs") or []],
                                                             4), "kind": "output", "colour": "#dddddd"})
    grouped: dict[tuple[str, str], list[str]] = {}
    for e in layout.get("edges") or []:
        src = f"in:{e['src_name']}" if e["src"] == "input" else f"c:{e['src']}"
        dst = "out" if e["dst"] == "output" else f"c:{e['dst']}"
        names = grouped.setdefault((src, dst), [])
        if e["src_name"] not in names:
            names.append(e["src_name"])
    edges = []
    for (src, dst), names in grouped.items():
        nbytes = sum(size.get(n, 0) for n in names)
        what = "" if src.startswith("in:") else _short(names) + "\n"
        edges.append({"src": src, "dst": dst, "bytes": nbytes, "label": f"{what}{_human_bytes(nbytes)}/sample"})
    lines = []
    for d in part.get("regions") or []:
        verdict = ("split: " if d.get("split") else "whole: ") + str(d.get("reason", ""))
        lines.append(f"region {d.get('entry') or 'inputs'} -> {d.get('exit') or 'outputs'} ({d.get('kind')}): "
                     f"{verdict[:_REASON_CHARS]}")
    for c in part.get("stage_cuts") or []:
        towers = ", ".join(c.get("towers") or [])
        lines.append(f"stages of {c.get('component')}: {c.get('made')} of {c.get('requested')} asked"
                     + (f", cut first at {towers}" if towers else "") + f": {str(c.get('reason', ''))[:_REASON_CHARS]}")
    if not lines:
        lines.append("no region: the graph has no parallel branches")
    title = (f"{layout.get('model')}: {len(comps)} component(s); edges: bytes per sample that cross; "
             f"decided on FLOPs at batch {batch}")
    return {"title": title, "nodes": nodes, "edges": edges, "decisions": lines}


def renderer() -> str:
    """``"graphviz"`` when the binding and its ``dot`` program are there, else ``"matplotlib"``."""
    try:
        import graphviz
    except ImportError:
        return "matplotlib"
    try:
        graphviz.version()
    except (graphviz.ExecutableNotFound, graphviz.CalledProcessError, OSError):
        return "matplotlib"
    return "graphviz"


def _dot_text(s: str) -> str:
    return s.replace("\\", "\\\\").replace("\n", "\\n")


def _graphviz(model: Mapping[str, Any], out: Path) -> None:
    import graphviz

    dot = graphviz.Digraph("split", graph_attr={
        "rankdir": "TB", "fontname": "Helvetica", "fontsize": "11", "labelloc": "b", "labeljust": "l",
        "nodesep": "0.35", "ranksep": "0.45", "pad": "0.2", "dpi": "110",
        "label": _dot_text(model["title"]) + "\\l" + "".join(_dot_text(x) + "\\l" for x in model["decisions"])},
        node_attr={"fontname": "Helvetica", "fontsize": "11", "style": "filled,rounded", "shape": "box",
                   "penwidth": "1.2"},
        edge_attr={"fontname": "Helvetica", "fontsize": "9", "color": "#555555"})
    key = {n["id"]: f"n{i}" for i, n in enumerate(model["nodes"])}  # dot reads "a:b" as node a, port b
    for n in model["nodes"]:
        shape = "ellipse" if n["kind"] in ("input", "output") else "box"
        font = "#000000" if n["kind"] in ("input", "output") else "#ffffff"
        dot.node(key[n["id"]], _dot_text(n["label"]), shape=shape, fillcolor=n["colour"], fontcolor=font)
    for e in model["edges"]:
        dot.edge(key[e["src"]], key[e["dst"]], label=_dot_text(e["label"]))
    (out / PICTURE_SVG).write_bytes(dot.pipe(format="svg"))
    (out / PICTURE_PNG).write_bytes(dot.pipe(format="png"))


def _layers(model: Mapping[str, Any]) -> dict[str, int]:
    g = nx.DiGraph()
    g.add_nodes_from(n["id"] for n in model["nodes"])
    g.add_edges_from((e["src"], e["dst"]) for e in model["edges"])
    return {v: i for i, layer in enumerate(nx.topological_generations(g)) for v in layer}


def _matplotlib(model: Mapping[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    g = nx.DiGraph()
    g.add_nodes_from(n["id"] for n in model["nodes"])
    g.add_edges_from((e["src"], e["dst"]) for e in model["edges"])
    layer = _layers(model)
    depth = max(layer.values()) + 1
    # layers top-down; inside a layer by the mean place of the nodes feeding it (fewer crossings), then
    # by run order
    pos: dict[str, tuple[float, float]] = {}
    rank = {n["id"]: i for i, n in enumerate(model["nodes"])}
    for d in range(depth):
        row = [v for v in g if layer[v] == d]
        def place(v: str) -> tuple[float, int]:
            xs = [pos[u][0] for u in g.predecessors(v) if u in pos]
            return (sum(xs) / len(xs) if xs else 0.0, rank[v])
        row.sort(key=place)
        for i, v in enumerate(row):
            pos[v] = (i - (len(row) - 1) / 2, -float(d))
    width = max(sum(1 for v in layer.values() if v == i) for i in range(depth))
    fig_h = 1.3 * depth + 0.2 * len(model["decisions"]) + 0.8
    fig, ax = plt.subplots(figsize=(max(8.0, 3.2 * width), fig_h))
    ax.set_title(model["title"], fontsize=10, loc="left")
    nx.draw_networkx_edges(g, pos, ax=ax, arrows=True, arrowsize=14, edge_color="#555555",
                           node_size=2500, min_source_margin=12, min_target_margin=14)
    nx.draw_networkx_edge_labels(g, pos, ax=ax, font_size=7, rotate=False,
                                 bbox={"boxstyle": "round,pad=0.2", "facecolor": "white", "edgecolor": "none"},
                                 edge_labels={(e["src"], e["dst"]): e["label"] for e in model["edges"]})
    for n in model["nodes"]:
        x, y = pos[n["id"]]
        dark = n["kind"] not in ("input", "output")
        ax.text(x, y, n["label"], ha="center", va="center", fontsize=8, color="white" if dark else "black",
                bbox={"boxstyle": "round,pad=0.4", "facecolor": n["colour"], "edgecolor": "#333333"})
    ax.text(0.0, -0.02, "\n".join(model["decisions"]), transform=ax.transAxes, ha="left", va="top",
            fontsize=7, family="monospace")
    ax.margins(0.2, 0.15)
    ax.set_axis_off()
    fig.tight_layout()
    fig.savefig(out / PICTURE_SVG, format="svg", metadata={"Date": None})
    fig.savefig(out / PICTURE_PNG, format="png", dpi=110)
    plt.close(fig)


def write_picture(switchboard: str | Path, *, using: str | None = None) -> str | None:
    """Draw ``graph.svg`` and ``graph.png`` into ``switchboard`` from its ``layout.json``.

    Parameters
    ----------
    switchboard
        The switchboard directory (the export's temporary one, or any written before).
    using
        ``"graphviz"``, ``"matplotlib"`` or ``None`` (:func:`renderer`: graphviz when ``dot`` is installed).

    Returns
    -------
    str or None
        The renderer that drew it, ``None`` when drawing failed (a warning says why; see
        [Note: the picture is a side file]).
    """
    root = Path(switchboard)
    way = using or renderer()
    if way not in ("graphviz", "matplotlib"):
        raise ValueError(f"found using={way!r}; needed 'graphviz', 'matplotlib' or None")
    try:
        model = picture_model(json.loads((root / "layout.json").read_text()))
        if way == "graphviz":
            try:
                _graphviz(model, root)
            except Exception as e:  # noqa: BLE001 - a broken dot falls back to the other renderer
                warnings.warn(f"graphviz could not draw {root / PICTURE_SVG} ({type(e).__name__}: {e}); "
                              "drawing it with matplotlib", stacklevel=2)
                way = "matplotlib"
        if way == "matplotlib":
            _matplotlib(model, root)
    except Exception as e:  # noqa: BLE001 - a picture never fails an export
        for name in (PICTURE_SVG, PICTURE_PNG):
            (root / name).unlink(missing_ok=True)
        warnings.warn(f"no picture of the split in {root} ({type(e).__name__}: {e})", stacklevel=2)
        return None
    return way
