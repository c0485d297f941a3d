"""Tests of profile_analytical: FLOPs against torch's counter and the closed form, roofline, meta models."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from autopart.core.capture import capture
from autopart.core.cluster import PRESETS
from autopart.core.errors import PlanError, ProfileError
from autopart.profiler import flop_formulas, profile_analytical, profile_graph
from autopart.profiler._oputil import causal_fraction
from autopart.profiler.analytical import MATMUL_EFFICIENCY, MEMORY_EFFICIENCY
from tests.profiler._models import B, D, L, T, V, small_gpt2

pytest.importorskip("transformers")


def test_gpt2_flops_match_counter_and_closed_form() -> None:
    model, x = small_gpt2()
    captured = capture(model, (x,))
    costs = profile_analytical(captured, None, PRESETS["h100-sxm"])
    flops = sum(n.flops for n in costs.nodes)
    with FlopCounterMode(display=False, custom_mapping=flop_formulas()) as counter:
        model(x)
    assert abs(flops / counter.get_total_flops() - 1) < 0.03
    # 2 * matmul parameters * tokens + attention (QK^T and AV: 2 * 2 * B * T^2 * D per layer).
    closed = 2 * (L * 12 * D * D + D * V) * B * T + L * 4 * B * T * T * D
    assert abs(flops / closed - 1) < 0.03
    assert costs.source == "analytical:h100-sxm" and costs.bwd_source.startswith("estimated:")
    assert costs.fingerprint == captured.fingerprint


def test_linear_roofline_hand_worked() -> None:
    spec = PRESETS["a100-80gb"]
    model = nn.Sequential(nn.Linear(256, 512))
    x = torch.randn(128, 256)
    costs = profile_analytical(capture(model, (x,)), [x], spec, dtype=torch.float32)
    (node,) = costs.nodes
    flops = 2 * 128 * 256 * 512
    nbytes = (128 * 256 + 512 * 256 + 512 + 128 * 512) * 4
    assert node.flops == flops and node.bytes_accessed == nbytes
    expect = max(flops / (19.5e12 * MATMUL_EFFICIENCY),
                 nbytes / (spec.memory_bandwidth_bytes_per_s * MEMORY_EFFICIENCY)) * 1e6
    assert node.fwd_us == pytest.approx(expect + spec.op_overhead_us)
    # Backward: weight gradient one forward's worth; no input gradient (x needs none).
    assert node.bwd_weight_us == pytest.approx(node.fwd_us) and node.bwd_input_us == 0
    assert node.saved_bytes == 128 * 256 * 4  # the input; the weight is a parameter


@pytest.mark.parametrize("attn_pdrop", [0.0, 0.1])
def test_analytical_saved_matches_measured_on_cpu(attn_pdrop: float) -> None:
    # on the cpu spec attention saves what torch's CPU kernel saves: the flash kernel (with
    # the boolean causal mask converted per call) without dropout, the math path with it
    model, x = small_gpt2(attn_pdrop=attn_pdrop)
    captured = capture(model, (x,))
    ana = profile_analytical(captured, [x], PRESETS["cpu"])
    meas = profile_graph(captured, [x], warmup=0, repeats=1)
    for a, m in zip(ana.nodes, meas.nodes, strict=True):
        assert a.flops == m.flops, a.name
        assert a.saved_bytes == m.saved_bytes, a.name
        if "scaled_dot_product" not in a.op:  # the mask's float copy has no producer
            assert a.saved_from == m.saved_from, a.name
        assert a.strided_output_bytes == m.strided_output_bytes, a.name


def test_analytical_attention_follows_the_gpu_fused_kernels() -> None:
    # on a GPU preset attention saves q, k, v, the output, the mask and a float32
    # log-sum-exp per query row, dropout or not: no (B, heads, T, T) weights
    model, x = small_gpt2(attn_pdrop=0.1)
    captured = capture(model, (x,))
    on_gpu = profile_analytical(captured, [x], PRESETS["h100-sxm"])
    on_cpu = profile_analytical(captured, [x], PRESETS["cpu"])
    attention = [i for i, n in enumerate(on_gpu.nodes) if "scaled_dot_product" in n.op]
    assert len(attention) == L
    qkv = B * T * D * 4  # one float32 (B, heads, T, head dim) tensor
    weights = B * 4 * T * T * 4  # one float32 (B, heads, T, T) tensor
    lse, mask = B * 4 * T * 4, B * T * T  # the boolean mask, saved once (the first layer)
    assert on_gpu.nodes[attention[0]].saved_bytes == 4 * qkv + lse  # is_causal: no mask
    masked = profile_analytical(capture(model, (x,), attention_flags=False), [x],
                                PRESETS["h100-sxm"])
    with_mask = [n for n in masked.nodes if "scaled_dot_product" in n.op]
    assert with_mask[0].saved_bytes == 4 * qkv + lse + mask
    assert not masked.causal_attention
    assert on_gpu.causal_attention == {on_gpu.nodes[i].name for i in attention}
    for i, full in zip(attention, with_mask, strict=True):
        # the kernel that skips does the causal share of the masked one's work
        kept = on_gpu.nodes[i]
        assert kept.flops == int(full.flops * causal_fraction(T, T))
    for i in attention:  # the math path: q, k, v and the weights before and after dropout
        assert on_cpu.nodes[i].saved_bytes >= 3 * qkv + 2 * weights


def test_causal_attention_is_priced_at_the_pairs_it_keeps() -> None:
    # a meta Llama at 2048 tokens: attention is compute-bound on an H100, so its time past
    # the op's fixed cost follows the causal share of its FLOPs, forward and backward
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=256, num_hidden_layers=1, intermediate_size=512,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                   max_position_embeddings=2048, use_cache=False)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    x = torch.zeros(1, 2048, dtype=torch.long, device="meta")
    spec = PRESETS["h100-sxm"]
    skips, full = (profile_analytical(capture(model, (x,), attention_flags=flags), None, spec,
                                      dtype=torch.bfloat16) for flags in (True, False))
    (kept,), (every,) = ([n for n in c.nodes if "scaled_dot_product" in n.op]
                         for c in (skips, full))
    share = causal_fraction(2048, 2048)
    assert kept.name in skips.causal_attention and not full.causal_attention
    ov = spec.op_overhead_us
    assert kept.fwd_us - ov == pytest.approx((every.fwd_us - ov) * share, rel=1e-3)
    assert kept.bwd_input_us - ov == pytest.approx((every.bwd_input_us - ov) * share, rel=1e-3)


def test_meta_llama_profiles_without_weights() -> None:
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                                   num_attention_heads=4, num_key_value_heads=4, vocab_size=256,
                                   max_position_embeddings=64, use_cache=False)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    x = torch.zeros(1, 32, dtype=torch.long, device="meta")
    captured = capture(model, (x,))
    costs = profile_analytical(captured, None, PRESETS["h100-sxm"], dtype=torch.bfloat16)
    linear_flops = 2 * 32 * sum(n for k, n in costs.param_numel.items()
                                if k.endswith("proj.weight") or k == "lm_head.weight")
    total = sum(n.flops for n in costs.nodes)
    assert linear_flops <= total < 1.1 * linear_flops
    assert costs.total_bwd_us() > 0 and costs.total_fwd_us() > 0
    assert sum(n.saved_bytes for n in costs.nodes) > 0


def test_bad_arguments_raise() -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    x = torch.randn(2, 4)
    captured = capture(model, (x,))
    with pytest.raises(ProfileError, match=r"takes 1 flat inputs, got 2"):
        profile_analytical(captured, [x, x], PRESETS["l4"])
    with pytest.raises(ProfileError, match=r"no peak for dtype 'torch.int8'.*float32, bfloat16"):
        profile_analytical(captured, None, PRESETS["l4"], dtype=torch.int8)


def test_preset_peaks_per_dtype() -> None:
    h100 = PRESETS["h100-sxm"]
    assert h100.peak_flops_for("bfloat16") == 989.4e12
    assert h100.peak_flops_for("torch.float32") == 67e12
    assert h100.peak_flops_for("float32", tf32=True) == 494.7e12
    for name in ("h100-sxm", "h200", "a100-40gb", "a100-80gb", "l4", "cpu"):
        spec = PRESETS[name]
        assert spec.flops_source and spec.peak_flops_for("float16") > 0
    with pytest.raises(PlanError, match=r"no peak for dtype 'int8'"):
        h100.peak_flops_for("int8")
