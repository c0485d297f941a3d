"""Eager attention with learned sinks (GPT-OSS and its kind) captured as one fused attention
over an extra sink key, with the eager model's loss and every gradient."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autopart.core.capture import capture
from autopart.core.capturedgraph import SINK_ATTENTION_META
from autopart.core.errors import PlanError

transformers = pytest.importorskip("transformers")

SDPA = torch.ops.aten.scaled_dot_product_attention.default


def _gpt_oss() -> nn.Module:
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(
        vocab_size=128, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=4, max_position_embeddings=64, use_cache=False,
        layer_types=["sliding_attention", "full_attention"]))
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "sinks"):
                module.sinks.normal_()  # the initialisation's zeros would hide a wrong sign
    return model


def _check_loss_and_grads(model: nn.Module, args: tuple, kwargs: dict) -> list[torch.fx.Node]:
    captured = capture(model, args, kwargs)
    model.zero_grad()
    expected = model(*args, **kwargs)
    expected = expected.loss if hasattr(expected, "loss") else expected.sum()
    expected.backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    out = captured.graph_module.forward(*captured.flatten_inputs(args, kwargs))[0]
    (out if out.dim() == 0 else out.sum()).backward()
    torch.testing.assert_close(out if out.dim() == 0 else out.sum(), expected,
                               rtol=1e-5, atol=4e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], rtol=1e-5, atol=4e-5, msg=name)
    return [n for n in captured.graph_module.graph.nodes if n.target is SDPA]


def test_gpt_oss_attention_is_one_fused_call_per_layer_with_the_eager_loss_and_gradients() -> None:
    model = _gpt_oss()
    ids = torch.randint(0, 128, (2, 12))
    calls = _check_loss_and_grads(model, (ids,), {"labels": ids})
    assert len(calls) == 2 and all(c.meta[SINK_ATTENTION_META] for c in calls)
    sliding, full = calls
    # the full layer's causal mask (with the sink column) became the flag; the window stays
    assert full.kwargs.get("is_causal") and (len(full.args) < 4 or full.args[3] is None)
    assert isinstance(sliding.args[3], torch.fx.Node)
    # one more key (the sink) and a head dimension padded to 16 from 8 + 1
    assert tuple(full.args[1].meta["val"].shape) == (2, 4, 13, 16)
    gm = capture(model, (ids,), {"labels": ids}).graph_module
    assert not any(n.target is torch.ops.aten.max.dim for n in gm.graph.nodes)


class FlintLikeAttention(nn.Module):
    """Flint's form: no max subtracted, sinks expanded from the scores' shape, a cast, no mask."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.sinks = nn.Parameter(torch.randn(2))

    def forward(self, x: torch.Tensor, dropout: float = 0.0) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 2, 8).permute(2, 0, 3, 1, 4)
        scores = torch.matmul(q, k.transpose(2, 3)) / 8 ** 0.5
        sinks = self.sinks.reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = F.softmax(torch.cat([scores, sinks], dim=-1), dim=-1)[..., :-1].to(v.dtype)
        probs = F.dropout(probs, p=dropout, training=self.training)
        return torch.matmul(probs, v).transpose(1, 2).reshape(b, t, 16)


def test_an_unmasked_attention_with_sinks_in_another_form_is_rewritten_too() -> None:
    torch.manual_seed(0)
    calls = _check_loss_and_grads(FlintLikeAttention(), (torch.randn(3, 5, 16),), {})
    assert len(calls) == 1 and calls[0].meta[SINK_ATTENTION_META]
    assert len(calls[0].args) < 4 or calls[0].args[3] is None  # no mask: none added
    assert calls[0].kwargs["scale"] == pytest.approx(8 ** -0.5)


def test_dropout_in_training_is_left_as_captured() -> None:
    torch.manual_seed(0)
    model = FlintLikeAttention().train()
    captured = capture(model, (torch.randn(3, 5, 16),), {"dropout": 0.1})
    nodes = list(captured.graph_module.graph.nodes)
    assert not any(n.target is SDPA for n in nodes)
    assert any(n.target is torch.ops.aten.softmax.int for n in nodes)


def test_context_parallelism_refuses_sink_attention_with_the_fix() -> None:
    from autopart.codegen.attention_graph import attention_kinds

    model = _gpt_oss()
    ids = torch.randint(0, 128, (2, 12))
    with pytest.raises(PlanError, match=r"learned sinks.*cp=1"):
        attention_kinds(capture(model, (ids,)))


def test_a_two_dimensional_causal_mask_is_read_and_becomes_the_flag() -> None:
    from benchmarks.gpu.sink_attention import SinkAttention  # GPT-OSS's eager code, a [S, S] mask

    torch.manual_seed(0)
    module = SinkAttention(heads=4, kv_heads=2, dim=8)
    args = (torch.randn(2, 6, 32), torch.randn(2, 6, 16), torch.randn(2, 6, 16))
    calls = _check_loss_and_grads(module, args, {})
    assert len(calls) == 1 and calls[0].kwargs.get("is_causal")
