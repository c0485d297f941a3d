"""The exact column/row pairs ``find_tensor_parallel`` finds in captured tiny GPT-2, Llama
(grouped-query attention) and BERT (sibling-module pairs), and the collectives priced on them."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from autopart.core.capture import capture  # noqa: E402
from autopart.core.cluster import PRESETS  # noqa: E402
from autopart.core.costgraph import CostGraph  # noqa: E402
from autopart.profiler import profile_analytical  # noqa: E402
from autopart.solver.collectives import all_gather_us  # noqa: E402
from autopart.solver.tensor_parallel import find_tensor_parallel  # noqa: E402
from autopart.solver.tensor_parallel_costs import shard_costs  # noqa: E402
from tests.distributed.tp_worker import tiny  # noqa: E402

#: per model, per layer: (column modules, row module) under the layer's prefix
PAIRS = {
    "gpt2": ("transformer.h.{}.", [(("attn.c_attn",), "attn.c_proj"),
                                   (("mlp.c_fc",), "mlp.c_proj")]),
    "llama": ("model.layers.{}.", [(("self_attn.q_proj", "self_attn.k_proj",
                                     "self_attn.v_proj"), "self_attn.o_proj"),
                                   (("mlp.gate_proj", "mlp.up_proj"), "mlp.down_proj")]),
    "bert": ("bert.encoder.layer.{}.", [(("attention.self.query", "attention.self.key",
                                          "attention.self.value"), "attention.output.dense"),
                                        (("intermediate.dense",), "output.dense")]),
}
VOCAB = {"gpt2": {"transformer.wte", "lm_head"}, "llama": {"lm_head"},
         "bert": {"bert.embeddings.word_embeddings", "cls.predictions.decoder"}}


def _costs(name: str) -> CostGraph:
    model, args, _, _ = tiny(name)
    return profile_analytical(capture(model, (args[0][:2],)), None, PRESETS["a100-80gb"])


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
def test_exact_pairs_and_vocab_nodes(name: str) -> None:
    costs = _costs(name)
    split = find_tensor_parallel(costs)
    got = [(tuple(costs.nodes[c].module_path for c in cols), costs.nodes[r].module_path)
           for cols, r in split.pairs]
    prefix, layer = PAIRS[name]
    want = [(tuple(prefix.format(k) + c for c in cols), prefix.format(k) + row)
            for k in range(2) for cols, row in layer]
    assert got == want
    assert {costs.nodes[i].module_path for i in split.vocab} == VOCAB[name]


def test_bert_prices_one_gradient_all_reduce_per_pair_and_the_gathered_logits() -> None:
    costs = _costs("bert")
    split = find_tensor_parallel(costs)
    kw = {"bandwidth_bytes_per_s": 1e9, "latency_us": 1.0, "op_overhead_us": 0.0}
    tp2 = shard_costs(costs, 2, split=split, **kw)
    index = {nd.name: i for i, nd in enumerate(costs.nodes)}
    for cols, _ in split.pairs:
        # q/k/v (or intermediate.dense) read one hidden state: one all-reduce of it, on the
        # first column; the others only halve
        x = costs.nodes[index[costs.nodes[cols[0]].inputs[0]]].output_bytes
        extra = [tp2.nodes[c].bwd_input_us - costs.nodes[c].bwd_input_us / 2 for c in cols]
        assert extra == pytest.approx([x / 1000 + 2.0] + [0.0] * (len(cols) - 1))
    head = next(i for i in split.vocab if costs.nodes[i].op == "aten.linear.default")
    logits = costs.nodes[head].output_bytes
    assert tp2.nodes[head].output_bytes == logits
    assert tp2.nodes[head].fwd_us == pytest.approx(
        costs.nodes[head].fwd_us / 2 + all_gather_us(logits, 2, 1e9, 1.0))
