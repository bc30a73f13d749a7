"""What cannot be exported is refused at export, with a message naming the construct and what to do
(issue 32): data-dependent control flow, in-place buffer (and input) updates in forward, generate loops."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import hpcsplit
from hpcsplit.errors import CaptureError


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # a branch on a tensor's value
            return self.fc(x)
        return -x


class RunningMean(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("mean", torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.mean.mul_(0.9).add_(0.1 * x.mean(0))  # running statistics, updated in place
        return self.fc(x - self.mean)


class StepCounter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps += 1  # exports silently (the value never reaches an output) but would drift per component
        return self.fc(x)


class ScalesInput(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2.0)
        return x + 1


class Generate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        self.lm = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=16,
                                             pad_token_id=0, bos_token_id=1, eos_token_id=2))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm.generate(ids, max_new_tokens=3, do_sample=False)


def _refused(model: nn.Module, x: torch.Tensor, tmp_path: Path) -> str:
    with pytest.raises(CaptureError) as e:
        hpcsplit.export(model.eval(), (x,), out=tmp_path / "sb", timing_repeats=1)
    assert not (tmp_path / "sb").exists()
    return str(e.value)


def test_data_dependent_control_flow_is_refused_naming_the_line(tmp_path: Path) -> None:
    msg = _refused(Branchy(), torch.randn(2, 8), tmp_path)
    assert "data-dependent control flow" in msg and "torch.cond / torch.where" in msg
    assert "test_export_refusals.py" in msg and "if x.sum() > 0" in msg  # where, in the model's own code


@pytest.mark.parametrize("model, buffer", [(RunningMean(), "mean"), (StepCounter(), "steps")])
def test_in_place_buffer_updates_are_refused(model: nn.Module, buffer: str, tmp_path: Path) -> None:
    msg = _refused(model, torch.randn(2, 8), tmp_path)
    assert f"{type(model).__name__}.forward updates buffer(s) {buffer} in place" in msg
    assert "in-place buffer update" in msg and "update the buffer outside forward" in msg


def test_in_place_input_updates_are_refused(tmp_path: Path) -> None:
    msg = _refused(ScalesInput(), torch.randn(2, 8), tmp_path)
    assert "ScalesInput.forward writes into its input(s) x in place" in msg and "x.clone()" in msg


def test_a_generate_loop_is_refused(tmp_path: Path) -> None:
    msg = _refused(Generate(), torch.randint(4, 60, (2, 5)), tmp_path)
    assert "forward runs a generate loop" in msg and "generation/utils.py" in msg
    assert "export one forward step instead" in msg and "run the decoding loop outside hpcsplit" in msg


class InPlaceInside(nn.Module):
    """In-place operators on the forward's own intermediates (ResNet's ``out += identity``, ``ReLU(inplace=True)``,
    ``masked_fill_`` on a fresh mask) are no effect outside the program: they export, in functional form."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.act(self.a(x))
        y += x
        z = self.b(y).masked_fill_(y < 0.1, 0.0)
        return z


def test_in_place_operators_on_intermediates_export_in_functional_form(tmp_path: Path) -> None:
    from hpcsplit.switchboard.archive import aten_refusal

    model, x = InPlaceInside().eval(), torch.randn(3, 8)
    raw = torch.export.export(model, (x,), strict=False)
    assert any(aten_refusal(f"torch.ops.{n.target}") for n in raw.graph.nodes if n.op == "call_function")
    sb = hpcsplit.export(model, (x,), out=tmp_path / "sb", timing_repeats=1, stages=2, cost="flops")
    with torch.no_grad():
        want = model(x.clone())
    # every component's program and the whole model's load past the allowlist (which refused them before)
    torch.testing.assert_close(sb.load_whole()(x)[0], want)
    torch.testing.assert_close(sb.run_flat([x])[0], want)
    assert len(sb.order) >= 1



class AttentionThenView(nn.Module):
    """T5's attention: a float mask (its position bias) into ``scaled_dot_product_attention``, then
    ``.transpose(1, 2).contiguous().view(...)``, with an in-place ``+=`` so that the export goes through
    functionalization ([Note: views after functionalization]: the copy was lost and the view raised)."""

    def __init__(self, d: int = 32, heads: int = 2, t: int = 16) -> None:
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.bias = nn.Parameter(torch.randn(1, heads, t, t))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (y.view(b, t, self.heads, -1).transpose(1, 2) for y in self.qkv(x).chunk(3, dim=-1))
        mask = self.bias.expand(b, -1, -1, -1).clone()
        a = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        y = self.out(a.transpose(1, 2).contiguous().view(b, t, d))
        y += x
        return y


def test_a_view_of_an_attention_output_runs_after_functionalization(tmp_path: Path) -> None:
    model, x = AttentionThenView().eval(), torch.randn(2, 16, 32)
    sb = hpcsplit.export(model, (x,), out=tmp_path / "sb", timing_repeats=1)
    for b in (2, 6):
        xb = torch.randn(b, 16, 32)
        with torch.no_grad():
            want = model(xb)
        torch.testing.assert_close(sb.load_whole()(xb)[0], want)
        torch.testing.assert_close(sb.run_flat([xb])[0], want)
