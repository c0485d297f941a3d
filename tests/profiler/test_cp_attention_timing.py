"""The runtime's cp attention timed against the model's own on a captured graph's shapes:
what the solver prices in place of its block count."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("transformers")

from autopart.codegen.attention_graph import attention_calls  # noqa: E402
from autopart.codegen.context_parallel import (  # noqa: E402
    ContextParallelAttention,
    sequence_order,
    stand_in_attention,
)
from autopart.core.capture import capture  # noqa: E402
from autopart.core.context import context_inputs  # noqa: E402
from autopart.core.errors import PlanError  # noqa: E402
from autopart.profiler.context_attention import measure_context_attention  # noqa: E402
from tests.distributed.cp_worker import tiny_model  # noqa: E402


def _captured(name: str = "llama", seq: int = 32):
    model, args, _, _ = tiny_model(name, seq, 2)
    inputs, kwargs, _ = context_inputs(model, 2, args, {})
    return capture(model, inputs, kwargs)


def test_a_llamas_layers_share_one_attention_call_read_before_the_heads_repeat() -> None:
    calls = attention_calls(_captured())
    assert len(calls) == 1  # both layers alike
    call = calls[0]
    # one cp rank's 16 of 32 tokens, 4 query heads, 2 key heads repeated twice
    assert call.query[1:3] == (4, 16) and call.key[1] == 4 and call.moved_key[1] == 2
    assert call.kv_repeat == 2 and call.causal
    bert = attention_calls(_captured("bert"))
    assert len(bert) == 1 and not bert[0].causal and bert[0].kv_repeat == 1


@pytest.mark.parametrize("rank", [0, 1])
def test_the_stand_in_computes_what_the_runtime_would_from_these_keys_on_every_rank(
        rank: int) -> None:
    """With every cp rank holding the same keys, the runtime's gathered keys are the rank's
    repeated cp times: the stand-in's output is the causal attention of the rank's two query
    chunks over those keys in sequence order, as plain SDPA computes it."""
    call = attention_calls(_captured())[0]
    module = stand_in_attention(call, 2, rank)
    assert isinstance(module, ContextParallelAttention)
    torch.manual_seed(0)
    q = torch.randn(call.query)
    k, v = torch.randn(call.moved_key), torch.randn(call.moved_key)
    got = module(q, k, v)
    local = k.shape[2]
    order = sequence_order(2, local)
    keys, values = (torch.cat([t, t], 2).index_select(2, order).repeat_interleave(2, 1)
                    for t in (k, v))
    chunk, outs = local // 2, []
    for i, g in enumerate((rank, 3 - rank)):  # the rank's chunks, each over keys 0..g
        allowed = torch.ones(chunk, 4 * chunk, dtype=torch.bool).tril(g * chunk)
        outs.append(torch.nn.functional.scaled_dot_product_attention(
            q[:, :, i * chunk:(i + 1) * chunk], keys, values, attn_mask=allowed,
            scale=call.scale))
    torch.testing.assert_close(got, torch.cat(outs, 2))


def test_the_measured_ratios_are_positive_and_bad_input_is_refused() -> None:
    captured = _captured(seq=64)
    for attention in ("all_gather", "ulysses"):
        fwd, bwd = measure_context_attention(captured, 2, attention, pairs=3, budget_s=0.5)
        assert math.isfinite(fwd) and math.isfinite(bwd) and fwd > 0 and bwd > 0
    with pytest.raises(ValueError, match="cp >= 2"):
        measure_context_attention(captured, 1)
    with pytest.raises(ValueError, match="'all_gather' or 'ulysses'"):
        measure_context_attention(captured, 2, "ring")
    model, args, _, _ = tiny_model("llama", 16, 2)
    model.config._attn_implementation = "eager"
    inputs, kwargs, _ = context_inputs(model, 2, args, {})
    with pytest.raises(PlanError, match="no aten.scaled_dot_product_attention"):
        measure_context_attention(capture(model, inputs, kwargs), 2)
