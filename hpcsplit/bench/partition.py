"""Time the partition on synthetic model-shaped graphs: ``python -m hpcsplit.bench partition``.

The graphs look like CLIP's dataflow at scale: two (or more) transformer towers side by side,
each a chain of layers with attention forks (q/k/v), residual skips and MLPs, joined by a head.
Per-node times are printed next to the 1k-node figure so that growth can be read as a ratio
(1.0 = linear). Figures only; nothing is asserted.
"""

from __future__ import annotations

import argparse
import random
import time

import networkx as nx

from hpcsplit.switchboard.regions import find_regions, partition

__all__ = ["main", "synthetic_graph"]

_LAYER = 13  # nodes per layer, see _add_layer


def _add_layer(g: nx.DiGraph, x: str, prefix: str, rng: random.Random) -> str:
    """A pre-norm transformer layer after node ``x``; returns its output node."""

    def node(name: str, work: float, nbytes: int, module: str) -> str:
        full = f"{prefix}.{name}"
        g.add_node(full, work=work * rng.uniform(0.8, 1.2), bytes=nbytes, module=f"{prefix}.{module}")
        return full

    d = 3072
    ln1 = node("ln1", 0.05, d, "ln1")
    q, k, v = (node(n, 0.3, d, f"attn.{n}_proj") for n in ("q", "k", "v"))
    att = node("sdpa", 0.4, d, "attn")
    proj = node("o", 0.3, d, "attn.out_proj")
    add1 = node("add1", 0.02, d, "")
    ln2 = node("ln2", 0.05, d, "ln2")
    fc1 = node("fc1", 1.2, 4 * d, "mlp.fc1")
    act = node("act", 0.1, 4 * d, "mlp.act")
    fc2 = node("fc2", 1.2, d, "mlp.fc2")
    drop = node("drop", 0.01, d, "mlp.drop")
    add2 = node("add2", 0.02, d, "")
    g.add_edges_from([(x, ln1), (ln1, q), (ln1, k), (ln1, v), (q, att), (k, att), (v, att), (att, proj)])
    g.add_edges_from([(proj, add1), (x, add1), (add1, ln2), (ln2, fc1), (fc1, act), (act, fc2), (fc2, drop)])
    g.add_edges_from([(drop, add2), (add1, add2)])
    return add2


def synthetic_graph(n_nodes: int, *, towers: int = 2, seed: int = 0) -> nx.DiGraph:
    """A model-shaped dataflow DAG of about ``n_nodes`` nodes.

    ``towers`` transformer towers of unequal depth (3:1 for two, like CLIP's vision and text
    towers) start from their own inputs and meet in a small head.
    """
    rng = random.Random(seed)
    g = nx.DiGraph()
    weights = [3.0] + [1.0] * (towers - 1)
    budget = max(n_nodes - 4 * towers - 3, _LAYER * towers)
    outs = []
    for t in range(towers):
        name = f"tower{t}"
        layers = max(1, round(budget * weights[t] / sum(weights) / _LAYER))
        inp = f"{name}.input"
        g.add_node(inp, work=0.0, bytes=4096, module="", input=True)
        emb = f"{name}.embed"
        g.add_node(emb, work=0.5, bytes=3072, module=f"{name}.embeddings")
        g.add_edge(inp, emb)
        x = emb
        for i in range(layers):
            x = _add_layer(g, x, f"{name}.layers.{i}", rng)
        pool = f"{name}.pool"
        g.add_node(pool, work=0.05, bytes=2048, module=f"{name}.post")
        g.add_edge(x, pool)
        outs.append(pool)
    g.add_node("head.matmul", work=0.01, bytes=8, module="")
    g.add_edges_from((o, "head.matmul") for o in outs)
    g.add_node("head.scale", work=0.001, bytes=8, module="")
    g.add_edge("head.matmul", "head.scale")
    return g


def _time(fn, repeats: int) -> float:  # type: ignore[no-untyped-def]
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv: list[str]) -> int:
    """Print partition time for synthetic graphs of growing size."""
    ap = argparse.ArgumentParser(prog="python -m hpcsplit.bench partition", description=__doc__)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 5000, 10000, 50000])
    ap.add_argument("--towers", type=int, default=2)
    ap.add_argument("--stages", type=int, default=8, help="sequential cuts for the 'stages' column")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    print(f"partition of synthetic {args.towers}-tower transformer graphs (best of {args.repeats}; seconds)")
    header = (
        f"{'nodes':>7} {'edges':>7} {'regions':>7} {'comps':>5} {'partition_s':>11} {'us/node':>8} {'ratio':>6} "
        f"{'stages_s':>9} {'us/node':>8} {'ratio':>6}"
    )
    print(header)
    base: tuple[float, float] | None = None
    for n in args.sizes:
        g = synthetic_graph(n, towers=args.towers)
        nodes = g.number_of_nodes()
        comps = partition(g)
        regions = find_regions(g, min_branch_fraction=0.05)
        t_part = _time(lambda g=g: partition(g), args.repeats)
        t_stage = _time(lambda g=g: partition(g, stages=args.stages), args.repeats)
        per = (t_part / nodes * 1e6, t_stage / nodes * 1e6)
        base = base or per
        print(
            f"{nodes:>7} {g.number_of_edges():>7} {len(regions):>7} {len(comps):>5} {t_part:>11.3f} {per[0]:>8.1f} "
            f"{per[0] / base[0]:>6.2f} {t_stage:>9.3f} {per[1]:>8.1f} {per[1] / base[1]:>6.2f}"
        )
    print("ratio: time per node relative to the first size (1.0 = linear growth)")
    return 0
