"""Mixture-of-experts GEMMs priced: grouped-GEMM FLOPs, the Mixtral 8x7B shape against a hand
count, and the experts' weight gradients in the W part of the backward."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from autopart.core.capture import capture
from autopart.core.cluster import PRESETS
from autopart.profiler import flop_formulas, profile_analytical, profile_graph
from autopart.profiler._oputil import grouped_mm_flop

transformers = pytest.importorskip("transformers")


def _loop_flops(a: torch.Tensor, b: torch.Tensor, offs: list[int]) -> int:
    """FLOPs of the same grouped GEMM written as one torch.mm per group, as counted by torch."""
    with FlopCounterMode(display=False) as counter:
        start = 0
        for g, end in enumerate(offs):
            if a.dim() == 2 and b.dim() == 3:
                torch.mm(a[start:end], b[g])
            elif a.dim() == 2 and b.dim() == 2:
                torch.mm(a[:, start:end], b[start:end])
            start = end
    return int(counter.get_total_flops())


def test_grouped_mm_flops_equal_one_mm_per_group() -> None:
    a, b = torch.randn(10, 16), torch.randn(3, 16, 8)
    offs = [3, 3, 10]  # uneven routing, one empty expert
    assert grouped_mm_flop(a.shape, b.shape, out_shape=(10, 8)) == _loop_flops(a, b, offs)
    # the weight gradient's form: groups along K, out [G, M, N]
    a2, b2 = torch.randn(16, 10), torch.randn(10, 8)
    assert grouped_mm_flop(a2.shape, b2.shape, out_shape=(3, 16, 8)) == _loop_flops(a2, b2, offs)
    # batched: 3-D x 3-D
    assert grouped_mm_flop((3, 5, 16), (3, 16, 8), out_shape=(3, 5, 8)) == 2 * 3 * 5 * 16 * 8


def test_grouped_mm_counted_through_the_counter() -> None:
    import transformers.integrations.moe  # noqa: F401  (registers transformers::grouped_mm_fallback)

    x, w = torch.randn(10, 16), torch.randn(3, 16, 8)
    offs = torch.tensor([3, 7, 10], dtype=torch.int32)
    with FlopCounterMode(display=False, custom_mapping=flop_formulas()) as counter:
        torch.ops.transformers.grouped_mm_fallback(x, w, offs)
        torch._grouped_mm(x.bfloat16(), w.bfloat16(), offs)
    assert counter.get_total_flops() == 2 * (2 * 10 * 16 * 8)


def _mixtral(layers: int, **kw: int) -> transformers.MixtralConfig:
    shape = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                 num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
                 vocab_size=32000)
    shape.update(kw)
    return transformers.MixtralConfig(num_hidden_layers=layers, use_cache=False, **shape)


def test_mixtral_8x7b_forward_flops_against_a_hand_count() -> None:
    """Mixtral 8x7B (Jiang et al., 2024, table 1: hidden 4096, FFN 14336, 32 heads, 8 KV heads,
    8 experts, top-2, vocab 32000) at 4096 tokens, on meta. Two layers: every layer is the same,
    so the 32-layer model's count is 32x a layer plus the LM head (`autopart profile` of the
    whole model gives 113.23 TFLOP)."""
    cfg = _mixtral(2)
    with torch.device("meta"):
        model = transformers.MixtralForCausalLM(cfg).to(torch.bfloat16)
    s, h, f, kv = 4096, 4096, 14336, 1024
    x = torch.zeros(1, s, dtype=torch.long, device="meta")
    costs = profile_analytical(capture(model, (x,)), None, PRESETS["h100-sxm"])
    # per token: q, o (h x h), k, v (h x kv); top-2 of three h x f matrices; the router (h x 8);
    # attention scores and values over the whole sequence (torch counts causal SDPA in full)
    per_layer = 2 * s * (2 * h * h + 2 * h * kv + 2 * 3 * h * f + h * 8) + 2 * 2 * s * s * h
    head = 2 * s * h * 32000
    layers = {}
    for n in costs.nodes:
        parts = n.module_path.split(".")
        if parts[:2] == ["model", "layers"]:
            layers[parts[2]] = layers.get(parts[2], 0) + n.flops
    assert layers.keys() == {"0", "1"}
    for got in layers.values():
        assert abs(got / per_layer - 1) < 0.05
    total = sum(n.flops for n in costs.nodes)
    assert abs(total / (2 * per_layer + head) - 1) < 0.05
    whole = 32 * per_layer + head  # the 8x7B model: 113.2 TFLOP per 4096-token sequence
    assert abs((32 * layers["0"] + total - 2 * layers["0"]) / whole - 1) < 0.05
    experts = [n for n in costs.nodes if n.op == "aten._grouped_mm.default"]
    assert len(experts) == 4
    for n in experts:  # each expert GEMM: both gradients, each one forward's worth
        assert n.flops > 0
        assert n.bwd_input_us == pytest.approx(n.fwd_us)
        assert n.bwd_weight_us == pytest.approx(n.fwd_us)


def test_measured_experts_count_flops_and_time_weight_gradients() -> None:
    """On CPU in float32, transformers runs the experts with its grouped-GEMM fallback op; the
    measured profile counts its FLOPs and times the stacked experts' gradient (read through a
    transpose) as the weight part of the backward."""
    cfg = _mixtral(1, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                   num_key_value_heads=2, num_local_experts=4, vocab_size=128)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(cfg)
    x = torch.randint(0, 128, (2, 16))
    captured = capture(model, (x,))
    costs = profile_graph(captured, [x], warmup=0, repeats=1)
    experts = [n for n in costs.nodes if "grouped_mm" in n.op]
    assert len(experts) == 2
    tokens = 2 * 16 * 2  # top-2
    assert sorted(n.flops for n in experts) == [2 * tokens * 96 * 64, 2 * tokens * 64 * 2 * 96]
    for n in experts:
        assert n.bwd_weight_us > 0 and n.params == ()
    ana = profile_analytical(captured, [x], PRESETS["cpu"])
    assert [n.flops for n in ana.nodes] == [n.flops for n in costs.nodes]
