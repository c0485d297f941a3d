"""CPU planning fills the ranks per core, and the layout search charges it (hand-made costs,
fixed degrees and m; no processes, no timing in a verdict)."""

from __future__ import annotations

import dataclasses

import pytest

from autopart import CompileOptions, PlanError
from autopart.core.runtime_model import RuntimeDescription
from autopart.layout_planning import layout_request
from autopart.planning import cpu_ranks_per_core
from autopart.solver.collectives import all_reduce_us
from autopart.solver.layout_predict import predict_layout
from autopart.solver.layout_search import solve_layout
from tests.autopart.test_layout_planning import CPU, _options
from tests.solver.test_layout_search import _gpt


def test_ranks_per_core_is_ranks_over_cores_never_below_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert cpu_ranks_per_core(4, cores=2) == 2.0
    assert cpu_ranks_per_core(3, cores=2) == 1.5
    assert cpu_ranks_per_core(2, cores=2) == 1.0
    assert cpu_ranks_per_core(2, cores=16) == 1.0  # a core each: nothing shared
    # 8 ranks over two torchrun hosts of 4: the ranks of one host share its cores
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert cpu_ranks_per_core(8, cores=2) == 2.0
    assert cpu_ranks_per_core(4, cores=None) >= 1.0  # this process's affinity
    with pytest.raises(PlanError, match="0 ranks on 2 cores"):
        cpu_ranks_per_core(0, cores=2)


def _shared(ranks_per_core: float) -> RuntimeDescription:
    # CPU ranks: gloo's collectives run on their cores (as autopart.planning describes them)
    return RuntimeDescription(name="distributed", issue_threads=None,
                              ranks_per_core=ranks_per_core, collectives_share_compute=True)


@pytest.mark.parametrize("fixed", [{"dp": 2, "zero_stage": 0}, {"tp": 2, "dp": 1}])
def test_the_layout_search_prices_four_ranks_on_two_cores(fixed: dict[str, int]) -> None:
    costs = _gpt(4)
    req = layout_request(CompileOptions(**fixed), 4, CPU)  # type: ignore[arg-type]
    own = solve_layout(costs, CPU, _options(schedule_kind="1f1b", num_microbatches=4,
                                            runtime=_shared(1.0)), req)
    shared = solve_layout(costs, CPU, _options(schedule_kind="1f1b", num_microbatches=4,
                                               runtime=_shared(2.0)), req)
    for plan in (own, shared):
        assert (plan.tp, len(plan.ranks), plan.dp) == (fixed["tp"] if "tp" in fixed else 1,
                                                     2, fixed["dp"])
    # no step shorter than the 4 ranks' work on 2 cores: 2 x the pipeline ranks' mean busy
    # (m x (F + B + sends) of each rank's stages), below a core each's by construction
    m = shared.num_microbatches
    busy = [m * sum(shared.stages[s].predicted_fwd_us + shared.stages[s].predicted_bwd_us
                    for s in r.stage_indices) for r in shared.ranks]
    assert shared.predicted_step_time_us >= 2.0 * sum(busy) / len(busy)
    assert shared.predicted_step_time_us > own.predicted_step_time_us


def test_ranks_with_a_core_each_plan_as_before() -> None:
    costs = _gpt(4)
    req = layout_request(CompileOptions(dp=2, zero_stage=0), 4, CPU)
    base = solve_layout(costs, CPU, _options(schedule_kind="1f1b", num_microbatches=4), req)
    for rpc in (1.0, 0.5):
        again = solve_layout(costs, CPU, _options(
            schedule_kind="1f1b", num_microbatches=4,
            runtime=dataclasses.replace(RuntimeDescription(), ranks_per_core=rpc)), req)
        assert again.predicted_step_time_us == base.predicted_step_time_us
        assert [c.position for c in again.cuts] == [c.position for c in base.cuts]


def test_the_dp_collectives_run_on_the_shared_cores_too() -> None:
    # a slow link (2 MB/s) makes the dp all-reduce the larger part of the step: on 4 ranks
    # sharing 2 cores every rank reduces at once, so it costs twice the ring's time
    slow = dataclasses.replace(CPU, link_bandwidth_bytes_per_s=2e6)
    costs = _gpt(4)
    req = layout_request(CompileOptions(dp=2, zero_stage=0), 4, slow)
    plan = solve_layout(costs, slow, _options(schedule_kind="1f1b", num_microbatches=4,
                                              runtime=_shared(2.0)), req)
    held = max(sum(plan.stages[s].param_bytes for s in r.stage_indices) for r in plan.ranks)
    ring = all_reduce_us(held, 2, 2e6, 40.0)  # ZeRO-0: the gradients' ring all-reduce
    busy = [4 * sum(plan.stages[s].predicted_fwd_us + plan.stages[s].predicted_bwd_us
                    for s in r.stage_indices) for r in plan.ranks]
    assert ring > sum(busy)  # the collective dominates: the check below is not vacuous
    assert plan.predicted_step_time_us >= 2.0 * sum(busy) / len(busy) + 2.0 * ring


@pytest.mark.parametrize("fixed", [{"dp": 2, "zero_stage": 0}, {"tp": 2, "dp": 1},
                                   {"tp": 1, "dp": 1}])
@pytest.mark.parametrize("rpc", [1.0, 2.0])
def test_a_plan_priced_at_its_own_cuts_is_what_the_search_predicted(
        fixed: dict[str, int], rpc: float) -> None:
    costs = _gpt(4)
    req = layout_request(CompileOptions(**fixed), 4, CPU)  # type: ignore[arg-type]
    opts = _options(schedule_kind="1f1b", num_microbatches=4, runtime=_shared(rpc))
    plan = solve_layout(costs, CPU, opts, req)
    assert predict_layout(plan, costs, CPU, opts, req) == pytest.approx(
        plan.predicted_step_time_us, abs=1e-2)
    # the core-each plan priced on shared cores: no faster than 2 x its ranks' mean busy
    own_opts = _options(schedule_kind="1f1b", num_microbatches=4, runtime=_shared(1.0))
    own = solve_layout(costs, CPU, own_opts, req)
    on_shared = predict_layout(own, costs, CPU, _options(
        schedule_kind="1f1b", num_microbatches=4, runtime=_shared(2.0)), req)
    busy = [4 * sum(own.stages[s].predicted_fwd_us + own.stages[s].predicted_bwd_us
                    for s in r.stage_indices) for r in own.ranks]
    assert on_shared >= 2.0 * sum(busy) / len(busy)
    assert on_shared >= own.predicted_step_time_us
    with pytest.raises(PlanError, match="is not the layout's 8 GPUs"):
        predict_layout(plan, costs, CPU, opts, dataclasses.replace(req, num_gpus=8))
