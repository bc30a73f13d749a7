"""Read a *switchboard* (verified component programs plus their wiring): :class:`Switchboard`.

``Switchboard.load`` reads the directory of [Note: switchboard layout] (docs/architecture.md) that
:func:`hpcsplit.switchboard.writer.export` wrote, checking the hash of every file it reads; it loads one
component's program at a time, runs the components in order, and verifies them on the golden inputs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.export.passes import move_to_device_pass
from torch.utils import _pytree as pytree

from hpcsplit.errors import SwitchboardError, VerificationError
from hpcsplit.switchboard import layout as L
from hpcsplit.switchboard.archive import load_program, validate_program
from hpcsplit.switchboard.split import run_pieces
from hpcsplit.switchboard.verify import VerifyReport, compare_outputs, tile_batch

__all__ = ["ComponentSpec", "Switchboard", "VerifyReport"]

ComponentSpec = L.ComponentSpec
DEFAULT_ATOL = L.DEFAULT_ATOL
DEFAULT_RTOL = L.DEFAULT_RTOL
_LAYOUT = L.LAYOUT_FILE
_GOLDEN = L.GOLDEN_FILE


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

        ``layout.json`` is validated and the golden file hashed; program files must lie inside
        the directory (no symlinks) with their recorded sizes, and are hashed and validated when
        read (all of them now with ``check_all``).  Every file is read once and loaded from the
        bytes that were hashed; nothing is unpickled and no code in a file runs (see
        [Note: program archive] in :mod:`hpcsplit.switchboard.archive`).

        Raises
        ------
        SwitchboardError
            Naming the missing, malformed, tampered or mismatched file.
        """
        root = Path(path)
        layout, digest = L.load_layout(root)
        for c in layout.components:
            what = f"program of component {c.name!r}"
            if check_all:
                validate_program(L.read_ref(root, c, what), f"{what} file {c.program!r}")
            else:
                L.check_file(root, c, what, full=False)
        if check_all:
            validate_program(L.read_ref(root, layout.whole, "whole-model program"),
                             f"whole-model program file {layout.whole.file!r}")
        else:
            L.check_file(root, layout.whole, "whole-model program", full=False)
        golden = _load_golden(L.read_ref(root, layout.golden, "golden"), layout)
        try:
            return cls(root, layout, digest, golden)
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError, NotImplementedError) as e:
            raise SwitchboardError(
                f"{root / _LAYOUT} is malformed: input_spec/output_spec are not pytree specs "
                f"({type(e).__name__}: {str(e)[:200]}); re-run the export"
            ) from e

    def _load_program(self, ref: L.FileRef | L.ComponentSpec, what: str) -> Any:
        """The program a layout entry names: read once, hash checked, validated, loaded from those bytes."""
        rel = ref.program if isinstance(ref, L.ComponentSpec) else ref.file
        return load_program(L.read_ref(self.path, ref, what), f"{what} file {rel!r}")

    def load_component(
        self, name: str, device: str | torch.device | None = None
    ) -> Callable[..., tuple[torch.Tensor, ...]]:
        """The program of one component: positional tensors (``spec.inputs`` order) -> tuple of tensors.

        Only that component's program is read (and its hash checked). With ``device`` the program
        is moved there (``torch.export.passes.move_to_device_pass``); inputs must be on it too.
        """
        if name not in self.components:
            raise SwitchboardError(f"found no component {name!r}; components: {list(self.components)}")
        key = self._cache_key(name, device)
        if key not in self._loaded:
            spec = self.components[name]
            ep = self._load_program(spec, f"program of component {name!r}")
            _match_program(ep, spec.inputs, spec.outputs, f"component {name!r}", spec.program)
            mod = _on_device(ep, device).module()
            check = _input_check(spec.inputs, f"component {name!r}")
            forward = _flat_forward(mod, len(spec.inputs), len(spec.outputs)) or mod.forward

            def run(*xs: torch.Tensor, _f: Any = forward, _c: Any = check) -> tuple[torch.Tensor, ...]:
                _c(xs)
                out = _f(*xs)
                if type(out) is tuple:  # the flat forward's answer (checked first: every call takes it)
                    return out
                # the module's own forward may give a list or a tuple subclass (a NamedTuple) or one tensor
                return tuple(out) if isinstance(out, (tuple, list)) else (out,)

            self._loaded[key] = run
        return self._loaded[key]

    def unload(self, name: str, device: str | torch.device | None = None) -> bool:
        """Forget the program :meth:`load_component` cached for ``name`` on ``device``.

        The cache holds the program's parameters (on a GPU: device memory) for as long as the
        switchboard lives; a caller that is done with a component drops them here.  Returns whether
        one was cached.
        """
        return self._loaded.pop(self._cache_key(name, device), None) is not None

    @staticmethod
    def _cache_key(name: str, device: str | torch.device | None) -> str:
        return f"{name}@{device}" if device is not None else name

    def load_whole(self, device: str | torch.device | None = None) -> Callable[..., tuple[torch.Tensor, ...]]:
        """The unsplit model: flat inputs (model input order) -> flat outputs (model output order)."""
        ep = self._load_program(self.layout.whole, "whole-model program")
        _match_program(ep, self.layout.inputs, self.layout.outputs, "the whole model", self.layout.whole.file)
        forward = _on_device(ep, device).module().forward
        in_spec = self._in_spec
        check = _input_check(self.layout.inputs, "the whole model")

        def run(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
            check(xs)
            args, kwargs = pytree.tree_unflatten(list(xs), in_spec)
            return tuple(pytree.tree_flatten(forward(*args, **kwargs))[0])

        return run

    # ------------------------------------------------------------------ inputs
    @property
    def golden_batch_size(self) -> int:
        return self.layout.golden_batch_size

    def example_inputs(self, batch_size: int | None = None) -> tuple[torch.Tensor, ...]:
        """Flat model inputs (the golden ones, tiled along the batch dims to ``batch_size``)."""
        bs = batch_size or self.golden_batch_size
        return tuple(tile_batch(self._golden[f"input.{t.name}"], t.batch_dims, bs) for t in self.layout.inputs)

    def component_example_inputs(self, batch_size: int | None = None) -> dict[str, tuple[torch.Tensor, ...]]:
        """Real activations for every component's inputs, tiled along the batch dims to ``batch_size``."""
        bs = batch_size or self.golden_batch_size
        out = {}
        for c in self.layout.components:
            out[c.name] = tuple(tile_batch(self._value(t.name), t.batch_dims, bs) for t in c.inputs)
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
        try:
            got = self.run_flat(self.example_inputs(bs))
            if bs == self.golden_batch_size:
                ref, what = self.golden_outputs(), "golden"
            else:
                with torch.no_grad():
                    ref, what = self.load_whole()(*self.example_inputs(bs)), "whole"
        except (RuntimeError, ValueError, IndexError, TypeError) as e:
            raise VerificationError(
                f"switchboard {self.path}: its programs fail on the inputs its layout describes at batch {bs} "
                f"({type(e).__name__}: {str(e)[:300]}); re-run the export"
            ) from e
        cmp = compare_outputs(got, ref, atol, rtol)
        max_abs, max_rel = cmp.max_abs_diff, cmp.max_rel_diff
        rep = VerifyReport(bs, max_abs, max_rel, atol, rtol, cmp.passed, what, time.perf_counter() - t0)
        if not cmp.passed:
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


def _load_golden(data: bytes, layout: L.Layout) -> dict[str, torch.Tensor]:
    """The golden tensors from the (hash-checked) bytes of the golden file; every key the layout needs."""
    from safetensors.torch import load

    rel = layout.golden.file
    try:
        golden = load(data)
    except Exception as e:  # safetensors raises SafetensorError, ValueError, ... on bad bytes
        raise SwitchboardError(
            f"golden file {rel!r} cannot be read ({type(e).__name__}: {str(e)[:200]}); re-run the export"
        ) from e
    inputs = {t.name for t in layout.inputs}
    needed = [f"input.{t.name}" for t in layout.inputs] + [f"output.{t.name}" for t in layout.outputs]
    needed += [f"act.{t.name}" for c in layout.components for t in c.inputs if t.name not in inputs]
    missing = [k for k in needed if k not in golden]
    if missing:
        raise SwitchboardError(
            f"golden file {rel!r} has no tensors {missing[:5]}; layout.json needs them; re-run the export"
        )
    return golden


def _flat_forward(mod: Any, n_in: int, n_out: int) -> Callable[..., tuple[torch.Tensor, ...]] | None:
    """``mod``'s forward on flat positional tensors returning the flat tuple of outputs, without the pytree
    flatten and unflatten ``ExportedProgram.module()`` wraps around its graph (``[Note: program calls]``);
    None when the program's inputs are not ``n_in`` positional tensors or its outputs not a flat tuple,
    list or single tensor of ``n_out`` (then the caller keeps the module's own forward)."""
    in_spec, out_spec = getattr(mod, "_in_spec", None), getattr(mod, "_out_spec", None)
    codegen = getattr(getattr(mod, "graph", None), "_codegen", None)
    if in_spec is None or out_spec is None or type(codegen) is not torch.fx.graph._PyTreeCodeGen:
        return None
    if in_spec != pytree.tree_flatten((tuple(range(n_in)), {}))[1]:
        return None
    flat_outs = [pytree.tree_flatten(x)[1] for x in (tuple(range(n_out)), list(range(n_out)))]
    if out_spec not in flat_outs and not (n_out == 1 and out_spec.is_leaf()):
        return None
    mod.graph._codegen = torch.fx.graph.CodeGen()  # the graph's own code: placeholders in, a tuple out
    mod.recompile()
    return mod.forward  # type: ignore[no-any-return]


def _input_check(specs: Sequence[L.TensorSpec], what: str) -> Callable[[Sequence[Any]], None]:
    """A check of a program's positional inputs against the layout, run before every call.

    [Note: program calls]
    A program runs through its ``forward``, not the module's ``__call__``: ``ExportedProgram.module()``
    adds pre-forward hooks that check the inputs against the export's constraints, and they cost 70-140 us
    a call (a served trivial component took 166 us a call with them, 95 without).  This check takes their
    place at a few microseconds: the count of inputs, each one's dtype, rank and fixed dims, and one batch
    size >= 1 over every batch dim -- what those constraints say for a program with one symbolic batch
    dimension, which is every program hpcsplit writes.  The (dtype, shape) signatures that passed are
    kept, so a call like an earlier one costs one set lookup.  The call itself skips the pytree flatten
    and unflatten the module's generated forward does around the graph (``_flat_forward``).  A served
    Linear(8, 8) took 51 us a call before these two, 15 us with them, 10 us eager.
    """
    expect = []
    for s in specs:
        dt = getattr(torch, s.dtype, None)
        if not isinstance(dt, torch.dtype):
            raise SwitchboardError(f"layout.json gives {what}'s input {s.name!r} dtype {s.dtype!r}, which is not a "
                                   "torch dtype; re-run the export")
        fixed = tuple((i, d) for i, d in enumerate(s.shape) if isinstance(d, int))
        expect.append((s.name, dt, len(s.shape), fixed, s.batch_dims, s.shape))
    n = len(expect)
    seen: set[tuple[Any, ...]] = set()  # (dtype, shape) of every input, of the calls that passed

    def check(xs: Sequence[Any]) -> None:
        if len(xs) != n:
            raise ValueError(f"{what} takes {n} input(s), got {len(xs)}")
        try:  # a served component sees a few batch sizes
            key: tuple[Any, ...] | None = tuple([(type(x), x.dtype, x.shape) for x in xs])
            if key in seen:
                return
        except (AttributeError, TypeError):  # not tensors, or a shape that does not hash: the full check
            key = None
        batch = -1
        for x, (name, dt, nd, fixed, bdims, shape) in zip(xs, expect, strict=True):
            ok = isinstance(x, torch.Tensor) and x.dtype == dt and x.dim() == nd
            if ok:
                sh = x.shape
                ok = all(sh[i] == d for i, d in fixed)
                for i in bdims:
                    batch = sh[i] if batch < 0 else batch
                    ok = ok and sh[i] == batch >= 1
            if not ok:
                got = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
                raise ValueError(f"{what}: input {name!r} is {got}; it takes {dt} of shape {list(shape)} "
                                 "(one batch size >= 1 in every 'batch' dim)")
        if key is not None and len(seen) < 4096:
            seen.add(key)

    return check


def _match_program(ep: Any, inputs: Sequence[L.TensorSpec], outputs: Sequence[L.TensorSpec], what: str,
                   rel: str) -> None:
    """Refuse a program whose own inputs and outputs are not what layout.json says.

    The check before each call (``_input_check``) is built from the layout, so the layout must agree
    with the program: as many inputs and outputs, each input of the same dtype, rank and fixed dims,
    with a symbolic dim exactly where the layout has ``batch``.  A layout edited after the export fails
    here, at load, and not inside the program.
    """
    sig = ep.graph_signature
    n_in = sum(1 for s in sig.input_specs if s.kind.name == "USER_INPUT")
    n_out = sum(1 for s in sig.output_specs if s.kind.name == "USER_OUTPUT")
    if (n_in, n_out) != (len(inputs), len(outputs)):
        raise SwitchboardError(
            f"program {rel!r} of {what} takes {n_in} input(s) and gives {n_out} output(s); layout.json records "
            f"{len(inputs)} and {len(outputs)}; the file belongs to another export; re-run the export"
        )
    placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    users = [placeholders.get(s.arg.name) for s in sig.input_specs if s.kind.name == "USER_INPUT"]
    for spec, node in zip(inputs, users, strict=True):
        v = None if node is None else node.meta.get("val")
        if not isinstance(v, torch.Tensor):
            raise SwitchboardError(f"program {rel!r} of {what} records no tensor for input {spec.name!r}; "
                                   "the file was not written by torch.export; re-run the export")
        shape = [L.BATCH if isinstance(d, torch.SymInt) else int(d) for d in v.shape]
        dt = str(v.dtype).removeprefix("torch.")
        if dt != spec.dtype or shape != list(spec.shape):
            raise SwitchboardError(
                f"layout.json says {what} takes input {spec.name!r} as {spec.dtype} {list(spec.shape)}, but its "
                f"program {rel!r} takes {dt} {shape}; the layout was edited or belongs to another export; "
                "re-run the export")


def _on_device(ep: Any, device: str | torch.device | None) -> Any:
    if device is None or torch.device(device).type == "cpu":
        return ep
    return move_to_device_pass(ep, torch.device(device))


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)  # pragma: no cover


