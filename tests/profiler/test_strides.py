"""Real strides that differ from the capture's fake ones: the profiler's replay and the stages.

The model below has the pattern that broke T5 and two vision transformers: attention whose
mask comes from a trainable bias, run through ``scaled_dot_product_attention`` on transposed
(non-contiguous) q, k, v, then transposed back and ``.contiguous().view``-ed. torch.export's
fake kernel says the fused path's output, ``(B, T, H, D)``-major, so the transposed result
is already contiguous and the ``.contiguous()`` is dropped from the graph; in training the
mask needs a gradient, CPU takes the math path whose output is ``(B, H, T, D)``-contiguous,
and the recorded ``view`` used to fail on the real tensor.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx
from torch import nn

import autopart
from autopart.core.capture import capture
from autopart.profiler import profile_graph
from tests.numerics import assert_train_step_matches

B, T, H, D = 4, 8, 4, 8


class BiasAttention(nn.Module):
    """Self-attention with a learned (H, T, T) additive bias, T5-style."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(H * D, 3 * H * D)
        self.bias = nn.Parameter(torch.randn(H, T, T) * 0.1)
        self.out = nn.Linear(H * D, H * D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], T, 3, H, D).unbind(2)  # (B, T, H, D) each
        mask = self.bias.unsqueeze(0).expand(x.shape[0], H, T, T).clone()
        att = nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
        return x + self.out(att.transpose(1, 2).contiguous().view(x.shape[0], T, H * D))


class Model(nn.Module):
    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(BiasAttention() for _ in range(layers)))
        self.head = nn.Linear(H * D, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x)).mean(1)  # (B, 3)


def _model() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return Model(), torch.randn(B, T, H * D)


def test_the_pattern_really_gives_other_strides_than_the_capture() -> None:
    """Guard on the premise: if torch ever agrees with its fake kernel, this test says so."""
    model, x = _model()
    captured = capture(model, (x,))
    sdpa = [n for n in captured.graph_module.graph.nodes
            if n.target == torch.ops.aten.scaled_dot_product_attention.default]
    assert sdpa
    seen: dict[str, tuple[int, ...]] = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> object:
            out = super().run_node(n)
            if n in sdpa:
                seen[n.name] = out.stride()
            return out

    with torch.enable_grad():
        Recorder(captured.graph_module).run(x)
    fake = sdpa[0].meta["val"].stride()
    assert seen[sdpa[0].name] != fake, "CPU SDPA now lays out like its fake kernel"


def test_profiling_replays_a_view_of_a_differently_strided_tensor() -> None:
    model, x = _model()
    captured = capture(model, (x,))
    costs = profile_graph(captured, [x], warmup=0, repeats=1)
    assert len(costs.nodes) > 20 and all(n.fwd_us >= 0 for n in costs.nodes)


@pytest.mark.parametrize("num_stages", [2, 4])
def test_stages_match_the_model_loss_and_every_gradient(num_stages: int) -> None:
    model, x = _model()
    reference = copy.deepcopy(model)
    target = torch.randn(B, 3)

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(out, y)

    pipe = autopart.compile(model, (x,), loss_fn=loss_fn, num_stages=num_stages,
                            num_microbatches=2, time_limit_s=5.0)
    assert_train_step_matches(pipe, reference, (x,), target, loss_fn)
