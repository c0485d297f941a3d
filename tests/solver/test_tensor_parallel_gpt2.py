"""Tensor-parallel pairs found in a real captured graph (a 2-layer GPT-2 on the meta device)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from autopart.core.capture import capture  # noqa: E402
from autopart.core.cluster import PRESETS  # noqa: E402
from autopart.core.costgraph import CostGraph  # noqa: E402
from autopart.profiler import profile_analytical  # noqa: E402
from autopart.solver.tensor_parallel import find_tensor_parallel  # noqa: E402
from autopart.solver.tensor_parallel_costs import shard_costs  # noqa: E402


@pytest.fixture(scope="module")
def gpt2_costs() -> CostGraph:
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=32,
                                     vocab_size=96, use_cache=False, bos_token_id=0,
                                     eos_token_id=0)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(config).to(torch.bfloat16)
    x = torch.zeros(1, 32, dtype=torch.long, device="meta")
    return profile_analytical(capture(model.train(), (x,)), None, PRESETS["a100-80gb"],
                              dtype=torch.bfloat16)


def test_attention_and_mlp_pairs_and_the_tied_vocab(gpt2_costs: CostGraph) -> None:
    costs = gpt2_costs
    split = find_tensor_parallel(costs)
    mods = [(tuple(costs.nodes[c].module_path for c in cols), costs.nodes[r].module_path)
            for cols, r in split.pairs]
    assert mods == [(("transformer.h.0.attn.c_attn",), "transformer.h.0.attn.c_proj"),
                    (("transformer.h.0.mlp.c_fc",), "transformer.h.0.mlp.c_proj"),
                    (("transformer.h.1.attn.c_attn",), "transformer.h.1.attn.c_proj"),
                    (("transformer.h.1.mlp.c_fc",), "transformer.h.1.mlp.c_proj")]
    # the embedding and the head share wte: vocab-parallel
    assert {costs.nodes[i].op for i in split.vocab} == {
        "aten.embedding.default", "aten.linear.default"}
    assert split.params["transformer.wte.weight"] == "vocab"
    assert split.params["transformer.h.0.attn.c_attn.bias"] == "column"
    assert split.params["transformer.h.0.mlp.c_proj.weight"] == "row"
    # layer norms, position embeddings and the row-parallel biases stay replicated
    for name in ("transformer.h.0.ln_1.weight", "transformer.wpe.weight",
                 "transformer.h.0.mlp.c_proj.bias"):
        assert name not in split.params


def test_one_gpus_share_of_the_parameters_is_the_hand_count(gpt2_costs: CostGraph) -> None:
    costs = gpt2_costs
    tp2 = shard_costs(costs, 2, bandwidth_bytes_per_s=240e9, latency_us=1.0,
                      op_overhead_us=PRESETS["a100-80gb"].op_overhead_us)
    h, v, s = 64, 96, 32
    # per layer, bf16 elements: split c_attn (3h x h + 3h), c_fc (4h x h + 4h), the two c_proj
    # weights (h x h, 4h x h); replicated: two layer norms (2 x 2h) and the c_proj biases (2h)
    split_layer = 3 * h * h + 3 * h + 4 * h * h + 4 * h + h * h + 4 * h * h
    whole_layer = 4 * h + 2 * h
    split_elems = 2 * split_layer + v * h
    whole_elems = 2 * whole_layer + s * h + 2 * h  # + position embeddings and ln_f
    assert sum(costs.param_sizes.values()) == 2 * (split_elems + whole_elems)
    assert sum(tp2.param_sizes.values()) == 2 * (split_elems // 2 + whole_elems)
