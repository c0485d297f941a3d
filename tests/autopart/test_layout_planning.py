"""Planning the layouts of a torchrun world's CPU ranks (no processes, no timing in a verdict):
the host topology from the measured link, the request, the search on a hand-made cost graph,
the world-size check and the replica's rows of a global batch."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from autopart import CompileOptions, PlanError
from autopart.core.cluster import PRESETS
from autopart.core.signature import replica_share
from autopart.layout_planning import host_ranks_topology, layout_request, model_heads
from autopart.runtime.distributed.mesh import check_world
from autopart.solver import SolveOptions
from autopart.solver.data_parallel import data_parallel_cost
from autopart.solver.layout_search import solve_layout
from tests.solver.test_layout_search import _gpt

# a CPU rank whose link was "measured" at 2 GB/s and 40 µs (fixed figures: no measurement)
CPU = dataclasses.replace(PRESETS["cpu"], link_bandwidth_bytes_per_s=2e9, link_latency_us=40.0,
                          source="cpu preset; link measured between two gloo processes")


def _options(**kw: object) -> SolveOptions:
    return SolveOptions(batch_size=16, max_cpsat_solves=0, max_simulated=1,
                        deterministic_time=0.2, **kw)  # type: ignore[arg-type]


def test_the_host_topology_is_the_measured_link_for_every_group() -> None:
    topo = host_ranks_topology(4, CPU)
    assert (topo.gpus_per_host, topo.collective_efficiency) == (4, 1.0)
    for span in (1, 2, 4, 8):  # tp, dp, and beyond the host: the same measured figures
        assert topo.link(span) == (2e9, 40.0)
    assert "measured between two gloo processes" in topo.source
    assert host_ranks_topology(8, CPU, ranks_per_host=4).gpus_per_host == 4


def test_the_request_fixes_what_was_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    req = layout_request(CompileOptions(dp=2, zero_stage=1), 4, CPU, num_heads=4)
    assert (req.num_gpus, req.tp, req.pp, req.dp, req.zero_stage) == (4, None, None, 2, 1)
    assert req.topology.gpus_per_host == 4
    with pytest.raises(PlanError, match=r"tp=3 must divide the 4 GPUs per host"):
        layout_request(CompileOptions(tp=3), 4, CPU)
    with pytest.raises(PlanError, match=r"tp=4 does not divide the model's 2 attention heads"):
        layout_request(CompileOptions(tp=4), 4, CPU, num_heads=2)
    with pytest.raises(PlanError, match=r"tp x pp x dp = 2 x 1 x 4 = 8, but the cluster has 4"):
        solve_layout(_gpt(4), CPU, _options(),
                     dataclasses.replace(layout_request(CompileOptions(tp=2, dp=4), 4, CPU),
                                         pp=1))


def test_heads_come_from_a_hugging_face_config() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=64,
                                       n_positions=8))
    assert model_heads(model) == 4
    assert model_heads(torch.nn.Linear(2, 2)) is None


def test_a_fixed_dp_gives_its_layout_and_pays_the_measured_link() -> None:
    costs = _gpt(4)
    fast, slow = CPU, dataclasses.replace(CPU, link_bandwidth_bytes_per_s=2e7)
    plans = {}
    for name, spec in (("fast", fast), ("slow", slow)):
        req = layout_request(CompileOptions(dp=2, zero_stage=0), 4, spec)
        plans[name] = solve_layout(costs, spec, _options(schedule_kind="1f1b"), req)
    for plan in plans.values():
        assert (plan.tp, len(plan.ranks), plan.dp, plan.zero_stage) == (1, 2, 2, 0)
        assert plan.batch_size == 16 and plan.num_gpus == 4
    # the dp all-reduce is charged at the link's bandwidth: the same cuts cost more on the
    # slow link by at least the ring all-reduce of the fuller rank's gradients there
    fast_plan, slow_plan = plans["fast"], plans["slow"]
    held = max(sum(slow_plan.stages[s].param_bytes for s in r.stage_indices)
               for r in slow_plan.ranks)
    slow_dp = data_parallel_cost(held, dp=2, zero_stage=0,
                                 bandwidth_bytes_per_s=2e7, latency_us=40.0)
    assert slow_plan.predicted_step_time_us >= slow_dp.step_us(slow_plan.num_microbatches)
    assert slow_plan.predicted_step_time_us > fast_plan.predicted_step_time_us


def test_the_free_search_is_deterministic_and_no_slower_than_pipeline_only() -> None:
    costs = _gpt(4)
    free = layout_request(CompileOptions(zero_stage=0), 4, CPU)
    runs = [solve_layout(costs, CPU, _options(schedule_kind="1f1b"), free) for _ in range(2)]
    dumps = [json.dumps({**p.to_dict(), "solver": None}, sort_keys=True) for p in runs]
    assert dumps[0] == dumps[1]
    pp_only = solve_layout(costs, CPU, _options(schedule_kind="1f1b"),
                           layout_request(CompileOptions(tp=1, dp=1), 4, CPU))
    assert (pp_only.tp, len(pp_only.ranks), pp_only.dp) == (1, 4, 1)
    assert runs[0].predicted_step_time_us <= pp_only.predicted_step_time_us


def test_the_world_must_hold_the_layout() -> None:
    check_world(8, 2, 2, 2)
    with pytest.raises(PlanError, match=r"tp 2 x pp 2 x dp 1 needs 4 ranks but this launch has "
                                        r"8; launch with --nproc-per-node=4"):
        check_world(8, 2, 2, 1)


def test_a_replica_keeps_its_rows_of_the_global_batch() -> None:
    from tests.distributed.mesh_worker import _plan

    plan = _plan(2, 1, 2)  # batch 16 over dp 2
    x, y, scale = torch.arange(16 * 3).reshape(16, 3), torch.arange(16), torch.tensor(2.0)
    args, kwargs, target = replica_share(plan, 1, (x,), {"scale": scale, "mask": x}, y)
    assert torch.equal(args[0], x[8:]) and torch.equal(kwargs["mask"], x[8:])
    assert torch.equal(target, y[8:]) and kwargs["scale"] is scale
    share = (x[:8],)  # already this replica's share: as it is
    assert replica_share(plan, 1, share, {}, y[:8])[0][0] is share[0]
    one = _plan(2, 1, 1)  # a pp-only plan: a replica feeds what the plan was made for
    assert replica_share(one, 1, (x,), {}, y)[0][0] is x
