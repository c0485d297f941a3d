"""Exposed communication per pipeline rank as the layout search prices it
(:func:`autopart.solver.layout_predict.predict_layout_comm`), on hand-made costs."""

from __future__ import annotations

import dataclasses

import pytest

from autopart import CompileOptions
from autopart.core.runtime_model import RuntimeDescription
from autopart.layout_planning import layout_request
from autopart.solver.layout_dp import dp_exposed_us
from autopart.solver.layout_predict import predict_layout, predict_layout_comm
from autopart.solver.layout_search import solve_layout
from tests.autopart.test_layout_planning import CPU, _options
from tests.solver.test_layout_search import _gpt


def _cpu(ranks_per_core: float) -> RuntimeDescription:
    return RuntimeDescription(name="distributed", issue_threads=None,
                              ranks_per_core=ranks_per_core, collectives_share_compute=True)


@pytest.mark.parametrize("fixed", [{"dp": 2, "zero_stage": 0}, {"dp": 2, "zero_stage": 1},
                                   {"dp": 2, "zero_stage": 3}, {"tp": 2, "dp": 1}])
def test_exposed_communication_per_rank_is_what_the_step_pays(fixed: dict[str, int]) -> None:
    # pp 2 of 4 CPU ranks on 2 cores: the step is the pipeline's plus the fullest rank's dp
    # collectives, so the largest exposed figure is what the step pays beyond the pipeline
    # (but for an overlapped all-reduce, whose tail alone is waited for); each rank's
    # figure is the dp collectives of its own parameters (no tied ones here)
    costs = _gpt(4)
    req = layout_request(CompileOptions(**fixed), 4, CPU)  # type: ignore[arg-type]
    opts = _options(schedule_kind="1f1b", num_microbatches=4, runtime=_cpu(2.0))
    plan = solve_layout(costs, CPU, opts, req)
    pred = predict_layout_comm(plan, costs, CPU, opts, req)
    assert pred.step_us == predict_layout(plan, costs, CPU, opts, req)
    assert pred.step_us == pytest.approx(plan.predicted_step_time_us, abs=1e-2)
    assert len(pred.exposed_comm_us) == len(plan.ranks) == 2
    assert pred.tied_sync_us == 0.0 and pred.exposed_comm_us == pred.dp_exposed_us
    if plan.dp == 1:
        assert pred.exposed_comm_us == (0.0, 0.0)
        return
    layout = dataclasses.replace(req, overlap_grad_reduce=plan.overlap_grad_reduce,
                                 zero_layer_units=plan.zero_layer_units)
    # as the search prices them (tp 1: the units are the whole graph's layers)
    charged = dp_exposed_us(pred.plan, layout, opts.runtime, costs)
    if plan.overlap_grad_reduce:
        # the step charges the overlapped all-reduce whole (it slows the compute beside it
        # on CPU ranks); the rank waits for the buckets' tail only
        tail = dp_exposed_us(pred.plan, layout, dataclasses.replace(
            opts.runtime, collectives_share_compute=False), costs)
        assert pred.dp_exposed_us == tail and max(tail) < max(charged)
        return
    assert pred.dp_exposed_us == charged and min(charged) > 0
    params = [sum(plan.stages[s].param_bytes for s in r.stage_indices) for r in plan.ranks]
    fuller = max(range(2), key=params.__getitem__)
    assert pred.exposed_comm_us[fuller] == max(pred.exposed_comm_us)
    # the same plan on a core each: its collectives no longer wait for a core
    own = predict_layout_comm(plan, costs, CPU, dataclasses.replace(opts, runtime=_cpu(1.0)),
                              req)
    assert own.exposed_comm_us == pytest.approx(tuple(x / 2 for x in pred.exposed_comm_us))
