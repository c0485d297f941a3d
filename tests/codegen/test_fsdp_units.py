"""group_layers: a stage's layers moved into submodules at their paths compute the same
outputs and gradients on the same parameter objects under the same FQNs; layers it cannot
move (split in two runs, a tensor read outside the layer, a buffer written in place) stay
inline."""

from __future__ import annotations

import torch
from torch import nn
from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from autopart.codegen import build_stages
from autopart.codegen.fsdp_units import group_layers, layer_of
from autopart.core.capture import capture, op_nodes
from tests.plans import manual_plan

VOCAB, SEQ = 128, 16


def _model(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "gpt2":
        return GPT2LMHeadModel(GPT2Config(n_layer=3, n_embd=64, n_head=4, vocab_size=VOCAB,
                                          n_positions=SEQ, use_cache=False, resid_pdrop=0.0,
                                          embd_pdrop=0.0, attn_pdrop=0.0))
    if name == "llama":
        return LlamaForCausalLM(LlamaConfig(num_hidden_layers=3, hidden_size=64,
                                            intermediate_size=128, num_attention_heads=4,
                                            num_key_value_heads=2, vocab_size=VOCAB,
                                            use_cache=False))
    return BertModel(BertConfig(num_hidden_layers=3, hidden_size=64, intermediate_size=128,
                                num_attention_heads=4, vocab_size=VOCAB,
                                max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                                attention_probs_dropout_prob=0.0))


def _stage(model: nn.Module, x: torch.Tensor, cut_at: float | None = None) -> torch.fx.GraphModule:
    captured = capture(model, (x,))
    n = len(op_nodes(captured.graph_module.graph))
    positions = [] if cut_at is None else [int(n * cut_at)]
    plan = manual_plan(captured, positions, 1, x.shape[0], schedule_kind="1f1b")
    return build_stages(captured, plan, ["cpu"] * (len(positions) + 1)).modules[0]


def _first(out: object) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out  # type: ignore[index,return-value]


def test_every_layer_becomes_a_submodule_with_the_same_numerics_and_fqns() -> None:
    x = torch.randint(0, VOCAB, (2, SEQ))
    for name, stack in (("gpt2", "transformer.h"), ("llama", "model.layers"),
                        ("bert", "encoder.layer")):
        gm = _stage(_model(name), x)
        before = dict(gm.named_parameters())
        want = _first(gm(x))
        want.float().pow(2).sum().backward()
        grads = {k: p.grad.clone() for k, p in before.items() if p.grad is not None}
        for p in before.values():
            p.grad = None
        paths = group_layers(gm)
        assert paths == [f"{stack}.{i}" for i in range(3)], name
        for path in paths:
            layer = gm.get_submodule(path)
            assert isinstance(layer, torch.fx.GraphModule)
            assert any(n.op == "call_module" and n.target == path for n in gm.graph.nodes)
        after = dict(gm.named_parameters())
        assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)
        got = _first(gm(x))
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        got.float().pow(2).sum().backward()
        for k, g in grads.items():
            torch.testing.assert_close(after[k].grad, g, rtol=0, atol=0, msg=f"{name} {k}")
        # no layer's op is left in the stage's own graph
        assert not any(layer_of(n) for n in gm.graph.nodes if n.op == "call_function"), name


def test_a_stage_cut_inside_a_layer_groups_its_own_part() -> None:
    x = torch.randint(0, VOCAB, (2, SEQ))
    gm = _stage(_model("gpt2"), x, cut_at=0.5)
    want = [t.clone() for t in gm(x)]
    paths = group_layers(gm)
    assert paths and paths[0] == "transformer.h.0"
    for got, ref in zip(gm(x), want, strict=True):
        torch.testing.assert_close(got, ref, rtol=0, atol=0)


class _Shared(nn.Module):
    """Layer 1 reads layer 0's weight (a tensor outside its own path), layer 2 updates a
    buffer in place."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.layers[2].register_buffer("count", torch.zeros(()))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self.layers[0](h)
        h = torch.tanh(self.layers[1](h)) @ self.layers[0].weight
        self.layers[2].count.add_(1)
        return self.layers[2](h)


def test_layers_sharing_a_tensor_or_writing_a_buffer_stay_inline() -> None:
    x = torch.randn(4, 8)
    model = _Shared()
    gm = _stage(model, x)
    want = gm(x)
    # layer 0's weight is read outside its run, layer 2 writes a buffer: layer 1 alone moves
    assert group_layers(gm) == ["layers.1"]
    torch.testing.assert_close(gm(x), want)


def test_a_layer_whose_output_a_later_op_writes_in_place_stays_inline() -> None:
    # FSDP2 hooks a unit's outputs for its backward; an in-place write on one would drop it
    x = torch.randn(4, 8)
    gm = _stage(_TwoLayers(), x)
    layer_out = [n for n in gm.graph.nodes if layer_of(n) == "layers.0"][-1]
    with gm.graph.inserting_after(layer_out):
        gm.graph.call_function(torch.ops.aten.mul_.Tensor, (layer_out, 1.0))
    gm.recompile()
    assert group_layers(gm) == ["layers.1"]


class _TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.layers[1](torch.relu(self.layers[0](h)))
