"""compile() refuses, with a PlanError that names the argument, every choice a replayed plan or
a backend cannot honour; CompileOptions checks every value in one place."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

import autopart
from autopart import CompileOptions, PlanError
from autopart.core.capture import capture
from autopart.core.signature import InputSignature
from tests.plans import even_positions, manual_plan
from tests.zoo import mlp


@pytest.fixture(scope="module")
def replay() -> tuple[Any, ...]:
    model, args, target, loss_fn = mlp()  # batch 8
    captured = capture(model, (args[0][:4],))
    plan = manual_plan(captured, even_positions(captured, 2), 2, 8, schedule_kind="1f1b")
    return model, args, loss_fn, plan


@pytest.mark.parametrize(("given", "match"), [
    ({"num_stages": 3}, r"num_stages=3 conflicts with the replayed plan, which has num_stages=2"),
    ({"num_microbatches": 4},
     r"num_microbatches=4 conflicts with the replayed plan, which has num_microbatches=2"),
    ({"schedule_kind": "gpipe"},
     r"schedule_kind='gpipe' conflicts .* which has schedule_kind='1f1b'"),
    ({"schedule": "gpipe"}, r"schedule_kind='gpipe' conflicts"),  # the older name, same check
    ({"stages_per_rank": 2, "schedule_kind": "interleaved_1f1b"},
     r"conflicts with the replayed plan"),
    ({"optimize": "memory"}, r"optimize='memory' conflicts .* which has optimize='speed'"),
    ({"recompute": True}, r"recompute=True conflicts .* which has recompute=False"),
    ({"devices": ["cpu"] * 3}, r"the plan has 2 ranks but 3 devices were given"),
])
def test_a_replayed_plan_refuses_conflicting_choices(replay: tuple[Any, ...],
                                                    given: dict[str, Any], match: str) -> None:
    model, args, loss_fn, plan = replay
    with pytest.raises(PlanError, match=match) as info:
        autopart.compile(model, args, loss_fn=loss_fn, plan=plan, **given)
    if "devices" not in given:
        assert "drop" in str(info.value)  # the fix


def test_a_replayed_plan_accepts_the_choices_it_already_has(replay: tuple[Any, ...]) -> None:
    model, args, loss_fn, plan = replay
    pipe = autopart.compile(model, args, loss_fn=loss_fn, plan=plan, num_stages=2,
                            num_microbatches=2, schedule="1f1b", stages_per_rank=1,
                            optimize="speed", recompute=False, devices=["cpu", "cpu"])
    assert isinstance(pipe, autopart.Pipeline)
    assert pipe.plan == plan


@pytest.mark.parametrize(("given", "match"), [
    ({"checkpoint": "ckpt/"}, r"checkpoint= is for backend='distributed'.*Drop it"),
    ({"mesh": object()}, r"mesh= is for backend='distributed'"),
])
def test_the_local_backend_refuses_distributed_only_arguments(
        replay: tuple[Any, ...], given: dict[str, Any], match: str) -> None:
    model, args, loss_fn, plan = replay
    with pytest.raises(PlanError, match=match):
        autopart.compile(model, args, loss_fn=loss_fn, plan=plan, backend="local", **given)


def test_the_distributed_backend_refuses_devices_and_needs_a_process_group(
        replay: tuple[Any, ...]) -> None:
    model, args, loss_fn, plan = replay
    with pytest.raises(PlanError, match=r"devices=\['cuda:0', 'cuda:1'\] cannot be honoured "
                                        r"with backend='distributed'.*Drop devices="):
        autopart.compile(model, args, loss_fn=loss_fn, plan=plan, backend="distributed",
                         devices=["cuda:0", "cuda:1"])
    with pytest.raises(PlanError, match="needs an initialised process group"):
        autopart.compile(model, args, loss_fn=loss_fn, plan=plan, backend="distributed")


@pytest.mark.parametrize(("given", "match"), [
    ({"num_stages": 0}, r"num_stages=0 must be an integer >= 1"),
    ({"num_microbatches": 2.5}, r"num_microbatches=2.5 must be an integer >= 1"),
    ({"num_microbatches": True}, r"num_microbatches=True must be an integer >= 1"),
    ({"stages_per_rank": -1}, r"stages_per_rank=-1 must be an integer >= 1"),
    ({"optimize": "fast"}, r"optimize='fast'; expected one of \('speed', 'memory'\)"),
    ({"schedule_kind": "pipedream"}, r"schedule_kind='pipedream'; expected one of"),
    ({"stages_per_rank": 2, "schedule_kind": "1f1b"}, r"stages_per_rank=2 needs schedule_kind="),
    ({"recompute": "yes"}, r"recompute='yes' must be True, False or None"),
    ({"backend": "mpi"}, r"backend='mpi'; expected one of \('local', 'distributed'\)"),
    ({"devices": ()}, r"devices is empty"),
    ({"time_limit_s": 0}, r"time_limit_s=0 must be a number of seconds > 0"),
])
def test_compile_options_check_every_value(given: dict[str, Any], match: str) -> None:
    with pytest.raises(PlanError, match=match):
        CompileOptions(**given)
    model, args, _, loss_fn = mlp()
    with pytest.raises(PlanError, match=match):
        autopart.compile(model, args, loss_fn=loss_fn, **given)


def test_unknown_and_doubled_arguments_are_refused() -> None:
    model, args, _, loss_fn = mlp()
    with pytest.raises(PlanError, match="pass schedule_kind= only"):
        autopart.compile(model, args, loss_fn=loss_fn, schedule="1f1b", schedule_kind="1f1b")
    with pytest.raises(PlanError, match="unknown argument.*fields of autopart.CompileOptions"):
        autopart.compile(model, args, loss_fn=loss_fn, chunks=4)
    with pytest.raises(PlanError, match=r"either as options= or as keywords, not both"):
        autopart.compile(model, args, loss_fn=loss_fn, options=CompileOptions(), num_stages=2)
    assert dataclasses.is_dataclass(CompileOptions)


def test_both_runtimes_share_one_input_signature(replay: tuple[Any, ...]) -> None:
    model, args, loss_fn, plan = replay
    pipe = autopart.compile(model, args, loss_fn=loss_fn, plan=plan)
    sig = pipe.signature
    assert isinstance(sig, InputSignature) and sig.microbatch_size == 4
    with pytest.raises(PlanError, match=r"batch of 6 is not a multiple of the microbatch size 4"):
        pipe(torch.randn(6, 32))
    with pytest.raises(PlanError, match=r"inputs have structure"):
        pipe(torch.randn(8, 32), torch.randn(8, 32))
    with pytest.raises(PlanError, match=r"no tensor input with a batch dimension"):
        sig.num_microbatches([3])  # what the distributed runtime raised StopIteration for
    inference = autopart.compile(model, args, plan=plan)
    with pytest.raises(PlanError, match=r"train_step needs a loss: pass loss_fn="):
        inference.train_step(*args)


class _ReturnsNothing(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> None:
        self.lin(x)


def test_one_clear_error_for_each_careless_call(replay: tuple[Any, ...]) -> None:
    with pytest.raises(autopart.TraceError, match=r"_ReturnsNothing.forward returns no tensor"):
        autopart.compile(_ReturnsNothing(), (torch.randn(8, 4),), num_stages=2)
    model, args, loss_fn, plan = replay

    def indexes_target(out: torch.Tensor, target: Any) -> torch.Tensor:
        return torch.nn.functional.mse_loss(out, target[:, :4])  # target=None: TypeError

    pipe = autopart.compile(model, args, loss_fn=indexes_target, plan=plan)
    with pytest.raises(PlanError, match=r"loss_fn failed with target=None \(TypeError.*pass "
                                        r"the target to train_step"):
        pipe.train_step(*args)
    per_row = autopart.compile(model, args, plan=plan,
                               loss_fn=lambda out, target: ((out - target) ** 2).mean(dim=1))
    with pytest.raises(PlanError, match=r"loss_fn returned a tensor of shape \(4,\).*must return "
                                        r"a scalar .*loss.mean\(\)"):
        per_row.train_step(*args, target=torch.randn(8, 4))
    with pytest.raises(PlanError, match=r"loss_fn returned str"):
        autopart.compile(model, args, plan=plan,
                         loss_fn=lambda out, target: "loss").train_step(*args, target=args[0])
    with pytest.raises(PlanError, match=r"step_timeout_s= is for backend='distributed'"):
        autopart.compile(model, args, loss_fn=loss_fn, plan=plan, step_timeout_s=30)
    with pytest.raises(PlanError, match=r"step_timeout_s=0 must be a number of seconds > 0"):
        CompileOptions(step_timeout_s=0)


def test_the_optimizer_sets_the_state_bytes_the_plan_counts() -> None:
    from autopart.options import optimizer_state_factor

    assert optimizer_state_factor("adamw", 400, 100) == 2.0  # 2 tensors like the parameter
    assert optimizer_state_factor("SGD", 400, 100) == 1.0
    assert optimizer_state_factor(12.0, 200, 100) == 6.0  # bf16 weights, fp32 state + master
    assert optimizer_state_factor(0.0, 400, 100) == 0.0
    for bad, match in (("lion", r"optimizer='lion'; expected one of \['adam', 'adamw', 'sgd'\]"),
                       (-1.0, r"optimizer=-1.0 must be a name"), (True, "optimizer=True")):
        with pytest.raises(PlanError, match=match):
            CompileOptions(optimizer=bad)


def test_a_plan_for_sgd_needs_less_memory_than_for_adamw() -> None:
    model, args, _, loss_fn = mlp()
    peaks = {}
    for optimizer in ("adamw", "sgd", 0.0):
        pipe = autopart.compile(model, args, loss_fn=loss_fn, num_stages=2, num_microbatches=2,
                                schedule="1f1b", optimizer=optimizer, time_limit_s=5.0)
        peaks[optimizer] = sum(r.peak_memory_bytes for r in pipe.plan.ranks)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    # the whole model's state: 2x, 1x, 0x its parameter bytes, split over the two ranks (the
    # sum over ranks: which rank peaks highest may change with the cuts)
    assert peaks["adamw"] > peaks["sgd"] > peaks[0.0]
    assert peaks["adamw"] - peaks[0.0] >= params
