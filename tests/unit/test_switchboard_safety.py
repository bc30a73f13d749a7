"""Untrusted switchboards run no code (issue 16): crafted programs, path escapes, the swap race.

Every attack starts from a real export, crafts one thing and rehashes layout.json (whoever can
write the directory can), so only the new checks stand between the payload and torch.  Each payload
would create a marker file; the tests assert the refusal (file and reason named) and that the
marker never appears, also after trying every entry point (load, load_component, load_whole,
verify).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import pickle
import shutil
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hpcsplit.errors import HpcsplitError, SwitchboardError
from hpcsplit.switchboard import layout as L
from hpcsplit.switchboard.archive import aten_refusal, check_expr, check_guard, check_target
from hpcsplit.switchboard.reader import Switchboard


class _Touch:
    """Unpickling this creates ``path`` (``open(path, "a")``): the payload's visible effect."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.path, "a"))


@pytest.fixture()
def sb_copy(switchboards: Callable[..., Path], tmp_path: Path) -> Path:
    return Path(shutil.copytree(switchboards("toy_mlp"), tmp_path / "sb"))


@pytest.fixture()
def marker(tmp_path: Path) -> Path:
    return tmp_path / "MARKER"


# ------------------------------------------------------------------ crafting helpers
def _members(prog: Path) -> tuple[str, dict[str, bytes]]:
    with zipfile.ZipFile(prog) as z:
        top = z.namelist()[0].split("/")[0]
        return top, {i.filename[len(top) + 1:]: z.read(i) for i in z.infolist()}


def _write_archive(prog: Path, members: dict[str, bytes]) -> None:
    """Write members the way torch.export.save does (torch's own zip writer), so torch loads them."""
    from torch.export.pt2_archive._package import PT2ArchiveWriter

    prog.unlink(missing_ok=True)
    with PT2ArchiveWriter(str(prog)) as w:
        for name, data in members.items():
            if not name.startswith(".data/"):
                w.write_bytes(name, data)


def _rehash(root: Path) -> None:
    """Record the current size and sha256 of every file layout.json names (an attacker can)."""
    d = json.loads((root / "layout.json").read_text())
    for entry, key in [(c, "program") for c in d["components"]] + [(d["whole"], "file"), (d["golden"], "file")]:
        p = Path(entry[key]) if Path(entry[key]).is_absolute() else root / entry[key]
        if p.is_file():
            data = p.read_bytes()
            entry.update(sha256=hashlib.sha256(data).hexdigest(), file_bytes=len(data))
    (root / "layout.json").write_text(json.dumps(d))


def _edit(root: Path, rel: str, change: Callable[[dict[str, bytes]], None]) -> None:
    prog = root / rel
    _, members = _members(prog)
    change(members)
    _write_archive(prog, members)
    _rehash(root)


