"""Export a model as a *switchboard*: verified component programs plus their wiring.

``export`` captures the model, measures its nodes, partitions the dataflow graph, cuts and
re-exports every component, writes the directory of [Note: switchboard layout]
(docs/architecture.md) and verifies the components against the model on golden inputs.
``Switchboard.load`` reads it back, checking the hash of every file it reads.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

from hpcsplit import _layout as L
from hpcsplit._split import export_piece, run_pieces, split_graph
from hpcsplit.capture import ComputeGraph, capture, dataflow_graph, measure_nodes
from hpcsplit.errors import SwitchboardError, VerificationError
from hpcsplit.partition import find_regions, partition

__all__ = ["ComponentSpec", "Switchboard", "VerifyReport", "export", "run_export"]

ComponentSpec = L.ComponentSpec
DEFAULT_ATOL = 1e-5
DEFAULT_RTOL = 1e-4
_LAYOUT = "layout.json"
_GOLDEN = "golden.safetensors"


@dataclass(frozen=True, slots=True)
class VerifyReport:
    """Split components against a reference on the same inputs."""

    batch_size: int
    max_abs_diff: float
    max_rel_diff: float
    atol: float
    rtol: float
    passed: bool
    reference: str  # "golden" (the eager model's outputs) or "whole" (the unsplit program)
    seconds: float

    def to_json(self) -> dict[str, Any]:
        return {
            "batch_size": self.batch_size,
            "max_abs_diff": self.max_abs_diff,
            "max_rel_diff": self.max_rel_diff,
            "atol": self.atol,
            "rtol": self.rtol,
            "passed": self.passed,
            "reference": self.reference,
            "seconds": self.seconds,
        }


def _compare(got: Sequence[torch.Tensor], ref: Sequence[torch.Tensor], atol: float, rtol: float) -> tuple:
    max_abs = max_rel = 0.0
    ok = True
    for a, b in zip(got, ref, strict=True):
        if a.shape != b.shape or a.dtype != b.dtype:
            return float("inf"), float("inf"), False
        if not a.is_floating_point():
            same = bool(torch.equal(a, b))
            ok &= same
            max_abs = max(max_abs, 0.0 if same else float("inf"))
            continue
        a, b = a.detach().double(), b.detach().double()
        d = (a - b).abs()
        if d.numel():
            max_abs = max(max_abs, float(d.max()))
            big = b.abs() > atol
            if bool(big.any()):
                max_rel = max(max_rel, float((d[big] / b.abs()[big]).max()))
            ok &= bool((d <= atol + rtol * b.abs()).all())
    return max_abs, max_rel, ok


def _tile(t: torch.Tensor, dims: Sequence[int], batch_size: int) -> torch.Tensor:
    for d in dims:
        n = t.shape[d]
        if n == batch_size:
            continue
        reps = [1] * t.dim()
        reps[d] = -(-batch_size // n)
        t = t.repeat(*reps).narrow(d, 0, batch_size)
    return t.contiguous()


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
    import hashlib

    h = hashlib.sha256(cg.exported.graph_module.code.encode())
    for k, v in sorted(cg.exported.state_dict.items()):
        h.update(f"{k}:{tuple(v.shape)}:{v.dtype}".encode())
    return h.hexdigest()


class Switchboard:
    """A loaded switchboard directory (see [Note: switchboard layout]).

    Use :meth:`load`; calling the object runs the components in order and returns what the model
    returns.
    """

    def __init__(
        self, path: Path, layout: L.Layout, layout_sha256: str, golden: dict[str, torch.Tensor]
    ) -> None:
        self.path = path
        self.layout = layout
        self.sha256 = layout_sha256
        self.model_name = layout.model
        self.components: dict[str, L.ComponentSpec] = {c.name: c for c in layout.components}
        self.order: tuple[str, ...] = layout.order
        self.edges: tuple[L.Edge, ...] = layout.edges
        self._golden = golden
        self._loaded: dict[str, Callable[..., tuple[torch.Tensor, ...]]] = {}
        self._in_spec = pytree.treespec_loads(layout.input_spec)
        self._out_spec = pytree.treespec_loads(layout.output_spec)

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(cls, path: str | Path, *, check_all: bool = False) -> Switchboard:
        """Open a switchboard directory.

        ``layout.json`` is validated and the golden file hashed; program files must exist with
        their recorded sizes and are hashed when read (all of them now with ``check_all``).
        Nothing is unpickled.

        Raises
        ------
        SwitchboardError
            Naming the missing, malformed, tampered or mismatched file.
        """
        root = Path(path)
        layout_path = root / _LAYOUT
        layout = L.read_layout(layout_path)
        digest = L.sha256_file(layout_path)
        for c in layout.components:
            L.check_file(root, c, f"program of component {c.name!r}", full=check_all)
        L.check_file(root, layout.whole, "whole-model program", full=check_all)
        gpath = L.check_file(root, layout.golden, "golden", full=True)
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            golden = load_file(str(gpath))
        except (SafetensorError, OSError, ValueError) as e:
            raise SwitchboardError(f"golden file {gpath} cannot be read ({e}); re-run the export") from e
        return cls(root, layout, digest, golden)

    def _load_program(self, rel: str, ref: L.FileRef | L.ComponentSpec, what: str) -> Any:
        path = L.check_file(self.path, ref, what, full=True)
        _refuse_pickles(path, what)
        try:
            ep = torch.export.load(str(path))
        except Exception as e:
            raise SwitchboardError(f"{what} file {path} cannot be loaded by torch.export.load: {e}") from e
        return ep

    def load_component(
        self, name: str, device: str | torch.device | None = None
    ) -> Callable[..., tuple[torch.Tensor, ...]]:
        """The program of one component: positional tensors (``spec.inputs`` order) -> tuple of tensors.

        Only that component's program is read (and its hash checked). With ``device`` the program
        is moved there (``torch.export.passes.move_to_device_pass``); inputs must be on it too.
        """
        if name not in self.components:
            raise SwitchboardError(f"found no component {name!r}; components: {list(self.components)}")
        key = f"{name}@{device}" if device is not None else name
        if key not in self._loaded:
            spec = self.components[name]
            ep = self._load_program(spec.program, spec, f"program of component {name!r}")
            n_in = sum(1 for s in ep.graph_signature.input_specs if s.kind.name == "USER_INPUT")
            if n_in != len(spec.inputs):
                raise SwitchboardError(
                    f"program {self.path / spec.program} takes {n_in} inputs; layout.json records "
                    f"{len(spec.inputs)} for {name!r}; the file belongs to another export; re-run the export"
                )
            mod = _on_device(ep, device).module()

            def run(*xs: torch.Tensor, _m: Any = mod) -> tuple[torch.Tensor, ...]:
                out = _m(*xs)
                return tuple(out) if isinstance(out, (tuple, list)) else (out,)

            self._loaded[key] = run
        return self._loaded[key]

    def load_whole(self, device: str | torch.device | None = None) -> Callable[..., tuple[torch.Tensor, ...]]:
        """The unsplit model: flat inputs (model input order) -> flat outputs (model output order)."""
        ep = self._load_program(self.layout.whole.file, self.layout.whole, "whole-model program")
        mod = _on_device(ep, device).module()
        in_spec = self._in_spec

        def run(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
            args, kwargs = pytree.tree_unflatten(list(xs), in_spec)
            return tuple(pytree.tree_flatten(mod(*args, **kwargs))[0])

        return run

    # ------------------------------------------------------------------ inputs
    @property
    def golden_batch_size(self) -> int:
        return self.layout.golden_batch_size

    def example_inputs(self, batch_size: int | None = None) -> tuple[torch.Tensor, ...]:
        """Flat model inputs (the golden ones, tiled along the batch dims to ``batch_size``)."""
        bs = batch_size or self.golden_batch_size
        return tuple(_tile(self._golden[f"input.{t.name}"], t.batch_dims, bs) for t in self.layout.inputs)

    def component_example_inputs(self, batch_size: int | None = None) -> dict[str, tuple[torch.Tensor, ...]]:
        """Real activations for every component's inputs, tiled along the batch dims to ``batch_size``."""
        bs = batch_size or self.golden_batch_size
        out = {}
        for c in self.layout.components:
            out[c.name] = tuple(_tile(self._value(t.name), t.batch_dims, bs) for t in c.inputs)
        return out

    def _value(self, name: str) -> torch.Tensor:
        for key in (f"act.{name}", f"input.{name}"):
            if key in self._golden:
                return self._golden[key]
        raise SwitchboardError(f"golden file {self.path / _GOLDEN} has no value {name!r}; re-run the export")

    def golden_outputs(self) -> tuple[torch.Tensor, ...]:
        """The model's outputs on the golden inputs (from the eager model at export time)."""
        return tuple(self._golden[f"output.{t.name}"] for t in self.layout.outputs)

    # ------------------------------------------------------------------ running
    def run_flat(self, flat_inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Run the components in order on flat model inputs; return flat outputs."""
        if len(flat_inputs) != len(self.layout.inputs):
            raise SwitchboardError(
                f"found {len(flat_inputs)} inputs; needed {len(self.layout.inputs)} "
                f"({[t.name for t in self.layout.inputs]})"
            )
        env = dict(zip((t.name for t in self.layout.inputs), flat_inputs, strict=True))
        fns = [self.load_component(n) for n in self.order]
        names = [
            (tuple(t.name for t in c.inputs), tuple(t.name for t in c.outputs))
            for c in self.layout.components
        ]
        with torch.no_grad():
            run_pieces(fns, names, env)
        return tuple(env[v] for v in self.layout.output_values)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the components in order; returns what the model returns (same pytree structure)."""
        flat, spec = pytree.tree_flatten((args, kwargs))
        if spec != self._in_spec:
            raise SwitchboardError(
                f"found inputs structured as {spec}; needed {self._in_spec} (the model's forward arguments)"
            )
        return pytree.tree_unflatten(list(self.run_flat(flat)), self._out_spec)

    def verify(
        self, atol: float = DEFAULT_ATOL, rtol: float = DEFAULT_RTOL, *, batch_size: int | None = None
    ) -> VerifyReport:
        """Run the components and compare with a reference.

        Without ``batch_size`` (or at the golden batch) the reference is the golden outputs of the
        eager model; at another batch size it is the whole-model program on tiled golden inputs.

        Raises
        ------
        VerificationError
            When some output differs beyond ``atol + rtol * |reference|``.
        """
        t0 = time.perf_counter()
        bs = batch_size or self.golden_batch_size
        got = self.run_flat(self.example_inputs(bs))
        if bs == self.golden_batch_size:
            ref, what = self.golden_outputs(), "golden"
        else:
            with torch.no_grad():
                ref, what = self.load_whole()(*self.example_inputs(bs)), "whole"
        max_abs, max_rel, ok = _compare(got, ref, atol, rtol)
        rep = VerifyReport(bs, max_abs, max_rel, atol, rtol, ok, what, time.perf_counter() - t0)
        if not ok:
            raise VerificationError(
                f"switchboard {self.path}: components differ from the {what} outputs at batch {bs}: "
                f"max abs diff {max_abs:.3g}, max rel diff {max_rel:.3g}; needed within atol={atol:g}, "
                f"rtol={rtol:g}; re-export, or loosen verify.atol/verify.rtol if the model is not fp32"
            )
        return rep

    def table(self) -> str:
        """A text table of the components: name, parameters, inputs -> outputs, bytes per sample."""
        rows = [("component", "params", "inputs -> outputs", "in B/sample", "out B/sample")]
        for c in self.layout.components:
            rows.append(
                (
                    c.name,
                    _human(c.param_bytes),
                    f"{', '.join(t.name for t in c.inputs)} -> {', '.join(t.name for t in c.outputs)}",
                    str(c.input_bytes_per_sample),
                    str(c.output_bytes_per_sample),
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in rows)

    def __repr__(self) -> str:
        return f"Switchboard({str(self.path)!r}, model={self.model_name!r}, components={list(self.order)})"


def _refuse_pickles(path: Path, what: str) -> None:
    """Refuse a program archive that carries pickled data (``torch.export.load`` would unpickle it).

    hpcsplit saves programs without example inputs, so ``sample_inputs`` entries are empty.
    """
    import zipfile

    try:
        with zipfile.ZipFile(path) as z:
            pickled = [i.filename for i in z.infolist() if "/sample_inputs/" in i.filename and i.file_size > 0]
    except (zipfile.BadZipFile, OSError) as e:
        raise SwitchboardError(f"{what} file {path} is not a torch.export archive ({e}); re-run the export") from e
    if pickled:
        raise SwitchboardError(
            f"{what} file {path} carries pickled data ({pickled[0]}); hpcsplit loads no pickles; "
            "re-export it with hpcsplit.export"
        )


def _save_program(ep: Any, path: Path) -> None:
    """``torch.export.save`` without the pickled example inputs (weights are raw bytes, graph JSON)."""
    ep.example_inputs = None
    torch.export.save(ep, str(path))


def _on_device(ep: Any, device: str | torch.device | None) -> Any:
    if device is None or torch.device(device).type == "cpu":
        return ep
    from torch.export.passes import move_to_device_pass

    return move_to_device_pass(ep, torch.device(device))


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)  # pragma: no cover


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
    **partition_options: Any,
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
        Sequential cuts (see :func:`hpcsplit.partition.partition`).
    atol, rtol
        Verification tolerance against the eager model's outputs.
    dynamic_batch
        One program for every batch size (``Dim("batch")`` on dim 0).
    timing_batch, timing_repeats, cost, device
        The timing pass: batch, passes, ``"measured"`` latency or ``"flops"``, device.
    **partition_options
        ``min_branch_fraction``, ``max_branches``, ``cut_slack``.

    Returns
    -------
    Switchboard
        The loaded result.

    Raises
    ------
    CaptureError, PartitionError, VerificationError
    """
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
    regions = find_regions(
        g,
        min_branch_fraction=float(partition_options.get("min_branch_fraction", 0.05)),
        max_branches=int(partition_options.get("max_branches", 8)),
    )
    comps = partition(g, stages=stages, max_stage_ms=max_stage_ms, **partition_options)
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

    final = Path(out)
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
        whole_rep = _compare(sb.load_whole()(*sb.example_inputs()), sb.golden_outputs(), atol, rtol)
        lap("verify_whole")
        verification = {
            **report.to_json(),
            "whole_max_abs_diff": whole_rep[0],
            "export_seconds": time.perf_counter() - t_start,
            "phases_s": phases,
        }
        d = json.loads((tmp / _LAYOUT).read_text())
        d["verification"] = verification
        (tmp / _LAYOUT).write_text(json.dumps(d, indent=2) + "\n")
        if final.exists():
            if not overwrite:
                raise SwitchboardError(f"found existing {final}; needed a new directory or overwrite=True")
            shutil.rmtree(final)
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Switchboard.load(final)


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


# ---------------------------------------------------------------------------- the Hydra stage


def run_export(cfg: dict, run_dir: Path) -> dict:
    """The ``export`` stage: build ``cfg['model']``, export it into the run folder, print a table.

    Returns
    -------
    dict
        ``switchboard`` (path), ``sha256``, ``components``, ``verification``, ``seconds``.
    """
    from hpcsplit.models import build_model

    t0 = time.perf_counter()
    model, args, kwargs = build_model(cfg.get("model", {}))
    part = dict(cfg.get("partition") or {})
    ver = dict(cfg.get("verify") or {})
    dirname = (
        (cfg.get("paths") or {}).get("switchboard_dirname") or cfg.get("switchboard_dirname") or "switchboard"
    )
    out = Path(run_dir) / dirname
    options = {
        k: part[k] for k in ("min_branch_fraction", "max_branches", "cut_slack") if part.get(k) is not None
    }
    sb = export(
        model,
        args,
        kwargs,
        out=out,
        name=str(cfg.get("model", {}).get("name") or type(model).__name__),
        stages=part.get("stages"),
        max_stage_ms=part.get("max_stage_ms"),
        atol=float(ver.get("atol", DEFAULT_ATOL)),
        rtol=float(ver.get("rtol", DEFAULT_RTOL)),
        timing_batch=part.get("timing_batch"),
        timing_repeats=int(part.get("timing_repeats", 3)),
        cost=str(part.get("cost", "measured")),
        device=part.get("device"),
        **options,
    )
    v = sb.layout.verification
    print(f"switchboard {out}  ({sb.model_name}, sha256 {sb.sha256[:12]})")
    print(sb.table())
    print(
        f"verified at batch {v.get('batch_size')}: max abs diff {v.get('max_abs_diff'):.3g}, "
        f"max rel diff {v.get('max_rel_diff'):.3g} (atol {v.get('atol')}, rtol {v.get('rtol')})"
    )
    return {
        "switchboard": str(out),
        "sha256": sb.sha256,
        "model": sb.model_name,
        "components": list(sb.order),
        "verification": v,
        "seconds": time.perf_counter() - t0,
    }
