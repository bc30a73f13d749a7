"""A switchboard refuses tampered, malformed and missing files; unexportable models get clear errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import hpcsplit
from hpcsplit.errors import CaptureError, SwitchboardError, VerificationError
from hpcsplit.switchboard.graph import capture
from hpcsplit.switchboard.layout import sha256_file
from hpcsplit.switchboard.models import build_toy, example_inputs
from hpcsplit.switchboard.reader import Switchboard


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    toy = build_toy(d_in=8, hidden=16, d_out=2)
    out = tmp_path_factory.mktemp("sb") / "switchboard"
    hpcsplit.export(toy, example_inputs("toy_mlp", 2, model=toy), out=out, cost="flops", timing_repeats=1,
                    force=True)
    return out


@pytest.fixture()
def copy(exported: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(exported, tmp_path / "sb"))


def test_tampered_program_is_refused(copy: Path) -> None:
    prog = copy / "programs" / "left.pt2"
    data = bytearray(prog.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, different bytes
    prog.write_bytes(bytes(data))
    sb = Switchboard.load(copy)  # sizes match: the hash is checked when the program is read
    sb.load_component("stem")
    with pytest.raises(SwitchboardError, match=r"left\.pt2.*sha256.*tampered"):
        sb.load_component("left")
    with pytest.raises(SwitchboardError, match=r"left\.pt2"):
        Switchboard.load(copy, check_all=True)


def test_truncated_program_is_refused_at_load(copy: Path) -> None:
    prog = copy / "programs" / "head.pt2"
    prog.write_bytes(prog.read_bytes()[:-10])
    with pytest.raises(SwitchboardError, match=r"head\.pt2'? has \d+ bytes"):
        Switchboard.load(copy)


def test_program_from_another_component_is_refused(copy: Path) -> None:
    # a valid program, with a matching hash in layout.json, but the wrong signature
    d = json.loads((copy / "layout.json").read_text())
    comps = {c["name"]: c for c in d["components"]}
    comps["mixer"].update({k: comps["left"][k] for k in ("program", "sha256", "file_bytes")})
    (copy / "layout.json").write_text(json.dumps(d))
    with pytest.raises(SwitchboardError, match=r"takes 1 input\(s\) and gives 1 output\(s\); layout.json records 2 and 1"):
        Switchboard.load(copy).load_component("mixer")


def test_program_with_pickled_data_is_refused(copy: Path) -> None:
    # even with a matching hash: torch.export.load would unpickle the sample inputs
    prog = copy / "programs" / "left.pt2"
    ep = torch.export.load(str(prog))
    ep.example_inputs = ((torch.zeros(2, 16),), {})
    torch.export.save(ep, str(prog))
    d = json.loads((copy / "layout.json").read_text())
    for c in d["components"]:
        if c["name"] == "left":
            c.update(sha256=sha256_file(prog), file_bytes=prog.stat().st_size)
    (copy / "layout.json").write_text(json.dumps(d))
    with pytest.raises(SwitchboardError, match=r"left\.pt2'? carries pickled data"):
        Switchboard.load(copy).load_component("left")


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda d: "{not json", "not valid JSON"),
        (lambda d: json.dumps({**d, "schema_version": 99}), "schema_version=99"),
        (lambda d: json.dumps({k: v for k, v in d.items() if k != "components"}), "missing key 'components'"),
        (lambda d: json.dumps({**d, "order": list(reversed(d["order"]))}), "order"),
        (lambda d: json.dumps({**d, "components": d["components"][1:], "order": d["order"][1:]}), "reads"),
        (lambda d: json.dumps([1, 2]), "JSON list"),
    ],
)
def test_malformed_layout_is_refused(copy: Path, edit, match: str) -> None:  # type: ignore[no-untyped-def]
    d = json.loads((copy / "layout.json").read_text())
    (copy / "layout.json").write_text(edit(d))
    with pytest.raises(SwitchboardError, match=match) as info:
        Switchboard.load(copy)
    assert "layout.json" in str(info.value)


@pytest.mark.parametrize(
    "rel", ["programs/mixer.pt2", "programs/whole.pt2", "golden.safetensors", "layout.json"]
)
def test_missing_file_is_refused(copy: Path, rel: str) -> None:
    (copy / rel).unlink()
    with pytest.raises(SwitchboardError, match=Path(rel).name.replace(".", r"\.")):
        Switchboard.load(copy)


def test_tampered_golden_is_refused(copy: Path) -> None:
    g = copy / "golden.safetensors"
    data = bytearray(g.read_bytes())
    data[-1] ^= 0x01
    g.write_bytes(bytes(data))
    with pytest.raises(SwitchboardError, match=r"golden\.safetensors.*sha256"):
        Switchboard.load(copy)


def test_verification_failure_names_the_difference(copy: Path) -> None:
    sb = Switchboard.load(copy)
    key = next(k for k in sb._golden if k.startswith("output."))
    sb._golden[key] = sb._golden[key] + 1.0
    with pytest.raises(VerificationError, match="max abs diff 1"):
        sb.verify()


class _DataDependent(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # branches on tensor values
            return x * 2
        return x - 1


class _FixedBatch(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(4, -1)  # a literal batch


def test_unexportable_model_gets_a_clear_error() -> None:
    with pytest.raises(CaptureError, match=r"(?s)_DataDependent.*what to change: .*data-dependent") as info:
        capture(_DataDependent(), (torch.randn(4, 3),))
    assert info.value.__cause__ is not None


def test_fixed_batch_model_gets_a_clear_error() -> None:
    with pytest.raises(CaptureError, match=r"(?s)what to change: .*batch"):
        capture(_FixedBatch(), (torch.randn(4, 3),))
    capture(_FixedBatch(), (torch.randn(4, 3),), dynamic_batch=False)  # the way out works


def test_bad_inputs_get_clear_errors() -> None:
    toy = build_toy(d_in=8, hidden=8, d_out=2)
    with pytest.raises(CaptureError, match="non-tensor inputs"):
        capture(toy, (3,))
    with pytest.raises(CaptureError, match="same batch size"):
        capture(torch.nn.Bilinear(2, 2, 1), (torch.randn(2, 2), torch.randn(3, 2)))


def test_export_never_replaces_a_foreign_directory(tmp_path: Path) -> None:
    keep = tmp_path / "data"
    keep.mkdir()
    (keep / "precious.txt").write_text("x")
    toy = build_toy(d_in=4, hidden=4, d_out=2)
    with pytest.raises(SwitchboardError, match="not a switchboard"):
        hpcsplit.export(
            toy, example_inputs("toy_mlp", 2, model=toy), out=keep, cost="flops", timing_repeats=1
        )
    assert (keep / "precious.txt").read_text() == "x"
    assert [p.name for p in tmp_path.iterdir()] == ["data"]  # the temporary folder is gone too


def test_programs_check_their_inputs_against_the_layout(exported: Path) -> None:
    """[Note: program calls]: programs run without torch.export's hooks, so the layout's check stands in:
    count, dtype, rank, fixed dims and one batch size >= 1; right inputs at any batch size still run."""
    sb = Switchboard.load(exported)
    stem = sb.load_component("stem")
    (x,) = sb.component_example_inputs(3)["stem"]
    with torch.inference_mode():
        assert stem(x)[0].shape[0] == 3 and stem(x[:1])[0].shape[0] == 1
        for bad, why in ((x.double(), "float64"), (x[:, :-1], r"\(3, 7\)"), (x[0], r"\(8,\)"), (x[:0], r"\(0, 8\)")):
            with pytest.raises(ValueError, match=rf"component 'stem': input 'x' is .*{why}.*takes torch.float32"):
                stem(bad)
        with pytest.raises(ValueError, match=r"takes 1 input\(s\), got 2"):
            stem(x, x)
        whole = sb.load_whole()
        with pytest.raises(ValueError, match=r"the whole model: input 'x'"):
            whole(x.int())
        assert whole(x)[0].shape[0] == 3
