"""The layer rule of ``docs/architecture.md``, checked on the package's import graph (an AST walk).

- ``core`` imports only ``errors`` (and itself); ``switchboard`` imports ``core``; ``profiling``,
  ``allocation`` and ``runtime`` import ``core`` and ``switchboard``, never each other; ``launch`` and
  ``bench`` may import anything; ``errors`` imports nothing of hpcsplit.
- No cycle among modules.
- No import inside a function, except the heavy libraries below that keep ``import hpcsplit`` (and the
  login node's ``python -m hpcsplit``) cheap.
- ``_name`` is private to its folder: no module imports another folder's ``_name``.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import networkx as nx
import pytest

PKG = Path(__file__).resolve().parents[2] / "hpcsplit"

# What each layer may import (besides itself).
ALLOWED: dict[str, set[str] | None] = {
    "errors": set(),
    "core": {"errors"},
    "switchboard": {"errors", "core"},
    "profiling": {"errors", "core", "switchboard"},
    "allocation": {"errors", "core", "switchboard"},
    "runtime": {"errors", "core", "switchboard"},
    "launch": None,  # anything
    "bench": None,
    "top": None,  # hpcsplit/__init__.py (lazy, by name) and __main__.py
}

# Imports allowed inside functions, each with its reason.
LAZY_OK: dict[str, str] = {
    "torch": "1-3 s to import; the launch layer and `import hpcsplit` must not pay it on a login node",
    "cvxpy": "about 1 s; only the allocate stage solves",
    "highspy": "the HiGHS solver, with cvxpy",
    "scipy": "the allocate benchmark's reference MILP only",
    "h5py": "HDF5 library load; only stages that read or write a profile or batch file",
    "mpi4py": "initialises MPI on import: only rank processes may import it",
    "hydra": "the Hydra app: only `python -m hpcsplit` needs it",
    "omegaconf": "Hydra's config objects: only the Hydra app and its tests",
    "submitit": "only launcher=slurm submits",
    "matplotlib": "about 0.5 s; only the plots",
    "graphviz": "only the export's picture of the split, and only where graphviz's dot is installed",
    "transformers": "seconds to import; only the CLIP models",
    "safetensors": "only reading and writing switchboard weights (pulls torch)",
    "pynvml": "NVML: only on GPU machines, and it may be absent",
    "yaml": "only reading conf/ defaults outside Hydra",
    "hpcsplit.core.mpi": "imports mpi4py (MPI starts on import): rank entry points in modules that also serve "
                         "the login side (profiling.stage runs stage=analyze there) import it when they run",
}


@dataclass
class Graph:
    """Module -> imported hpcsplit modules; plus the offending imports found on the way."""

    edges: dict[str, set[str]] = field(default_factory=dict)
    in_function: list[tuple[str, str, int]] = field(default_factory=list)  # (module, imported, line)
    private: list[tuple[str, str, int]] = field(default_factory=list)


def module_name(path: Path, pkg: Path = PKG) -> str:
    rel = path.relative_to(pkg.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(mod: str) -> str:
    parts = mod.split(".")
    if len(parts) == 1 or parts[1] in ("__init__", "__main__"):
        return "top"
    return parts[1]


def _folder(mod: str, is_pkg: bool) -> str:
    return mod if is_pkg else mod.rpartition(".")[0]


def scan(pkg: Path = PKG) -> Graph:
    g = Graph()
    modules = {module_name(p, pkg): p for p in sorted(pkg.rglob("*.py"))}
    for mod, path in modules.items():
        g.edges.setdefault(mod, set())
        is_pkg = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), str(path))

        def visit(node: ast.AST, in_fn: bool, mod: str = mod, is_pkg: bool = is_pkg) -> None:
            for ch in ast.iter_child_nodes(node):
                fn = in_fn or isinstance(ch, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
                if isinstance(ch, ast.Import | ast.ImportFrom):
                    for target, names in _targets(ch, mod, is_pkg):
                        top = target.split(".")[0]
                        if fn and top not in LAZY_OK and target not in LAZY_OK and \
                                not any(f"{target}.{n}" in LAZY_OK for n in names):
                            g.in_function.append((mod, target, ch.lineno))
                        if top != "hpcsplit":
                            continue
                        resolved = target
                        for n in names:  # `from hpcsplit.x import y`: y may be a module
                            sub = f"{target}.{n}"
                            if sub in modules:
                                g.edges[mod].add(sub)
                                resolved = ""
                                where = target  # the folder holding module y
                            else:
                                where = target if _is_pkg(modules, target) else target.rpartition(".")[0]
                            if _private(n) and where != _folder(mod, is_pkg):
                                g.private.append((mod, sub, ch.lineno))
                        if resolved and resolved in modules:
                            g.edges[mod].add(resolved)
                        parts = target.split(".")
                        for i, part in enumerate(parts[1:], start=1):
                            if _private(part) and ".".join(parts[:i]) != _folder(mod, is_pkg):
                                g.private.append((mod, target, ch.lineno))
                visit(ch, fn)

        visit(tree, False)
    return g


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _is_pkg(modules: Mapping[str, Path], mod: str) -> bool:
    return mod in modules and modules[mod].name == "__init__.py"


def _targets(node: ast.Import | ast.ImportFrom, mod: str, is_pkg: bool) -> list[tuple[str, list[str]]]:
    if isinstance(node, ast.Import):
        return [(a.name, []) for a in node.names]
    base = node.module or ""
    if node.level:
        pkg = mod.split(".") if is_pkg else mod.split(".")[:-1]
        pkg = pkg[: len(pkg) - (node.level - 1)]
        base = ".".join(pkg + ([node.module] if node.module else []))
    return [(base, [a.name for a in node.names])]


def problems(g: Graph, allowed: Mapping[str, set[str] | None] = ALLOWED) -> list[str]:
    """Every broken rule of graph ``g``, one line each (empty: the layout holds)."""
    out = []
    for mod, targets in sorted(g.edges.items()):
        src = layer_of(mod)
        ok = allowed.get(src, set())
        for t in sorted(targets):
            dst = layer_of(t)
            if dst == src or ok is None:
                continue
            if dst not in ok:
                out.append(f"layer: {mod} ({src}) imports {t} ({dst}); {src} may import {sorted(ok) or 'nothing'}")
    dg = nx.DiGraph([(a, b) for a, ts in g.edges.items() for b in ts if a != b])
    # a package's __init__ importing its own submodules is how packages work; not a cycle of modules
    dg.remove_edges_from([(a, b) for a, b in list(dg.edges) if b.startswith(a + ".")])
    for cyc in sorted(sorted(c) for c in nx.simple_cycles(dg)):
        out.append("cycle: " + " -> ".join(cyc))
    for mod, t, line in g.in_function:
        out.append(f"in-function import: {mod}:{line} imports {t} inside a function (move it to the top, "
                   f"or add the library to LAZY_OK with its reason)")
    for mod, t, line in g.private:
        out.append(f"private: {mod}:{line} imports {t}, private to another folder")
    return out


def test_the_package_keeps_the_layer_rule() -> None:
    found = problems(scan())
    assert not found, "\n".join(found)


def test_the_rule_catches_a_cycle_and_a_cross_stage_import() -> None:
    g = Graph(edges={
        "hpcsplit.core.plan": {"hpcsplit.errors"},
        "hpcsplit.runtime.stage": {"hpcsplit.core.plan", "hpcsplit.profiling.measure"},  # cross-stage
        "hpcsplit.profiling.measure": {"hpcsplit.core.device"},
        "hpcsplit.core.device": {"hpcsplit.core.plan", "hpcsplit.switchboard.reader"},  # core -> switchboard
        "hpcsplit.switchboard.reader": {"hpcsplit.core.device"},  # ... and back: a cycle
    })
    found = problems(g)
    assert any(p.startswith("layer: hpcsplit.runtime.stage") and "hpcsplit.profiling.measure" in p for p in found)
    assert any(p.startswith("layer: hpcsplit.core.device") for p in found)
    assert any(p.startswith("cycle:") and "hpcsplit.core.device" in p and "hpcsplit.switchboard.reader" in p
               for p in found)
    # the same graph without the bad edges passes
    g.edges["hpcsplit.runtime.stage"].discard("hpcsplit.profiling.measure")
    g.edges["hpcsplit.core.device"].discard("hpcsplit.switchboard.reader")
    assert problems(g) == []


def test_the_scan_finds_in_function_and_private_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "hpcsplit"
    for d in ("core", "runtime"):
        (pkg / d).mkdir(parents=True)
        (pkg / d / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "core" / "_helpers.py").write_text("X = 1\n")
    (pkg / "runtime" / "a.py").write_text(
        "from hpcsplit.core._helpers import X\n"
        "def f():\n    import torch\n    from hpcsplit.core import _helpers\n    return torch, _helpers, X\n"
    )
    g = scan(pkg)
    assert [(m, t) for m, t, _ in g.in_function] == [("hpcsplit.runtime.a", "hpcsplit.core")]
    assert {t for _, t, _ in g.private} == {"hpcsplit.core._helpers"}


@pytest.mark.parametrize("lib", sorted(LAZY_OK))
def test_every_lazy_library_has_a_reason(lib: str) -> None:
    assert len(LAZY_OK[lib]) > 10