def _torch_save(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _cfg(members: dict[str, bytes], kind: str) -> dict[str, Any]:
    return json.loads(members[f"data/{kind}s/model_{kind}s_config.json"])


def _set_cfg(members: dict[str, bytes], kind: str, cfg: dict[str, Any]) -> None:
    members[f"data/{kind}s/model_{kind}s_config.json"] = json.dumps(cfg).encode()


def _meta() -> dict[str, Any]:
    return {"dtype": 7, "sizes": [{"as_int": 1}], "requires_grad": False, "device": {"type": "cpu", "index": None},
            "strides": [{"as_int": 1}], "storage_offset": {"as_int": 0}, "layout": 7}


def weight_use_pickle(m: dict[str, bytes], marker: Path) -> None:
    cfg = _cfg(m, "weight")
    entry = next(iter(cfg["config"].values()))
    entry["use_pickle"] = True
    m[f"data/weights/{entry['path_name']}"] = _torch_save(_Touch(marker))
    _set_cfg(m, "weight", cfg)


def constant_use_pickle(m: dict[str, bytes], marker: Path) -> None:
    cfg = _cfg(m, "constant")
    cfg["config"]["evil"] = {"path_name": "tensor_0", "is_param": False, "use_pickle": True, "tensor_meta": _meta()}
    m["data/constants/tensor_0"] = _torch_save(_Touch(marker))
    _set_cfg(m, "constant", cfg)


def legacy_weights(m: dict[str, bytes], marker: Path) -> None:
    m["data/weights/model.pt"] = _torch_save({"w": _Touch(marker)})


def legacy_constants(m: dict[str, bytes], marker: Path) -> None:
    m["data/constants/model.pt"] = _torch_save({"c": _Touch(marker)})


def opaque_constant(m: dict[str, bytes], marker: Path) -> None:
    cfg = _cfg(m, "constant")
    cfg["config"]["evil"] = {"path_name": "opaque_obj_0", "is_param": False, "use_pickle": True, "tensor_meta": None}
    m["data/constants/opaque_obj_0"] = pickle.dumps(_Touch(marker))
    _set_cfg(m, "constant", cfg)


def sympy_expression(m: dict[str, bytes], marker: Path) -> None:
    d = json.loads(m["models/model.json"])
    payload = f"__import__('os').system('touch {marker}')"
    for meta in d["graph_module"]["graph"]["tensor_values"].values():
        for size in meta["sizes"]:
            if "as_expr" in size:
                size["as_expr"]["expr_str"] = payload
    m["models/model.json"] = json.dumps(d).encode()


def guards_code(m: dict[str, bytes], marker: Path) -> None:
    d = json.loads(m["models/model.json"])
    d["guards_code"] = [f"__import__('os').system('touch {marker}') == 0"]
    m["models/model.json"] = json.dumps(d).encode()


def node_target(m: dict[str, bytes], marker: Path) -> None:
    d = json.loads(m["models/model.json"])
    d["graph_module"]["graph"]["nodes"][0]["target"] = "torch.os.system"
    m["models/model.json"] = json.dumps(d).encode()


def _first_op(m: dict[str, bytes], target: str) -> None:
    """The program's first operator node calls ``target`` instead (its arguments left as they are)."""
    d = json.loads(m["models/model.json"])
    node = next(n for n in d["graph_module"]["graph"]["nodes"] if str(n.get("target", "")).startswith("torch.ops.aten."))
    node["target"] = target
    m["models/model.json"] = json.dumps(d).encode()


def aten_save(m: dict[str, bytes], marker: Path) -> None:
    _first_op(m, "torch.ops.aten.save.default")  # writes a file


def aten_inplace(m: dict[str, bytes], marker: Path) -> None:
    _first_op(m, "torch.ops.aten.add_.Tensor")  # writes into the caller's tensor


def aten_print(m: dict[str, bytes], marker: Path) -> None:
    _first_op(m, "torch.ops.aten._print.default")


def sample_inputs(m: dict[str, bytes], marker: Path) -> None:
    m["data/sample_inputs/model.pt"] = _torch_save(((_Touch(marker),), {}))


def aoti_member(m: dict[str, bytes], marker: Path) -> None:
    m["data/aotinductor/model/model.so"] = b"\x7fELF"


ATTACKS: dict[str, tuple[Callable[[dict[str, bytes], Path], None], str]] = {
    "weight_use_pickle": (weight_use_pickle, r"weight .* stored as a pickle \(use_pickle\)"),
    "constant_use_pickle": (constant_use_pickle, r"constant 'evil' is stored as a pickle \(use_pickle\)"),
    "legacy_weights_pt": (legacy_weights, r"member 'data/weights/model\.pt' is not one hpcsplit writes"),
    "legacy_constants_pt": (legacy_constants, r"member 'data/constants/model\.pt' is not one hpcsplit writes"),
    "opaque_obj_constant": (opaque_constant, r"member 'data/constants/opaque_obj_0' is not one hpcsplit writes"),
    "sympify_expression": (sympy_expression, r"symbolic expression .*__import__.* is not plain arithmetic"),
    "guards_code_exec": (guards_code, r"guard .*__import__.* is not arithmetic on input sizes"),
    "node_target_torch_os": (node_target, r"node target 'torch\.os\.system' is not an ATen operator"),
    "pickled_sample_inputs": (sample_inputs, r"carries pickled data \(data/sample_inputs/model\.pt\)"),
    # [Note: ATen allowlist]: ATen operators with effects outside the program
    "aten_save": (aten_save, r"node target aten\.save\.default returns nothing: it runs for an effect outside"),
    "aten_inplace": (aten_inplace, r"node target aten\.add_\.Tensor writes into its arguments"),
    "aten_print": (aten_print, r"node target aten\._print\.default returns nothing"),
    "aoti_shared_library": (aoti_member, r"member 'data/aotinductor/model/model\.so' is not one hpcsplit writes"),
}


def _try_everything(root: Path) -> list[str]:
    """Every entry point that reads programs; the messages of the SwitchboardErrors raised."""
    msgs = []
    for attempt in (
        lambda: Switchboard.load(root, check_all=True),
        lambda: Switchboard.load(root).load_component("left"),
        lambda: Switchboard.load(root).load_whole(),
        lambda: Switchboard.load(root).verify(),
        lambda: Switchboard.load(root).verify(batch_size=3),
    ):
        try:
            attempt()
        except SwitchboardError as e:
            msgs.append(str(e))
    return msgs


@pytest.mark.parametrize("attack", list(ATTACKS))
@pytest.mark.parametrize("rel", ["programs/left.pt2", "programs/whole.pt2"])
def test_crafted_program_is_refused_and_runs_nothing(sb_copy: Path, marker: Path, attack: str, rel: str) -> None:
    craft, reason = ATTACKS[attack]
    _edit(sb_copy, rel, lambda m: craft(m, marker))
    Switchboard.load(sb_copy)  # sizes and hashes match: nothing is refused before a program is read
    with pytest.raises(SwitchboardError, match=rf"{rel}'.*{reason}") as info:
        if rel.endswith("whole.pt2"):
            Switchboard.load(sb_copy).load_whole()
        else:
            Switchboard.load(sb_copy).load_component("left")
    assert "re-export" in str(info.value)
    msgs = _try_everything(sb_copy)
    assert len(msgs) >= 3 and all(rel in m for m in msgs), msgs
    assert not marker.exists(), f"{attack}: the payload ran"


def test_payloads_are_live(sb_copy: Path, marker: Path) -> None:
    """The payloads are real: torch itself runs them (so the refusals above are what stops them)."""
    _, members = _members(sb_copy / "programs" / "left.pt2")
    weight_use_pickle(members, marker)
    _write_archive(sb_copy / "programs" / "left.pt2", members)
    with pytest.raises(Exception):  # noqa: B017 - whatever torch makes of the payload's return value
        torch.export.load(str(sb_copy / "programs" / "left.pt2"))
    assert marker.exists()


def test_compressed_and_escaping_members_are_refused(sb_copy: Path) -> None:
    prog = sb_copy / "programs" / "left.pt2"
    top, members = _members(prog)
    for name, compress, reason in [
        (f"{top}/data/weights/weight_9", zipfile.ZIP_DEFLATED, "is compressed"),
        ("../evil", zipfile.ZIP_STORED, "absolute or escaping path"),
        ("/abs/evil", zipfile.ZIP_STORED, "absolute or escaping path"),
        (f"{top}/data/weights/weight_0", zipfile.ZIP_STORED, "appears twice"),
    ]:
        with zipfile.ZipFile(prog, "w") as z:
            for rel, data in members.items():
                z.writestr(f"{top}/{rel}", data)
            with pytest.warns(UserWarning) if "twice" in reason else contextlib.nullcontext():
                z.writestr(zipfile.ZipInfo(name), b"\0" * (1 << 20), compress_type=compress)
        _rehash(sb_copy)
        with pytest.raises(SwitchboardError, match=rf"left\.pt2'.*{reason}"):
            Switchboard.load(sb_copy).load_component("left")


def test_payload_sizes_must_fit_their_bytes(sb_copy: Path) -> None:
    """An empty weight member with huge sizes would make torch allocate zeros the file never paid for."""
    def huge(m: dict[str, bytes]) -> None:
        cfg = _cfg(m, "weight")
        entry = next(iter(cfg["config"].values()))
        entry["tensor_meta"]["sizes"] = [{"as_int": 1 << 20}, {"as_int": 1 << 20}]
        m[f"data/weights/{entry['path_name']}"] = b""
        _set_cfg(m, "weight", cfg)

    _edit(sb_copy, "programs/left.pt2", huge)
    with pytest.raises(SwitchboardError, match=r"has 1099511627776 elements; its member 0 bytes"):
        Switchboard.load(sb_copy).load_component("left")


def test_grammars_accept_what_exports_write() -> None:
    assert check_expr("Symbol('s77', positive=True, integer=True)")
    assert check_expr("Mul(Integer(2), Symbol('s0', positive=True, integer=True))")
    assert check_expr("((2*s0) // s1) % 3 + Max(s0, Min(u1, 4)) >= -1")
    assert check_guard("((256*L['input_ids'].size()[0]) % (128*L['attention_mask'].size()[0])) == 0")
    assert check_target("torch.ops.aten.scaled_dot_product_attention.default")
    for bad in ["s0.__class__", "Symbol('os')", "Symbol('s0', evil=print)", "Function('f')(s0)", "s0 ** 2",
                "'a'", "1.5", "lambda: 0", "[s0]", "s0[0]", "x", "Integer(s0)", "(" * 5000 + "1" + ")" * 5000]:
        assert not check_expr(bad), bad
    for bad in ["L['x'].size()[0].__class__", "L['x\"'].size()[0] == 1", "L['x'].numel()", "print(1)"]:
        assert not check_guard(bad), bad
    for bad in ["torch.ops.aten.from_file.default", "#custom.op", "builtins.eval", "torch.ops.higher_order.cond"]:
        assert not check_target(bad), bad
    assert aten_refusal("torch.ops.aten.scaled_dot_product_attention.default") is None
    assert aten_refusal("torch.ops.aten._assert_scalar.default") is None  # torch.export's own assertions
    for bad, why in [("torch.ops.aten.copy_.default", "writes into"), ("torch.ops.aten.linear.out", "writes into"),
                     ("torch.ops.aten.manual_seed.default", "returns nothing"), ("torch.ops.aten.warn.default", "returns"),
                     ("torch.ops.aten.from_file.default", "reads a file"), ("torch.ops.aten.no_such_op.default", "is not")]:
        assert why in (aten_refusal(bad) or ""), bad


def test_all_real_exports_pass(switchboards: Callable[..., Path]) -> None:
    """The validation accepts every program of the toy (two partitions) and tiny-CLIP exports."""
    for root in (switchboards("toy_mlp"), switchboards("toy_mlp", stages=2), switchboards("clip_tiny")):
        Switchboard.load(root, check_all=True).verify()


# ------------------------------------------------------------------ paths inside the directory
def _outside_program(sb_copy: Path, tmp_path: Path) -> Path:
    out = tmp_path / "outside"
    out.mkdir()
    return Path(shutil.copy(sb_copy / "programs" / "left.pt2", out / "left.pt2"))


def _set_program(root: Path, comp: str, rel: str) -> None:
    d = json.loads((root / "layout.json").read_text())
    for c in d["components"]:
        if c["name"] == comp:
            c["program"] = rel
    (root / "layout.json").write_text(json.dumps(d))
    _rehash(root)


def _assert_no_leak(msg: str, outside: Path) -> None:
    data = outside.read_bytes()
    assert str(len(data)) not in msg and hashlib.sha256(data).hexdigest()[:16] not in msg, msg


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "symlink_file", "symlink_folder"])
def test_paths_must_stay_inside(sb_copy: Path, tmp_path: Path, kind: str) -> None:
    outside = _outside_program(sb_copy, tmp_path)
    if kind == "dotdot":
        _set_program(sb_copy, "left", "../outside/left.pt2")
        shutil.move(str(tmp_path / "outside"), str(sb_copy.parent / "outside"))
        outside, reason, name = sb_copy.parent / "outside" / "left.pt2", "relative path inside", "../outside/left.pt2"
    elif kind == "absolute":
        _set_program(sb_copy, "left", str(outside))
        reason, name = "relative path inside", str(outside)
    elif kind == "symlink_file":
        (sb_copy / "programs" / "left.pt2").unlink()
        (sb_copy / "programs" / "left.pt2").symlink_to(outside)
        _rehash(sb_copy)
        reason, name = "'programs/left.pt2' is a symlink", "programs/left.pt2"
    else:
        shutil.copytree(sb_copy / "programs", tmp_path / "outside" / "programs")
        shutil.rmtree(sb_copy / "programs")
        (sb_copy / "programs").symlink_to(tmp_path / "outside" / "programs")
        _rehash(sb_copy)
        reason, name = "'programs' is a symlink", "programs/stem.pt2"
    with pytest.raises(SwitchboardError, match=reason) as info:
        Switchboard.load(sb_copy)
    assert repr(name) in str(info.value)
    _assert_no_leak(str(info.value), outside)
    for msg in _try_everything(sb_copy):
        _assert_no_leak(msg, outside)


