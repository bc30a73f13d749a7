"""The picture of the split (issue 32): graph.svg and graph.png beside layout.json, drawn with graphviz's
dot or, where dot is absent, networkx + matplotlib; a side file that loading ignores ([Note: the picture
is a side file]); summary.md shows it."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

import hpcsplit
from hpcsplit.errors import SwitchboardError
from hpcsplit.switchboard import layout as L
from hpcsplit.switchboard.picture import PICTURE_PNG, PICTURE_SVG, picture_model, renderer, write_picture

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture()
def sb_copy(switchboards: Callable[..., Path], tmp_path: Path) -> Path:
    out = tmp_path / "sb"
    shutil.copytree(switchboards("clip_tiny"), out)
    return out


def test_export_draws_the_split(sb_copy: Path) -> None:
    assert (sb_copy / PICTURE_PNG).read_bytes().startswith(PNG_MAGIC)
    svg = (sb_copy / PICTURE_SVG).read_text()
    for text in ("vision_model", "text_model", "head", "pixel_values", "B/sample", "split: forced"):
        assert text in svg, text


def test_what_the_picture_shows(sb_copy: Path) -> None:
    m = picture_model(json.loads((sb_copy / L.LAYOUT_FILE).read_text()))
    ids = [n["id"] for n in m["nodes"]]
    assert ids == ["in:pixel_values", "in:input_ids", "in:attention_mask", "c:vision_model", "c:text_model",
                   "c:head", "out"]
    assert len({n["colour"] for n in m["nodes"] if n["id"].startswith("c:")}) == 3  # one colour a component
    edges = {(e["src"], e["dst"]): e for e in m["edges"]}
    assert edges[("in:pixel_values", "c:vision_model")]["bytes"] == 3 * 32 * 32 * 4
    assert edges[("c:vision_model", "c:head")]["label"].endswith("64 B/sample")  # 16 floats
    assert any(d.startswith("region inputs -> matmul (disjoint): split") for d in m["decisions"])


@pytest.mark.parametrize("using", ["graphviz", "matplotlib"])
def test_both_renderers_draw(sb_copy: Path, using: str) -> None:
    if using == "graphviz" and renderer() != "graphviz":
        pytest.skip("graphviz's dot is not installed (apt-get install graphviz)")
    for name in (PICTURE_SVG, PICTURE_PNG):
        (sb_copy / name).unlink()
    assert write_picture(sb_copy, using=using) == using
    assert (sb_copy / PICTURE_PNG).read_bytes().startswith(PNG_MAGIC)
    assert "vision_model" in (sb_copy / PICTURE_SVG).read_text()


def test_without_dot_the_export_falls_back_to_matplotlib(sb_copy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    assert renderer() == "matplotlib"
    assert write_picture(sb_copy) == "matplotlib"


def test_a_picture_that_cannot_be_drawn_does_not_fail(tmp_path: Path) -> None:
    (tmp_path / L.LAYOUT_FILE).write_text('{"components": [1]}')
    (tmp_path / PICTURE_PNG).write_bytes(b"old")
    with pytest.warns(UserWarning, match="no picture of the split"):
        assert write_picture(tmp_path, using="matplotlib") is None
    assert not (tmp_path / PICTURE_PNG).exists()  # no stale picture of another split


def test_loading_ignores_the_picture_and_still_refuses_what_it_refused(sb_copy: Path, tmp_path: Path) -> None:
    layout = json.loads((sb_copy / L.LAYOUT_FILE).read_text())
    assert PICTURE_SVG not in json.dumps(layout) and PICTURE_PNG not in json.dumps(layout)  # not hashed
    before = hpcsplit.Switchboard.load(sb_copy, check_all=True).sha256
    # the picture replaced by anything, even a symlink out of the directory: never opened
    (sb_copy / PICTURE_SVG).unlink()
    os.symlink("/etc/passwd", sb_copy / PICTURE_SVG)
    (sb_copy / PICTURE_PNG).write_bytes(b"not a png")
    sb = hpcsplit.Switchboard.load(sb_copy, check_all=True)
    assert sb.sha256 == before
    sb.verify()
    # a layout that names the picture as a program is refused, even with its hash and size recorded
    c = layout["components"][0]
    c["program"], c["sha256"], c["file_bytes"] = PICTURE_PNG, L.sha256_file(sb_copy / PICTURE_PNG), 9
    (sb_copy / L.LAYOUT_FILE).write_text(json.dumps(layout))
    with pytest.raises(SwitchboardError, match="refused|not a"):
        hpcsplit.Switchboard.load(sb_copy, check_all=True)
    # and one that names the symlinked picture is refused as a symlink
    c["program"] = PICTURE_SVG
    (sb_copy / L.LAYOUT_FILE).write_text(json.dumps(layout))
    with pytest.raises(SwitchboardError, match="symlink|link"):
        hpcsplit.Switchboard.load(sb_copy)
