"""The tensor-parallel graph pass on one process (no collectives run): shards, shape arguments,
inserted collectives, and the PlanErrors for what it cannot split."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from autopart.codegen import ShardLayout, TensorParallelRank, build_stages  # noqa: E402
from autopart.core.capture import CapturedGraph, capture, op_nodes  # noqa: E402
from autopart.core.cluster import PRESETS  # noqa: E402
from autopart.core.errors import PlanError  # noqa: E402
from autopart.core.plan import Plan, ShardedParameter  # noqa: E402
from autopart.profiler import profile_analytical  # noqa: E402
from autopart.solver.tensor_parallel import find_tensor_parallel  # noqa: E402
from tests.distributed.tp_worker import styles, tiny, tp_plan  # noqa: E402
from tests.plans import manual_plan  # noqa: E402


def _captured(name: str) -> CapturedGraph:
    model, args, _, _ = tiny(name)
    return capture(model, (args[0][:2],))


@pytest.fixture(scope="module")
def gpt2() -> CapturedGraph:
    return _captured("gpt2")


def _with(plan: Plan, table: dict[str, str]) -> Plan:
    return dataclasses.replace(plan, tp=2, sharded_parameters=tuple(
        ShardedParameter(k, v) for k, v in sorted(table.items())))


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
def test_the_solver_shards_what_the_multiprocess_tests_shard(name: str) -> None:
    params = find_tensor_parallel(profile_analytical(_captured(name), None,
                                                     PRESETS["a100-80gb"])).params
    assert params == styles(name)  # BERT: sibling-module pairs


def test_gpt2_shards_the_interleaved_qkv_per_block_and_divides_heads(gpt2: CapturedGraph) -> None:
    built = build_stages(gpt2, tp_plan("gpt2", gpt2, 1, 1, 2), ["cpu"],
                         tp=TensorParallelRank(1, 2, "tp0"))
    stage = built.modules[0]
    assert stage is not None
    full = dict(gpt2.graph_module.named_parameters())
    w = full["transformer.h.0.attn.c_attn.weight"]  # Conv1D: [in, 3 * out], q | k | v
    local = stage.get_parameter("transformer.h.0.attn.c_attn.weight")
    assert torch.equal(local, torch.cat([w[:, 16:32], w[:, 48:64], w[:, 80:96]], 1))
    assert built.shards["transformer.h.0.attn.c_attn.weight"] == ShardLayout(1, (32, 32, 32))
    proj = full["transformer.h.0.attn.c_proj.weight"]  # row-parallel: input features
    assert torch.equal(stage.get_parameter("transformer.h.0.attn.c_proj.weight"), proj[16:])
    wte = full["transformer.wte.weight"]  # vocab-parallel rows, the embedding and the head
    assert torch.equal(stage.get_parameter("transformer.wte.weight"), wte[32:])
    assert stage.get_parameter("transformer.h.0.ln_1.weight").shape == (32,)  # replicated
    assert built.placement.tensors[(0, "transformer.wte.weight")] is \
        stage.get_parameter("transformer.wte.weight")
    src = built.sources()[0]
    assert "torch.ops.aten.split.Tensor(view_2, 16, 2)" in src  # 32 per block over tp 2
    assert "torch.ops.aten.reshape.default(scaled_dot_product_attention, [2, 2, 8, 8])" in src
    assert src.count("torch.ops.autopart.tp_reduce.default(") == 5  # 4 row outputs + wte
    assert "torch.ops.autopart.tp_gather.default(linear_default, 2, 1, 2, 'tp0')" in src
    # the layout reassembles the full tensor from both ranks' shards
    layout = built.shards["transformer.h.0.attn.c_attn.weight"]
    assert torch.equal(layout.full([layout.local(w, r, 2) for r in range(2)]), w)


def test_llama_keeps_its_share_of_the_key_value_heads() -> None:
    captured = _captured("llama")
    built = build_stages(captured, tp_plan("llama", captured, 1, 1, 2), ["cpu"],
                         tp=TensorParallelRank(0, 2, "tp0"))
    stage = built.modules[0]
    assert stage is not None
    assert stage.get_parameter("model.layers.0.self_attn.q_proj.weight").shape == (16, 32)
    assert stage.get_parameter("model.layers.0.self_attn.k_proj.weight").shape == (8, 32)
    assert stage.get_parameter("model.layers.0.mlp.down_proj.weight").shape == (32, 32)
    assert stage.get_parameter("lm_head.weight").shape == (32, 32)
    src = built.sources()[0]
    assert "torch.ops.aten.expand.default(unsqueeze_16, [2, -1, 2, 8, 8])" in src  # kv heads
    assert "torch.ops.aten.reshape.default(clone, [2, 2, 8, 8])" in src  # 2 of 4 heads


def test_a_planned_parameter_read_by_an_unknown_op_names_op_parameter_and_fix(
        gpt2: CapturedGraph) -> None:
    plan = _with(manual_plan(gpt2, [], 1, 2), {"transformer.h.0.ln_1.weight": "column"})
    with pytest.raises(PlanError, match=r"op layer_norm .*transformer\.h\.0\.ln_1\.weight"
                                        r".*tp=1.*--pipeline-only"):
        build_stages(gpt2, plan, ["cpu"], tp=TensorParallelRank(0, 2, "tp0"))


def test_a_cut_inside_a_column_row_pair_is_refused(gpt2: CapturedGraph) -> None:
    names = [n.name for n in op_nodes(gpt2.graph_module.graph)]
    plan = _with(manual_plan(gpt2, [names.index("scaled_dot_product_attention")], 1, 2),
                 styles("gpt2"))
    with pytest.raises(PlanError, match="cut inside a column/row pair"):
        build_stages(gpt2, plan, ["cpu", "cpu"], ranks={0}, tp=TensorParallelRank(0, 2, "t"))


def test_a_tp_plan_needs_a_tp_group_of_its_degree(gpt2: CapturedGraph) -> None:
    plan = tp_plan("gpt2", gpt2, 1, 1, 2)
    with pytest.raises(PlanError, match="tp=2 but none was given"):
        build_stages(gpt2, plan, ["cpu"])
    with pytest.raises(PlanError, match="tp=2 but a group of 4"):
        build_stages(gpt2, plan, ["cpu"], tp=TensorParallelRank(0, 4, "t"))


def test_heads_that_tp_does_not_divide_are_refused() -> None:
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_embd=24, n_head=3, vocab_size=64, n_positions=16, use_cache=False,
        bos_token_id=0, eos_token_id=0))
    captured = capture(model, (torch.randint(0, 64, (2, 8)),))
    plan = _with(manual_plan(captured, [], 1, 2), {
        "transformer.h.0.attn.c_attn.weight": "column",
        "transformer.h.0.attn.c_attn.bias": "column",
        "transformer.h.0.attn.c_proj.weight": "row"})
    with pytest.raises(PlanError, match=r"reshape.*transformer\.h\.0\.attn\.c_attn"):
        build_stages(captured, plan, ["cpu"], tp=TensorParallelRank(0, 2, "t"))