@pytest.mark.parametrize("entry", ["golden", "whole"])
def test_golden_and_whole_paths_are_checked(sb_copy: Path, entry: str) -> None:
    d = json.loads((sb_copy / "layout.json").read_text())
    d[entry]["file"] = "/etc/passwd"
    (sb_copy / "layout.json").write_text(json.dumps(d))
    with pytest.raises(SwitchboardError, match=r"'/etc/passwd' in layout\.json is refused") as info:
        Switchboard.load(sb_copy)
    assert str(Path("/etc/passwd").stat().st_size) not in str(info.value).split("refused")[1]


def test_a_tensor_read_otherwise_than_it_is_made_is_refused_at_load(sb_copy: Path) -> None:
    """Found by the mutation test below: a consumer's input shape edited to [] loaded, then failed in a call."""
    d = json.loads((sb_copy / "layout.json").read_text())
    reader = next(c for c in d["components"] if c["inputs"][0]["name"] != d["inputs"][0]["name"])
    reader["inputs"][0]["shape"] = []
    (sb_copy / "layout.json").write_text(json.dumps(d))
    with pytest.raises(SwitchboardError, match=rf"component '{reader['name']}' reads .* as float32 \[\], but it "
                                               r"is made as float32 \['batch', \d+\]"):
        Switchboard.load(sb_copy)


