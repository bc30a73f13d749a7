"""Program archives that cannot carry code: validate a ``.pt2`` before ``torch.export.load`` sees it.

[Note: program archive] ``torch.export.load`` runs code from an archive in several ways: entries
marked ``use_pickle`` (torch's unrestricted unpickling loader), legacy ``data/weights/<model>.pt`` and
``data/constants/<model>.pt`` files and non-empty sample inputs (``torch.load``, retried without
``weights_only``), ``custom_obj_*``/``opaque_obj_*`` constants (unpickled), symbolic size
expressions (``sympy.sympify``, which evaluates Python), ``guards_code`` (``exec``'d into the
program's guard function), node targets (any attribute reachable from ``torch``, e.g.
``torch.os.system``) and AOTInductor members (shared libraries).  hpcsplit's writer
(:func:`hpcsplit.switchboard.writer.export`, ``torch.export.save`` without example inputs) writes
none of these, so :func:`load_program` accepts exactly what it writes:

- a stored (uncompressed) zip with one top folder, no absolute or ``..`` names, no duplicates,
  members within :data:`MAX_MEMBERS` and the archive's own size;
- members named as in :data:`_FIXED` plus ``data/weights/weight_<n>`` and
  ``data/constants/tensor_<n>`` (raw tensor bytes), an empty ``data/sample_inputs/model.pt``;
- payload configs whose every entry is a raw tensor (``use_pickle`` false) naming such a member;
- ``models/model.json`` whose size expressions match :func:`check_expr`, guards match
  :func:`check_guard`, node targets match :func:`check_target` and are on the operator allowlist
  (:func:`aten_refusal`), with no custom objects, subgraphs, operator arguments or tokens.

[Note: ATen allowlist]
A program of plain ATen operators can still have effects outside its outputs: ``aten.save`` writes a
file, ``aten.from_file`` reads one, ``aten._print`` and ``aten.warn`` write to the console,
``aten.manual_seed`` sets the process's random state, in-place and ``out=`` operators (``aten.relu_``,
``aten.copy_``, ``aten.set_``) write into the caller's tensors.  An operator is allowed only when torch
(the version loading it) has it, its schema writes into none of its arguments (``is_mutable`` false:
no ``Tensor(a!)``), and it returns something: an operator that returns nothing runs only for an effect,
except the assertions torch.export writes itself (:data:`_ASSERTS`, which only raise).  ``from_file``
returns a tensor and is refused by name.  torch.export's functional IR, which hpcsplit's export writes,
meets all of this; the check reads torch's operator registry, never the archive's code.

The validated members are then written into a fresh archive in memory (torch's own writer), so the
zip reader of torch sees exactly the bytes Python's ``zipfile`` validated.  The archive bytes are
the ones whose hash was checked: nothing is read from disk again.
"""

from __future__ import annotations

import ast
import functools
import io
import json
import re
import zipfile
from typing import Any

from hpcsplit.errors import SwitchboardError

__all__ = ["MAX_MEMBERS", "aten_refusal", "check_expr", "check_guard", "check_target", "load_program",
           "validate_program"]

MAX_MEMBERS = 100_000
MAX_JSON_BYTES = 256 << 20  # model.json and the payload configs
MAX_TEXT = 4096  # one expression or guard
_FIXED = {
    "archive_format": b"pt2",
    "archive_version": b"0",
    "byteorder": None,
    ".data/version": None,
    ".data/serialization_id": None,
    "models/model.json": None,
    "data/sample_inputs/model.pt": b"",
    "data/weights/model_weights_config.json": None,
    "data/constants/model_constants_config.json": None,
}
_PAYLOAD = re.compile(r"data/(weights/weight|constants/tensor)_[0-9]{1,9}")
_SYMBOL = re.compile(r"[su][0-9]{1,9}")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,199}")
# op names: plain ones, or ATen's operator dunders (never __class__, __init__ and the like)
_ATEN = re.compile(r"torch\.ops\.aten\.(_?[a-z][A-Za-z0-9_]*|__i?(?:and|or|xor|lshift|rshift)__)"
                   r"\.([A-Za-z][A-Za-z0-9_]*)")
