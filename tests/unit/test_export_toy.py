"""Export the toy nested-diamond MLP and check the switchboard against the model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import hpcsplit
from hpcsplit.core.settings import group_defaults
from hpcsplit.errors import ConfigError
from hpcsplit.switchboard.layout import sha256_file
from hpcsplit.switchboard.models import build_toy, example_inputs
from hpcsplit.switchboard.reader import Switchboard
from hpcsplit.switchboard.stage import SETTINGS, PartitionSettings, VerifySettings, model_settings, run_export

TOY_ORDER = ["stem", "left", "right", "left_tail", "mixer", "head"]


@pytest.fixture(scope="module")
def toy() -> torch.nn.Module:
    return build_toy(d_in=16, hidden=32, d_out=4)


@pytest.fixture(scope="module")
def sb(toy: torch.nn.Module, tmp_path_factory: pytest.TempPathFactory) -> Switchboard:
    out = tmp_path_factory.mktemp("toy") / "switchboard"
    return hpcsplit.export(
        toy, example_inputs("toy_mlp", 2, model=toy), out=out, cost="flops", timing_repeats=1, force=True
    )


def test_toy_splits_into_the_diamond(sb: Switchboard) -> None:
    assert list(sb.order) == TOY_ORDER
    assert list(sb.components) == TOY_ORDER
    assert [t.name for t in sb.components["mixer"].inputs] == ["relu_1", "relu_2"]  # reads B and C
    pairs = {(e.src, e.dst) for e in sb.edges}
    assert pairs == {
        ("input", "stem"),
        ("stem", "left"),
        ("stem", "right"),
        ("left", "left_tail"),
        ("left", "mixer"),
        ("right", "mixer"),
        ("left_tail", "head"),
        ("mixer", "head"),
        ("head", "output"),
    }
    assert sb.components["left"].param_bytes == (32 * 32 + 32) * 4


@pytest.mark.parametrize("batch_size", [1, 2, 5])
def test_toy_reproduces_the_model_at_every_batch(
    sb: Switchboard, toy: torch.nn.Module, batch_size: int
) -> None:
    (x,) = example_inputs("toy_mlp", batch_size, model=toy, seed=batch_size)
    with torch.no_grad():
        want = toy(x)
    got = sb(x)
    assert isinstance(got, torch.Tensor)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    (whole,) = sb.load_whole()(x)
    torch.testing.assert_close(whole, want, atol=1e-6, rtol=1e-5)


def test_layout_records_specs_hashes_and_verification(sb: Switchboard) -> None:
    d = json.loads((sb.path / "layout.json").read_text())
    assert d["schema_version"] == 1
    assert d["model"] == "ToyMLP"
    assert d["inputs"] == [{"name": "x", "dtype": "float32", "shape": ["batch", 16], "bytes_per_sample": 64}]
    assert d["outputs"][0]["shape"] == ["batch", 4]
    assert d["order"] == TOY_ORDER
    for c in d["components"]:
        assert sha256_file(sb.path / c["program"]) == c["sha256"]
        assert all(t["shape"][0] == "batch" for t in c["inputs"] + c["outputs"])
    assert sha256_file(sb.path / d["whole"]["file"]) == d["whole"]["sha256"]
    assert sha256_file(sb.path / d["golden"]["file"]) == d["golden"]["sha256"]
    assert d["verification"]["passed"] is True
    assert d["verification"]["max_abs_diff"] <= 1e-5


def test_unload_drops_the_cached_program(sb: Switchboard) -> None:
    fn = sb.load_component("left")
    assert sb.load_component("left") is fn  # cached: loaded (and hash-checked) once
    assert sb.unload("left") and not sb.unload("left")
    again = sb.load_component("left")
    assert again is not fn
    x = sb.component_example_inputs(2)["left"]
    assert all(torch.equal(a, b) for a, b in zip(fn(*x), again(*x), strict=True))


def test_components_run_their_graph_flat_and_keep_checking_inputs(sb: Switchboard) -> None:
    """A component runs its graph's own code (no pytree flatten / unflatten around it) and gives what the
    module's generated forward gives; the input check skips only (dtype, shape) signatures that passed."""
    from hpcsplit.switchboard.reader import _flat_forward

    spec = sb.components["mixer"]
    mod = sb._load_program(spec, "mixer").module()
    xs = sb.component_example_inputs(3)["mixer"]
    want = mod.forward(*xs)
    flat = _flat_forward(mod, len(spec.inputs), len(spec.outputs))
    assert flat is not None and "tree_flatten" not in mod.code and "tree_unflatten" not in mod.code
    got = flat(*xs)
    assert type(got) is tuple and len(got) == len(spec.outputs)
    assert all(torch.equal(a, b) for a, b in zip(got, want if isinstance(want, tuple) else (want,), strict=True))
    assert _flat_forward(sb._load_program(spec, "mixer").module(), len(spec.inputs) + 1, len(spec.outputs)) is None
    fn = sb.load_component("mixer")
    for _ in range(2):  # the second call of a shape comes from the signatures that passed
        assert all(torch.equal(a, b) for a, b in zip(fn(*xs), got, strict=True))
    from types import SimpleNamespace

    fake = SimpleNamespace(dtype=xs[0].dtype, shape=xs[0].shape)  # looks like a cached input, is none
    bad = [(xs[0][:, :5], xs[1]), (xs[0], xs[1][:2]), (xs[0].double(), xs[1]), (xs[0],), (fake, xs[1])]
    for args in bad:
        with pytest.raises(ValueError, match="mixer"):
            fn(*args)
    assert len(fn(*(x[:1] for x in xs))[0]) == 1  # a new batch size passes the check and runs