def test_a_layout_edited_consistently_is_refused_by_the_program(sb_copy: Path) -> None:
    """Producer and consumer both edited: the layout is coherent, but not what the programs take."""
    d = json.loads((sb_copy / "layout.json").read_text())
    value = d["components"][0]["outputs"][0]["name"]
    for c in d["components"]:
        for t in c["inputs"] + c["outputs"]:
            if t["name"] == value:
                t["shape"] = ["batch", 3]
    (sb_copy / "layout.json").write_text(json.dumps(d))
    sb = Switchboard.load(sb_copy)
    reader = next(c["name"] for c in d["components"] if any(t["name"] == value for t in c["inputs"]))
    with pytest.raises(SwitchboardError, match=rf"layout\.json says component '{reader}' takes input '{value}' as "
                                               r"float32 \['batch', 3\], but its program .* takes float32 "
                                               r"\['batch', \d+\]"):
        sb.load_component(reader)
    with pytest.raises(SwitchboardError):
        sb.verify()


def test_size_and_hash_errors_reveal_no_hash(sb_copy: Path) -> None:
    prog = sb_copy / "programs" / "left.pt2"
    data = bytearray(prog.read_bytes())
    data[100] ^= 1
    prog.write_bytes(bytes(data))
    with pytest.raises(SwitchboardError, match="sha256 unlike layout.json's") as info:
        Switchboard.load(sb_copy).load_component("left")
    assert hashlib.sha256(bytes(data)).hexdigest()[:16] not in str(info.value)