_ATEN_REFUSED = {"from_file"}  # reads a file named in the program
# assertions torch.export may write (they return nothing, and only raise): [Note: ATen allowlist]
_ASSERTS = {"_assert_async", "_assert_scalar", "_assert_tensor_metadata", "sym_constrain_range",
            "sym_constrain_range_for_size", "_functional_assert_async", "_functional_assert_scalar"}
_PY_TARGETS = {
    *(f"_operator.{n}" for n in (
        "getitem", "add", "sub", "mul", "floordiv", "mod", "truediv", "neg", "pos", "pow",
        "eq", "ne", "lt", "le", "gt", "ge", "and_", "or_", "not_",
    )),
    *(f"torch.sym_{n}" for n in ("max", "min", "not", "float", "int", "sqrt", "ite", "sum")),
    "math.ceil", "math.floor", "math.trunc",
}
_EXPR_CALLS = {
    "Symbol", "Integer", "Max", "Min", "Add", "Mul", "FloorDiv", "Mod", "PythonMod",
    "Eq", "Ne", "Lt", "Le", "Gt", "Ge",
}
_SYMBOL_FLAGS = {"positive", "integer", "nonnegative", "real"}
_REFUSED_KEYS = {  # model.json keys that carry custom objects, subgraphs or operators by name
    "as_custom_obj": "a custom object argument",
    "as_graph": "a subgraph",
    "as_operator": "an operator argument",
    "custom_obj": "a custom object input",
    "token": "an effect token",
}
_BINOPS = (ast.Add, ast.Sub, ast.Mult, ast.FloorDiv, ast.Mod)
_CMPOPS = (ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE)


def _refuse(what: str, reason: str) -> SwitchboardError:
    return SwitchboardError(
        f"{what} is refused: {reason}; hpcsplit loads only programs as its export writes them "
        "(raw tensor bytes, no pickles or code); re-export it with hpcsplit.export"
    )


def _parse(text: str) -> ast.expr | None:
    """``text`` as one Python expression (parsing runs nothing), or None."""
    if not isinstance(text, str) or len(text) > MAX_TEXT:
        return None
    try:
        return ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


