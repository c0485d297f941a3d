"""Finding transformers' experts modules in a captured graph, and the expert-parallel rewrite
of a stage (its numerics run on gloo ranks in tests/distributed/test_expert_parallel.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from autopart.codegen import TensorParallelRank, build_stages
from autopart.codegen.expert_parallel import expert_parallel, find_expert_blocks
from autopart.codegen.params import build_stage_modules
from autopart.codegen.split import split_graph
from autopart.core.capture import capture
from autopart.core.errors import PlanError
from tests.plans import manual_plan

transformers = pytest.importorskip("transformers")

COMMON = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=64, max_position_embeddings=16, use_cache=False)


def _captured(model: torch.nn.Module):
    torch.manual_seed(0)
    return capture(model, (torch.randint(0, 64, (2, 8)),))


def _mixtral():
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, **COMMON))


def test_mixtrals_experts_are_found_with_their_inputs_weights_and_activation() -> None:
    blocks = find_expert_blocks(_captured(_mixtral()).graph_module.graph)
    assert [b.path for b in blocks] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    b = blocks[0]
    assert (str(b.gate_up.target), str(b.down.target)) == (
        "model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj")
    assert b.num_experts == 4
    assert tuple(b.hidden.meta["val"].shape) == (16, 32)  # tokens, hidden
    assert tuple(b.index.meta["val"].shape) == tuple(b.weights.meta["val"].shape) == (16, 2)
    assert not b.index.meta["val"].dtype.is_floating_point
    assert any(n.target is torch.ops.aten.silu.default for n in b.act)
    assert tuple(b.output.meta["val"].shape) == (16, 32)


def test_a_dense_model_has_no_expert_blocks() -> None:
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=4, vocab_size=64, n_positions=16, use_cache=False))
    assert find_expert_blocks(_captured(gpt2).graph_module.graph) == []


def test_the_rewrite_keeps_this_ranks_experts_and_dispatches_to_the_rest() -> None:
    model = _mixtral()
    captured = _captured(model)
    [module], _ = build_stage_modules(captured, split_graph(captured, []), [torch.device("cpu")])
    layouts = expert_parallel(module, TensorParallelRank(1, 2, "ep-test"))
    assert set(layouts) == {f"model.layers.{i}.mlp.experts.{w}" for i in range(2)
                            for w in ("gate_up_proj", "down_proj")}
    whole = dict(model.named_parameters())
    for fqn, layout in layouts.items():
        assert layout.dim == 0 and layout.blocks == (4,)
        torch.testing.assert_close(module.get_parameter(fqn), whole[fqn][2:], rtol=0, atol=0)
    calls = [str(n.target) for n in module.graph.nodes if n.op == "call_module"]
    assert calls == [f"model.layers.{i}.mlp.experts.expert_parallel" for i in range(2)]
    source = module.code
    assert "grouped_mm" not in source and "histc" not in source


def test_an_expert_count_ep_does_not_divide_is_refused() -> None:
    captured = _captured(_mixtral())
    [module], _ = build_stage_modules(captured, split_graph(captured, []), [torch.device("cpu")])
    with pytest.raises(PlanError, match=r"ep=3 does not divide its 4 experts.*ep=1"):
        expert_parallel(module, TensorParallelRank(0, 3, "ep-test"))


def test_gpt_oss_experts_are_read_with_their_biases_and_stored_layout() -> None:
    torch.manual_seed(0)
    gpt_oss = transformers.GptOssForCausalLM(transformers.GptOssConfig(
        intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, head_dim=8,
        **{**COMMON, "num_hidden_layers": 1}))
    captured = _captured(gpt_oss)
    [block] = find_expert_blocks(captured.graph_module.graph)
    assert (str(block.gate_up_bias.target), str(block.down_bias.target)) == (
        "model.layers.0.mlp.experts.gate_up_proj_bias",
        "model.layers.0.mlp.experts.down_proj_bias")
    assert block.transposed == (False, False)  # [E, H, 2I] handed to the GEMM as stored
    assert any(n.target is torch.ops.aten.sigmoid.default for n in block.act)
    [module], _ = build_stage_modules(captured, split_graph(captured, []), [torch.device("cpu")])
    layouts = expert_parallel(module, TensorParallelRank(1, 2, "ep-test"))
    assert set(layouts) == {f"model.layers.0.mlp.experts.{w}" for w in (
        "gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")}
    whole = dict(gpt_oss.named_parameters())
    for fqn in layouts:
        torch.testing.assert_close(module.get_parameter(fqn), whole[fqn][2:], rtol=0, atol=0)


def test_experts_reading_another_parameter_are_refused_naming_it() -> None:
    model = _mixtral()
    captured = _captured(model)
    graph = captured.graph_module.graph
    [block, _] = find_expert_blocks(graph)
    # scale the first GEMM's output by a stored tensor: not a weight, not a per-expert bias
    captured.graph_module.register_buffer("stray", torch.ones(1))
    with graph.inserting_after(block.first_mm):
        stray = graph.get_attr("stray")
        stray.meta["val"] = torch.ones(1)
        stray.meta["nn_module_stack"] = block.first_mm.meta["nn_module_stack"]
        scaled = graph.call_function(torch.ops.aten.mul.Tensor, (block.first_mm, stray))
        scaled.meta.update(block.first_mm.meta)
    block.first_mm.replace_all_uses_with(scaled)
    scaled.args = (block.first_mm, stray)
    with pytest.raises(PlanError, match=r"stray.*ep=1"):
        find_expert_blocks(graph)


def test_ep_on_a_model_without_readable_experts_is_refused() -> None:
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(intermediate_size=48,
                                                                   **COMMON))
    captured = _captured(llama)
    plan = dataclasses.replace(manual_plan(captured, [], 1, 4), dp=2, ep=2)
    with pytest.raises(PlanError, match=r"no experts module.*ep=1"):
        build_stages(captured, plan, ["cpu"], ep=TensorParallelRank(0, 2, "ep-test"))