def test_example_inputs_follow_the_batch(sb: Switchboard) -> None:
    ex = sb.component_example_inputs(7)
    assert list(ex) == TOY_ORDER
    assert [tuple(t.shape) for t in ex["mixer"]] == [(7, 32), (7, 32)]
    assert tuple(sb.example_inputs(3)[0].shape) == (3, 16)
    # each component runs on its example inputs and gives its declared outputs
    for name, xs in sb.component_example_inputs(3).items():
        outs = sb.load_component(name)(*xs)
        assert [tuple(o.shape)[1:] for o in outs] == [tuple(t.shape[1:]) for t in sb.components[name].outputs]


def test_verify_at_another_batch(sb: Switchboard) -> None:
    rep = Switchboard.load(sb.path, check_all=True).verify(batch_size=3)
    assert rep.passed and rep.reference == "whole" and rep.max_abs_diff <= 1e-5


def test_stages_cut_the_components(toy: torch.nn.Module, tmp_path: Path) -> None:
    x = example_inputs("toy_mlp", 2, model=toy)
    sb = hpcsplit.export(toy, x, out=tmp_path / "sb", stages=2, cost="flops", timing_repeats=1, force=True)
    assert len(sb.order) > len(TOY_ORDER)
    assert any(c.kind == "stage" for c in sb.components.values())
    with torch.no_grad():
        torch.testing.assert_close(sb(*x), toy(*x))


def test_run_export_stage(tmp_path: Path, capsys: pytest.CaptureFixture[str], compose: Any) -> None:
    cfg = compose("model=toy_mlp", "model.d_in=8", "model.hidden=16", "model.d_out=3", "partition.cost=flops",
                  "partition.timing_repeats=1", "partition.force=true")
    summary = run_export(cfg, tmp_path)
    assert summary["components"] == TOY_ORDER
    assert Path(summary["switchboard"]) == tmp_path / "switchboard"
    json.dumps(summary)  # JSON-able
    printed = capsys.readouterr().out
    assert "mixer" in printed and "relu_1, relu_2 -> " in printed and "verified" in printed


