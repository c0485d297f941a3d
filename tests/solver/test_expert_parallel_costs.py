"""Expert parallelism's costs on one GPU, by hand on a tiny Mixtral's analytical profile."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from autopart.core.capture import capture  # noqa: E402
from autopart.core.cluster import PRESETS  # noqa: E402
from autopart.profiler import profile_analytical  # noqa: E402
from autopart.solver.collectives import all_to_all_us  # noqa: E402
from autopart.solver.expert_parallel_costs import expert_costs, expert_module_paths  # noqa: E402
from tests.distributed.ep_worker import tiny_moe  # noqa: E402

BW, LAT = 100e9, 5.0


def _costs(name: str = "mixtral"):
    model, args, _, _ = tiny_moe(name)
    return profile_analytical(capture(model, (args[0][:2],)), None, PRESETS["a100-80gb"])


def test_each_gpu_holds_its_experts_and_pays_two_all_to_alls_each_way() -> None:
    costs = _costs()
    paths = expert_module_paths(costs)
    assert paths == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    out = expert_costs(costs, 2, bandwidth_bytes_per_s=BW, latency_us=LAT)
    experts = {p for p in costs.param_sizes if ".experts." in p}
    assert len(experts) == 4
    for fqn in costs.param_sizes:
        want = costs.param_sizes[fqn] // 2 if fqn in experts else costs.param_sizes[fqn]
        assert out.param_sizes[fqn] == want
        assert out.param_numel[fqn] == costs.param_numel[fqn] // (2 if fqn in experts else 1)
    # rows: 2 x 8 tokens x top-2 pairs of hidden 32 in float32
    rows = 2 * 8 * 2 * 32 * 4
    one = all_to_all_us(rows, 2, BW, LAT)
    assert one == pytest.approx(rows / 2 / BW * 1e6 + LAT)
    changed = [(a, b) for a, b in zip(costs.nodes, out.nodes, strict=True) if a != b]
    lasts = [b for a, b in changed if b.fwd_us != a.fwd_us]
    assert len(lasts) == 2  # one per MoE layer: its last node carries the all-to-alls
    for a, b in changed:
        if b.fwd_us != a.fwd_us:
            assert b.fwd_us - a.fwd_us == pytest.approx(2 * one + LAT)  # + the counts' exchange
            assert b.bwd_input_us - a.bwd_input_us == pytest.approx(2 * one)
    assert sum(nd.param_bytes for nd in out.nodes) < sum(nd.param_bytes for nd in costs.nodes)
    for a, b in zip(costs.nodes, out.nodes, strict=True):  # compute as under balanced routing
        assert b.flops == a.flops


def test_ep_1_and_dense_models_are_unchanged() -> None:
    costs = _costs()
    assert expert_costs(costs, 1, bandwidth_bytes_per_s=BW, latency_us=LAT) is costs
    from tests.distributed.tp_worker import tiny

    model, args, _, _ = tiny("llama")
    dense = profile_analytical(capture(model, (args[0][:2],)), None, PRESETS["a100-80gb"])
    assert expert_costs(dense, 4, bandwidth_bytes_per_s=BW, latency_us=LAT) is dense