def _int(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and type(node.value) is int


def _arith(node: ast.expr, leaf: Any) -> bool:
    """Integers, ``leaf`` nodes, ``+ - * // %``, unary minus, comparisons, ``and``/``or``/``not``,
    ``Max``/``Min`` (iteratively: no recursion limit to hit)."""
    stack = [node]
    while stack:
        n = stack.pop()
        if _int(n) or leaf(n):
            continue
        if isinstance(n, ast.BinOp) and isinstance(n.op, _BINOPS):
            stack += [n.left, n.right]
        elif isinstance(n, ast.UnaryOp) and isinstance(n.op, (ast.USub, ast.UAdd, ast.Not)):
            stack.append(n.operand)
        elif isinstance(n, ast.Compare) and all(isinstance(o, _CMPOPS) for o in n.ops):
            stack += [n.left, *n.comparators]
        elif isinstance(n, ast.BoolOp):
            stack += n.values
        elif (isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("Max", "Min")
              and n.args and not n.keywords):
            stack += n.args
        else:
            return False
    return True


def _expr_leaf(n: ast.expr) -> bool:
    if isinstance(n, ast.Name):
        return bool(_SYMBOL.fullmatch(n.id))
    if not (isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in _EXPR_CALLS):
        return False
    name = n.func.id
    if name == "Symbol":  # Symbol('s77', positive=True, integer=True): torch 2.13's srepr form
        return (
            len(n.args) == 1 and isinstance(n.args[0], ast.Constant) and isinstance(n.args[0].value, str)
            and bool(_SYMBOL.fullmatch(n.args[0].value))
            and all(k.arg in _SYMBOL_FLAGS and isinstance(k.value, ast.Constant)
                    and type(k.value.value) is bool for k in n.keywords)
        )
    if name == "Integer":
        return len(n.args) == 1 and not n.keywords and (
            _int(n.args[0]) or (isinstance(n.args[0], ast.UnaryOp) and isinstance(n.args[0].op, ast.USub)
                                and _int(n.args[0].operand))
        )
    return bool(n.args) and not n.keywords and all(_arith(a, _expr_leaf) for a in n.args)


def check_expr(text: str) -> bool:
    """Whether a symbolic size expression is plain arithmetic on the export's symbols.

    Examples
    --------
    >>> check_expr("Symbol('s77', positive=True, integer=True)"), check_expr("2*s0 // 3 + Max(s1, 4)")
    (True, True)
    >>> check_expr("__import__('os').system('touch MARKER')"), check_expr("s0.__class__")
    (False, False)
    """
    node = _parse(text)
    return node is not None and _arith(node, _expr_leaf)


def _guard_leaf(n: ast.expr) -> bool:
    # L['name'].size()[i] (also .stride()[i]) or L['name'].storage_offset()
    if isinstance(n, ast.Subscript) and _int(n.slice):
        n = n.value
        methods: tuple[str, ...] = ("size", "stride")
    else:
        methods = ("storage_offset",)
    if not (isinstance(n, ast.Call) and not n.args and not n.keywords and isinstance(n.func, ast.Attribute)
            and n.func.attr in methods):
        return False
    v = n.func.value
    # L['name'], and an input inside a dict or tuple argument: L['query']['mask'], L['pair'][0]
    while isinstance(v, ast.Subscript) and isinstance(v.value, ast.Subscript) and (
            _int(v.slice) or isinstance(v.slice, ast.Constant) and isinstance(v.slice.value, str)
            and bool(_IDENT.fullmatch(v.slice.value))):
        v = v.value
    return (
        isinstance(v, ast.Subscript) and isinstance(v.value, ast.Name) and v.value.id == "L"
        and isinstance(v.slice, ast.Constant) and isinstance(v.slice.value, str)
        and bool(_IDENT.fullmatch(v.slice.value))
    )


def check_guard(text: str) -> bool:
    """Whether a ``guards_code`` line is arithmetic on input sizes (torch ``exec``'s these).

    Examples
    --------
    >>> check_guard("L['x'].size()[0] == L['y'].size()[0]"), check_guard("L['q']['mask'].size()[0] == L['q'][0].size()[1]")
    (True, True)
    >>> check_guard("__import__('os').system('id') or True")
    False
    """
    node = _parse(text)
    return node is not None and _arith(node, _guard_leaf)


def check_target(target: object) -> bool:
    """Whether a node target is an ATen operator (or one of the few Python symbolic-size ops).

    Examples
    --------
    >>> check_target("torch.ops.aten.linear.default"), check_target("torch.os.system")
    (True, False)
    """
    if not isinstance(target, str):
        return False
    m = _ATEN.fullmatch(target)
    if m:
        return m.group(1) not in _ATEN_REFUSED
    return target in _PY_TARGETS


@functools.lru_cache(maxsize=4096)
def aten_refusal(target: str) -> str | None:
    """Why the ATen operator ``target`` has effects outside the program (``[Note: ATen allowlist]``); None when
    it is allowed, or when ``target`` is no ATen operator name (:func:`check_target` judges those).

    Examples
    --------
    >>> aten_refusal("torch.ops.aten.linear.default") is None, aten_refusal("torch.ops.aten.relu_.default")
    (True, 'writes into its arguments (an in-place or out= operator)')
    >>> aten_refusal("torch.ops.aten.save.default")
    'returns nothing: it runs for an effect outside the program (a file, the console, global state)'
    """
    m = _ATEN.fullmatch(target)
    if m is None:
        return None
    name, overload = m.groups()
    if name in _ATEN_REFUSED:
        return "reads a file the program names"
    import torch

    try:
        schema = getattr(getattr(torch.ops.aten, name), overload)._schema
    except (AttributeError, RuntimeError):
        return f"is not an operator of torch {torch.__version__}"
    if schema.is_mutable:
        return "writes into its arguments (an in-place or out= operator)"
    if not schema.returns and name not in _ASSERTS:
        return "returns nothing: it runs for an effect outside the program (a file, the console, global state)"
    return None


def _json(data: bytes, what: str, member: str) -> Any:
    if len(data) > MAX_JSON_BYTES:
        raise _refuse(what, f"{member} has {len(data)} bytes (at most {MAX_JSON_BYTES})")
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:
        raise _refuse(what, f"{member} is not valid JSON ({type(e).__name__})") from e


def _check_payloads(cfg: Any, kind: str, lengths: dict[str, int], what: str) -> None:
    member = f"data/{kind}s/model_{kind}s_config.json"
    if not (isinstance(cfg, dict) and set(cfg) == {"config"} and isinstance(cfg["config"], dict)):
        raise _refuse(what, f"{member} is not a payload config")
    prefix = "weight_" if kind == "weight" else "tensor_"
    for fqn, meta in cfg["config"].items():
        if not isinstance(meta, dict):
            raise _refuse(what, f"{member}: entry {str(fqn)[:80]!r} is not an object")
        if meta.get("use_pickle") is not False:
            raise _refuse(what, f"{kind} {str(fqn)[:80]!r} is stored as a pickle (use_pickle) in {member}")
        path = meta.get("path_name")
        if not (isinstance(path, str) and path.startswith(prefix)
                and f"data/{kind}s/{path}" in lengths and isinstance(meta.get("tensor_meta"), dict)):
            raise _refuse(
                what, f"{kind} {str(fqn)[:80]!r} in {member} is not raw tensor bytes "
                f"(path_name {str(path)[:80]!r}; needed {prefix}<n>, a member of the archive)"
            )
        sizes = meta["tensor_meta"].get("sizes")
        if not (isinstance(sizes, list) and all(
                isinstance(s, dict) and set(s) == {"as_int"} and type(s["as_int"]) is int and s["as_int"] >= 0
                for s in sizes)):
            raise _refuse(what, f"{kind} {str(fqn)[:80]!r} in {member} has sizes that are not fixed integers")
        numel = 1
        for s in sizes:
            numel *= s["as_int"]
        held = lengths[f"data/{kind}s/{path}"]
        if numel > held:  # an element has at least one byte; torch would allocate zeros for an empty member
            raise _refuse(what, f"{kind} {str(fqn)[:80]!r} in {member} has {numel} elements; its member {held} bytes")


def _check_model(model: Any, what: str) -> None:
    member = "models/model.json"
    if not isinstance(model, dict) or not isinstance(model.get("graph_module"), dict):
        raise _refuse(what, f"{member} is not an exported program")
    guards = model.get("guards_code", [])
    if not isinstance(guards, list):
        raise _refuse(what, f"{member}: guards_code is not a list")
    for g in guards:
        if not check_guard(g):
            raise _refuse(what, f"{member}: guard {str(g)[:120]!r} is not arithmetic on input sizes")
    verifiers = model.get("verifiers", [])
    if not (isinstance(verifiers, list) and all(isinstance(v, str) and _IDENT.fullmatch(v) for v in verifiers)):
        raise _refuse(what, f"{member}: verifiers {str(verifiers)[:120]} are not dialect names")
    rc = model.get("range_constraints", {})
    if not isinstance(rc, dict) or not all(_SYMBOL.fullmatch(str(k)) for k in rc):
        raise _refuse(what, f"{member}: range_constraints name something other than size symbols")
    graph = model["graph_module"].get("graph")
    if isinstance(graph, dict) and graph.get("custom_obj_values"):
        raise _refuse(what, f"{member} carries custom objects (custom_obj_values)")
    stack: list[Any] = [model["graph_module"]]
    while stack:  # iterative: a deeply nested model.json cannot exhaust the stack
        o = stack.pop()
        if isinstance(o, list):
            stack += o
            continue
        if not isinstance(o, dict):
            continue
        for k, v in o.items():
            if k == "metadata":  # strings only; torch resolves names in it but calls nothing
                if not (isinstance(v, dict) and all(isinstance(x, str) for x in v.values())):
                    raise _refuse(what, f"{member}: node metadata is not a map of strings")
                continue
            if k in _REFUSED_KEYS:
                raise _refuse(what, f"{member} carries {_REFUSED_KEYS[k]} ({k})")
            if k == "expr_str" and not check_expr(v):
                raise _refuse(what, f"{member}: symbolic expression {str(v)[:120]!r} is not plain arithmetic "
                              "on size symbols")
            if k == "target":
                why = aten_refusal(v) if isinstance(v, str) else None
                if why is not None:  # [Note: ATen allowlist]
                    op = v.removeprefix("torch.ops.")
                    raise _refuse(what, f"{member}: node target {op} {why}; hpcsplit loads only operators without "
                                  "effects outside the program")
                if not check_target(v):
                    raise _refuse(what, f"{member}: node target {str(v)[:120]!r} is not an ATen operator")
            stack.append(v)


def validate_program(data: bytes, what: str) -> dict[str, bytes]:
    """Check a program archive (see [Note: program archive]); return its members by relative name.

    Raises
    ------
    SwitchboardError
        Naming ``what`` (the file as layout.json writes it) and the first thing refused.
    """
    try:
        z = zipfile.ZipFile(io.BytesIO(data))
        infos = z.infolist()
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as e:
        raise SwitchboardError(f"{what} is not a torch.export archive ({e}); re-run the export") from e
    if not infos or len(infos) > MAX_MEMBERS:
        raise _refuse(what, f"the archive has {len(infos)} members (1 to {MAX_MEMBERS})")
    top = infos[0].filename.split("/", 1)[0]
    members: dict[str, bytes] = {}
    total = 0
    for i in infos:
        name = i.filename
        parts = name.split("/")
        if name.startswith("/") or "\\" in name or ".." in parts or "" in parts or ":" in parts[0]:
            raise _refuse(what, f"member {name[:120]!r} has an absolute or escaping path")
        if parts[0] != top or len(parts) < 2:
            raise _refuse(what, f"member {name[:120]!r} is outside the archive's folder {top!r}")
        rel = name[len(top) + 1:]
        if rel in members:
            raise _refuse(what, f"member {rel[:120]!r} appears twice")
        if rel not in _FIXED and not _PAYLOAD.fullmatch(rel):
            raise _refuse(what, f"member {rel[:120]!r} is not one hpcsplit writes (legacy pickle, custom "
                          "or opaque object, AOTInductor or extra file)")
        if i.compress_type != zipfile.ZIP_STORED or i.file_size != i.compress_size:
            raise _refuse(what, f"member {rel[:120]!r} is compressed (torch.export.save stores members)")
        total += i.file_size
        if total > len(data):
            raise _refuse(what, "its members add up to more bytes than the archive holds")
        try:
            members[rel] = z.read(i)
        except (zipfile.BadZipFile, ValueError, OSError, EOFError) as e:
            raise SwitchboardError(f"{what} is not a torch.export archive ({e}); re-run the export") from e
    for rel, expected in _FIXED.items():
        if rel not in members:
            raise _refuse(what, f"member {rel!r} is missing")
        if expected is not None and members[rel] != expected:
            if rel == "data/sample_inputs/model.pt":
                raise SwitchboardError(
                    f"{what} carries pickled data ({rel}); hpcsplit loads no pickles; "
                    "re-export it with hpcsplit.export"
                )
            raise _refuse(what, f"member {rel!r} holds {members[rel][:16]!r}; needed {expected!r}")
    lengths = {rel: len(payload) for rel, payload in members.items()}
    _check_payloads(_json(members["data/weights/model_weights_config.json"], what, "weights config"),
                    "weight", lengths, what)
    _check_payloads(_json(members["data/constants/model_constants_config.json"], what, "constants config"),
                    "constant", lengths, what)
    _check_model(_json(members["models/model.json"], what, "models/model.json"), what)
    return members


def load_program(data: bytes, what: str) -> Any:
    """``torch.export.load`` of archive bytes that :func:`validate_program` accepted, rebuilt in memory.

    Raises
    ------
    SwitchboardError
        What :func:`validate_program` refuses, or torch's error loading the validated archive.
    """
    import torch
    from torch.export.pt2_archive._package import PT2ArchiveWriter

    members = validate_program(data, what)
    buf = io.BytesIO()
    with PT2ArchiveWriter(buf) as w:
        for rel, payload in members.items():
            if not rel.startswith(".data/"):  # the writer adds its own
                w.write_bytes(rel, payload)
    buf.seek(0)
    try:
        return torch.export.load(buf)
    except Exception as e:  # torch raises many types for a bad archive; all mean the same here
        raise SwitchboardError(f"{what} cannot be loaded by torch.export.load: {e}; re-run the export") from e