# ------------------------------------------------------------------ hash, then swap
def test_each_file_is_read_once_and_loaded_from_the_hashed_bytes(
    sb_copy: Path, marker: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Right after the program's bytes are read (and before they are hashed and loaded), the file on
    disk is replaced by a payload: the load still gives the exported program, the payload never runs,
    and the file was opened once."""
    evil = tmp_path / "evil.pt2"
    _, members = _members(sb_copy / "programs" / "left.pt2")
    weight_use_pickle(members, marker)
    _write_archive(evil, members)
    opened: list[str] = []
    real_open, real_read = os.open, os.read
    state = {"fd": -1, "swapped": False}

    def spy_open(path: Any, flags: int, *a: Any, **k: Any) -> int:
        fd = real_open(path, flags, *a, **k)
        if str(path).endswith("left.pt2"):
            opened.append(str(path))
            state["fd"] = fd
        return fd

    def spy_read(fd: int, n: int) -> bytes:
        data = real_read(fd, n)
        if fd == state["fd"] and not state["swapped"]:
            os.replace(evil, sb_copy / "programs" / "left.pt2")  # the swap, mid-load
            state["swapped"] = True
        return data

    sb = Switchboard.load(sb_copy)
    monkeypatch.setattr(L.os, "open", spy_open)
    monkeypatch.setattr(L.os, "read", spy_read)
    fn = sb.load_component("left")
    monkeypatch.undo()
    assert state["swapped"] and len(opened) == 1, opened
    x = sb.component_example_inputs()["left"]
    (got,) = fn(*x)
    assert torch.equal(got, sb._value(sb.components["left"].outputs[0].name))
    assert not marker.exists()
    _rehash(sb_copy)  # the swapped-in file, read afresh and with matching hashes, is refused
    with pytest.raises(SwitchboardError, match="use_pickle"):
        Switchboard.load(sb_copy).load_component("left")
    assert not marker.exists()


def test_layout_and_golden_are_read_once(sb_copy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    opened: list[str] = []
    real_open = os.open

    def spy_open(path: Any, flags: int, *a: Any, **k: Any) -> int:
        opened.append(str(path))
        return real_open(path, flags, *a, **k)

    monkeypatch.setattr(L.os, "open", spy_open)
    sb = Switchboard.load(sb_copy)
    monkeypatch.undo()
    assert opened.count("layout.json") == 1 and opened.count("golden.safetensors") == 1, opened
    assert sb.sha256 == hashlib.sha256((sb_copy / "layout.json").read_bytes()).hexdigest()


# ------------------------------------------------------------------ property: mutated layout.json
_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)


def _paths(o: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(o, dict):
        for k, v in o.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(o, list):
        for i, v in enumerate(o):
            out += _paths(v, (*prefix, i))
    return out


@st.composite
def _mutations(draw: st.DrawFn, original: dict[str, Any]) -> str:
    d = json.loads(json.dumps(original))
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(d)
        path = draw(st.sampled_from(paths[1:]))
        parent = d
        for p in path[:-1]:
            parent = parent[p]
        how = draw(st.sampled_from(["value", "delete", "nest", "string_path", "dup"]))
        if how == "value":
            parent[path[-1]] = draw(_json_values)
        elif how == "delete":
            del parent[path[-1]]
        elif how == "nest":
            depth = draw(st.sampled_from([2, 50, 100_000]))
            text = json.dumps(d)
            return text.replace(json.dumps(parent[path[-1]]), "[" * depth + "1" + "]" * depth, 1)
        elif how == "string_path":
            parent[path[-1]] = draw(st.sampled_from(["../layout.json", "/etc/passwd", "programs", "", ".",
                                                     "programs/../golden.safetensors", "a\0b", "C:\\x"]))
        else:
            parent[path[-1]] = json.loads(json.dumps(parent[path[-1]]))
    return json.dumps(d)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(data=st.data())
def test_mutated_layout_loads_or_raises_a_switchboard_error(
    switchboards: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory, data: st.DataObject
) -> None:
    src = switchboards("toy_mlp")
    original = json.loads((src / "layout.json").read_text())
    root = Path(shutil.copytree(src, tmp_path_factory.mktemp("mut") / "sb"))
    (root / "layout.json").write_text(data.draw(_mutations(original)))
    try:
        sb = Switchboard.load(root)
        for name in sb.order:
            sb.load_component(name)
        sb.verify()
    except HpcsplitError:
        pass
    finally:
        shutil.rmtree(root)
