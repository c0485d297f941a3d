"""Stages of the one-process runtime that name one device share it: planning fills
``RuntimeDescription.ranks_per_core`` with the ranks per device, and the plan's step is no
shorter than their summed work (a small MLP, m fixed; no timing in a verdict)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from autopart.planning import profile_model, ranks_per_device
from autopart.runtime.description import describe


def test_ranks_per_device_counts_the_local_runtimes_ranks_on_each_device() -> None:
    local = describe("local")
    assert ranks_per_device(["cuda:0"] * 4, local) == 4.0
    assert ranks_per_device(["cuda:0", "cuda:1"], local) == 1.0
    assert ranks_per_device(["cuda", "cuda:0", "cuda:1", "cuda:1"], local) == 2.0
    assert ranks_per_device(["cpu", "cpu"], local) == 2.0
    assert ranks_per_device(["cpu", "cpu", "cpu"], local) == 3.0
    # a process per rank: each computes on cores of its own (cpu_ranks_per_core's concern)
    assert ranks_per_device(["cpu"] * 4, describe("distributed")) == 1.0
    assert ranks_per_device(["cuda:0"], local) == 1.0


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(nn.Linear(64, 64) for _ in range(6)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x).relu()


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_local_stages_on_one_device_are_priced_at_their_summed_work(kind: str) -> None:
    torch.manual_seed(0)
    x = torch.randn(16, 64)
    profile = profile_model(_Mlp(), (x,), devices=["cpu", "cpu"], num_microbatches=4,
                            cache=False)
    assert profile.runtime.ranks_per_core == 2.0
    plan = profile.solve(schedule_kind=kind, stages_per_rank=1)
    work = plan.num_microbatches * sum(s.predicted_fwd_us + s.predicted_bwd_us
                                       for s in plan.stages)
    assert plan.predicted_step_time_us >= work * (1 - 1e-9)
    # the same costs with a device per rank overlap the stages: a shorter step
    own = profile.solve(schedule_kind=kind, stages_per_rank=1,
                        runtime=dataclasses.replace(profile.runtime, ranks_per_core=1.0))
    assert own.predicted_step_time_us < plan.predicted_step_time_us


def test_the_prediction_gives_the_shared_devices_peak() -> None:
    from autopart.trace import predict

    torch.manual_seed(0)
    x = torch.randn(16, 64)
    profile = profile_model(_Mlp(), (x,), devices=["cpu", "cpu", "cpu"], num_microbatches=4,
                            cache=False)
    plan = profile.solve(schedule_kind="1f1b", stages_per_rank=1)
    pred = predict(profile, plan)
    assert set(pred.device_peak_bytes) == {"cpu"}
    assert (max(pred.peak_memory_bytes) <= pred.device_peak_bytes["cpu"]
            <= sum(pred.peak_memory_bytes))
    assert pred.trace.metadata["device_peak_bytes"] == pred.device_peak_bytes


def test_a_microbatch_count_the_profile_did_not_price_is_refused() -> None:
    from autopart import PlanError

    torch.manual_seed(0)
    x = torch.randn(16, 64)
    profile = profile_model(_Mlp(), (x,), devices=["cpu", "cpu"], cache=False)
    assert 16 not in profile.microbatch_candidates  # 1 row each: not timed
    with pytest.raises(PlanError, match=r"num_microbatches=16 is not one this profile priced"):
        profile.solve(schedule_kind="1f1b", num_microbatches=16)
    assert profile.solve(schedule_kind="1f1b", num_microbatches=8).num_microbatches == 8


def test_plan_model_prices_cuda_graphs_when_asked() -> None:
    from autopart.planning import plan_model

    torch.manual_seed(0)
    x = torch.randn(16, 64)
    _, eager = plan_model(_Mlp(), (x,), devices=["cpu", "cpu"], num_microbatches=4, cache=False)
    _, graphs = plan_model(_Mlp(), (x,), devices=["cpu", "cpu"], num_microbatches=4,
                           cache=False, cuda_graphs=True)
    assert (eager.runtime.cuda_graphs, graphs.runtime.cuda_graphs) == (False, True)
    _, dist = plan_model(_Mlp(), (x,), devices=["cpu", "cpu"], num_microbatches=4,
                         cache=False, cuda_graphs=True, backend="distributed")
    assert not dist.runtime.cuda_graphs  # the distributed runtime does not graph
