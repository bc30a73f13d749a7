"""Groups of components that one rank runs back to back: a region left unsplit, or the whole model.

[Note: component groups]
A plan rank may serve a *group*: components of the switchboard joined by ``+`` in dataflow order
(``text_model+vision_model``; component names are ``[A-Za-z0-9_]``, so ``+`` is never part of one).  The rank
runs the members one after the other on each batch, passing the values between them in memory, so a group is
what the split would have been had its region stayed whole; its inputs are its members' inputs that come from
outside it, its outputs those that leave it.  :func:`merge_groups` merges the dataflow (the simulator's
:func:`hpcsplit.core.sim_model.grouped` and the runtime's ``routing.group_graph`` both call it), the allocator
profiles a group as the sum of its members (``hpcsplit.allocation.choose``).  The name ``whole`` stands for
every component at once, served by the switchboard's unsplit program.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from hpcsplit.errors import PlanError

__all__ = ["GROUP_SEP", "group_members", "group_name", "merge_groups"]

GROUP_SEP = "+"
INPUT = "input"
OUTPUT = "output"

Comp = tuple[str, tuple[str, ...], tuple[str, ...]]  # (name, input value names, output value names)
Edge = tuple[str, str, str, str]  # (src | "input", src value, dst | "output", dst value)


def group_name(members: Sequence[str], order: Sequence[str]) -> str:
    """The group's name: its members in dataflow ``order`` joined by ``+``.

    >>> group_name(["vision_model", "text_model"], ["text_model", "vision_model", "head"])
    'text_model+vision_model'
    """
    pos = {c: i for i, c in enumerate(order)}
    return GROUP_SEP.join(sorted(members, key=lambda c: pos.get(c, len(pos))))


def group_members(name: str, order: Sequence[str]) -> tuple[str, ...]:
    """The components a served name stands for (itself when it is one).

    Raises :class:`~hpcsplit.errors.PlanError` naming the members that are not components.

    >>> group_members("a+b", ["a", "b", "c"]), group_members("c", ["a", "b", "c"])
    (('a', 'b'), ('c',))
    """
    parts = tuple(name.split(GROUP_SEP))
    bad = [p for p in parts if p not in order]
    if bad:
        raise PlanError(f"the plan serves {name!r}: {bad} {'is' if len(bad) == 1 else 'are'} not components of the "
                        f"switchboard ({list(order)}); re-run the allocate stage with this switchboard")
    return parts


def merge_groups(components: Sequence[Comp], edges: Sequence[Edge],
                 groups: Mapping[str, Sequence[str]]) -> tuple[tuple[Comp, ...], tuple[Edge, ...]]:
    """The dataflow with each group (name -> members) merged into one component; others unchanged.

    Edges inside a group disappear; an edge into or out of a group is the group's (one per distinct value and
    end).  Components keep dataflow order (a group sits where its first member was).

    Raises
    ------
    PlanError
        A member that is no component, a component in two groups, or a merge that makes a cycle.

    Examples
    --------
    >>> comps = (("a", ("x",), ("p",)), ("b", ("x",), ("q",)), ("h", ("p", "q"), ("y",)))
    >>> edges = (("input", "x", "a", "x"), ("input", "x", "b", "x"), ("a", "p", "h", "p"), ("b", "q", "h", "q"),
    ...          ("h", "y", "output", "y"))
    >>> c, e = merge_groups(comps, edges, {"a+b": ["a", "b"]})
    >>> [x[0] for x in c], c[0][1:], e[0], len(e)
    (['a+b', 'h'], (('x',), ('p', 'q')), ('input', 'x', 'a+b', 'x'), 4)
    """
    names = [c[0] for c in components]
    owner: dict[str, str] = {}
    problems = []
    for g, ms in groups.items():
        for m in ms:
            if m not in names:
                problems.append(f"group {g!r} names {m!r}, which is not a component ({names})")
            elif m in owner:
                problems.append(f"component {m!r} is in two groups ({owner[m]!r} and {g!r})")
            else:
                owner[m] = g
    if problems:
        raise PlanError("cannot group the components:\n  - " + "\n  - ".join(problems))
    for c in names:
        owner.setdefault(c, c)
    order = list(dict.fromkeys(owner[c] for c in names))
    ports: dict[str, tuple[list[str], list[str]]] = {g: ([], []) for g in order}
    out_edges: list[Edge] = []
    for src, sv, dst, dv in edges:
        s = src if src == INPUT else owner[src]
        d = dst if dst == OUTPUT else owner[dst]
        if s == d:
            continue  # inside a group
        if d != OUTPUT and dv not in ports[d][0]:
            ports[d][0].append(dv)
        if s != INPUT and sv not in ports[s][1]:
            ports[s][1].append(sv)
        e = (s, sv, d, dv)
        if e not in out_edges:
            out_edges.append(e)
    order = _topological(order, [(s, d) for s, _, d, _ in out_edges if s != INPUT and d != OUTPUT], groups)
    comps = tuple((g, tuple(ports[g][0]), tuple(ports[g][1])) for g in order)
    return comps, tuple(out_edges)


def _topological(order: list[str], arcs: list[tuple[str, str]], groups: Mapping[str, Sequence[str]]) -> list[str]:
    """``order`` re-sorted so that every arc goes forward (stable: earliest ready first); a cycle is an error."""
    preds: dict[str, set[str]] = {g: set() for g in order}
    for s, d in arcs:
        preds[d].add(s)
    out: list[str] = []
    left = list(order)
    while left:
        ready = next((g for g in left if preds[g] <= set(out)), None)
        if ready is None:
            raise PlanError(f"grouping {dict(groups)} makes a cycle among {left}: group components that the dataflow "
                            "can run as one step (parallel branches of one region, or consecutive stages)")
        out.append(ready)
        left.remove(ready)
    return out
