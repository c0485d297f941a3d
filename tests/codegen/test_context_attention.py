"""What context parallelism reads and refuses, in one process: the attention kinds of GPT-2,
Llama and BERT captures, the token layout of a cp rank, and the refusals (eager attention, a
padding mask, caller-given positions, a sequence cp cannot cut, a model without
position_ids)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from autopart.codegen.attention_graph import attention_kinds  # noqa: E402
from autopart.core.capture import capture  # noqa: E402
from autopart.core.context import context_inputs, context_positions, context_share  # noqa: E402
from autopart.core.errors import PlanError  # noqa: E402
from tests.distributed.cp_worker import tiny_model  # noqa: E402


def test_each_rank_holds_two_mirrored_chunks_and_every_token_once() -> None:
    assert context_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert context_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    held = torch.cat([context_positions(64, 4, r) for r in range(4)])
    assert sorted(held.tolist()) == list(range(64))
    with pytest.raises(PlanError, match="multiple of 4"):
        context_positions(6, 2, 0)


def test_share_cuts_every_sequence_tensor_and_adds_positions() -> None:
    x, y, scale = torch.arange(16).view(2, 8), torch.arange(16).view(2, 8) + 100, torch.ones(2)
    args, kwargs, target = context_share(2, 1, (x, scale), {}, y)
    assert args[0].tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert args[1] is scale  # not a sequence tensor
    assert target.tolist() == [[102, 103, 104, 105], [110, 111, 112, 113]]
    assert kwargs["position_ids"].tolist() == [[2, 3, 4, 5]] * 2
    assert context_share(1, 0, (x,), {}, y) == ((x,), {}, y)
    with pytest.raises(PlanError, match="position_ids passed"):
        context_share(2, 0, (x,), {"position_ids": x}, y)


@pytest.mark.parametrize(("name", "causal"), [("llama", True), ("gpt2", True), ("bert", False)])
def test_the_attention_kind_is_read_from_the_models_own_mask(name: str, causal: bool) -> None:
    model, args, _, _ = tiny_model(name, 16, 2)
    inputs, kwargs, _ = context_inputs(model, 2, args, {})
    kinds = attention_kinds(capture(model, inputs, kwargs))
    assert len(kinds) == 2 and set(kinds.values()) == {causal}


def test_eager_attention_a_padding_mask_and_no_position_ids_are_refused() -> None:
    model, args, _, _ = tiny_model("llama", 16, 2)
    model.config._attn_implementation = "eager"
    inputs, kwargs, _ = context_inputs(model, 2, args, {})
    with pytest.raises(PlanError, match="no aten.scaled_dot_product_attention.*cp=1"):
        attention_kinds(capture(model, inputs, kwargs))
    model, args, _, _ = tiny_model("llama", 16, 2)
    inputs, kwargs, _ = context_inputs(model, 2, args, {})
    kwargs["attention_mask"] = torch.ones_like(inputs[0])
    with pytest.raises(PlanError, match="attention_mask input"):
        attention_kinds(capture(model, inputs, kwargs))

    class NoPositions(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    with pytest.raises(PlanError, match="takes no position_ids"):
        context_inputs(NoPositions(), 2, args, {})


@pytest.mark.parametrize("attention", ["all_gather", "ulysses"])
def test_grouped_query_keys_and_values_are_taken_before_their_repeat(attention: str) -> None:
    """Llama's 2 key / value heads reach the cp attention unrepeated (half the bytes to move
    for its 4 query heads), and transformers' repeat_kv ops leave the stage."""
    from autopart.codegen.context_parallel import (
        ContextParallelAttention,
        UlyssesAttention,
        context_parallel,
    )
    from autopart.codegen.tp_layout import TensorParallelRank

    model, args, _, _ = tiny_model("llama", 16, 2)
    inputs, kwargs, _ = context_inputs(model, 2, args, {})
    captured = capture(model, inputs, kwargs)
    gm = captured.graph_module

    def repeats() -> int:  # expands to [B, Hk, n, S, D]: transformers' repeat_kv
        return sum(1 for n in gm.graph.nodes
                   if str(n.target) == "aten.expand.default" and len(n.args[1]) == 5)

    assert repeats() == 4  # keys and values of 2 layers
    assert context_parallel(gm, attention_kinds(captured), TensorParallelRank(0, 2, "unused"),
                            attention) == 2
    kind = {"all_gather": ContextParallelAttention, "ulysses": UlyssesAttention}[attention]
    mods = [m for m in gm.modules() if isinstance(m, kind)]
    assert [m.kv_repeat for m in mods] == [2, 2]
    calls = [n for n in gm.graph.nodes if n.op == "call_module" and "context_parallel" in n.target]
    for call in calls:  # keys and values of 2 heads, the queries' 4
        assert [tuple(a.meta["val"].shape)[1] for a in call.args] == [4, 2, 2]
    assert repeats() == 0  # each layer's two repeats are gone