def test_export_settings_list_every_problem_at_once(tmp_path: Path) -> None:
    cfg = {
        "model": {**group_defaults("model", "toy_mlp"), "seed": 0, "hiden": 8},
        "partition": {**group_defaults("partition", "dominator"), "method": "spectral", "stages": 2,
                      "max_stage_ms": 1.0},
        "verify": {"atol": -1.0, "rtol": 1e-4},
    }
    with pytest.raises(ConfigError) as ei:
        run_export(cfg, tmp_path)
    msg = str(ei.value)
    for part in ("model.hiden is not a setting (did you mean 'hidden'?)", "needed 'dominator' (the only method)",
                 "both partition.stages=2 and partition.max_stage_ms=1", "verify.atol = -1.0"):
        assert part in msg, msg
    assert not (tmp_path / "switchboard").exists()
    with pytest.raises(ConfigError, match="model.name='resnet'; needed one of toy_mlp, clip, clip_tiny"):
        model_settings({"model": {"name": "resnet"}})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_profiler_release_gives_the_gpu_memory_back(sb: Switchboard) -> None:
    from hpcsplit.core.device import load_on_device

    dev = torch.device("cuda", 0)
    base = torch.cuda.memory_allocated(dev)
    fn, release = load_on_device(sb, "mixer", dev)
    assert torch.cuda.memory_allocated(dev) > base  # its parameters
    del fn
    release()  # else they would count against the next component's slice cap
    assert torch.cuda.memory_allocated(dev) == base


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_components_run_on_cuda(sb: Switchboard, toy: torch.nn.Module) -> None:
    dev = torch.device("cuda")
    env = {t.name: x.to(dev) for t, x in zip(sb.layout.inputs, sb.example_inputs(4), strict=True)}
    for name in sb.order:
        spec = sb.components[name]
        outs = sb.load_component(name, device=dev)(*[env[t.name] for t in spec.inputs])
        assert all(o.device.type == "cuda" for o in outs)
        env.update({t.name: o for t, o in zip(spec.outputs, outs, strict=True)})
    (got,) = (env[v] for v in sb.layout.output_values)
    with torch.no_grad():
        want = toy(sb.example_inputs(4)[0])
    torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-3)
    (whole,) = sb.load_whole(device=dev)(sb.example_inputs(4)[0].to(dev))
    torch.testing.assert_close(whole.cpu(), want, atol=1e-4, rtol=1e-3)


CONF = Path(__file__).resolve().parents[2] / "conf"


@pytest.mark.parametrize("name", ["toy_mlp", "clip_tiny"])
def test_model_configs_build_their_models(name: str, compose: Any) -> None:
    if name.startswith("clip"):
        pytest.importorskip("transformers")
    cfg = compose(f"model={name}")
    model, args, kwargs = model_settings(cfg).build()
    assert kwargs == {}
    assert all(a.shape[0] == cfg["model"]["batch_size"] for a in args)
    with torch.no_grad():
        model(*args)


@pytest.mark.parametrize("name", ["toy", "clip", "clip_tiny"])
def test_every_experiment_gives_valid_export_settings(name: str, compose: Any) -> None:
    cfg = compose(f"+experiment={name}")
    ms = model_settings(cfg)
    assert ms.name == cfg["model"]["name"] and isinstance(ms, SETTINGS["model"][ms.name])  # type: ignore[index]
    assert PartitionSettings.from_config(cfg).method == "dominator"
    assert VerifySettings.from_config(cfg).atol == cfg["verify"]["atol"]


@pytest.mark.parametrize("name", ["toy", "clip", "clip_tiny"])
def test_experiments_are_global_packages(name: str) -> None:
    lines = (CONF / "experiment" / f"{name}.yaml").read_text().splitlines()
    assert lines[0] == "# @package _global_"  # Hydra reads headers only up to the first other line
    assert f"+experiment={name}" in lines[1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_timing_pass_on_cuda(toy: torch.nn.Module) -> None:
    from hpcsplit.switchboard.graph import capture, measure_nodes

    cg = capture(toy, example_inputs("toy_mlp", 2, model=toy))
    costs = measure_nodes(cg, batch_size=8, repeats=2, device="cuda")
    assert costs and all(c.latency_ms > 0 for c in costs.values())
    assert next(p.device.type for p in cg.module.parameters()) == "cpu"  # the captured module stays put
