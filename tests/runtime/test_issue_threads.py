"""A worker thread per rank (issue 32): same numerics as one thread, no hang when a stage fails."""

from __future__ import annotations

import copy
import threading
from typing import Any

import pytest
import torch
from torch import nn

from autopart.core.capture import capture
from autopart.core.errors import PlanError
from autopart.core.schedule import Action, build_schedule, from_csv
from autopart.runtime.local.executor import LocalExecutor
from autopart.runtime.local.issue_threads import thread_orders
from tests.numerics import assert_train_step_matches
from tests.plans import even_positions, local_pipeline, manual_plan
from tests.zoo import gpt2, mlp

# (model, schedule kind, total stages, stages per rank, recompute): GPT-2 where the split
# backward and recompute meet attention, the MLP (cheaper) for the rest of the kinds
LAYOUTS = [("gpt2", "1f1b", 2, 1, True), ("gpt2", "zero_bubble", 2, 1, False),
           ("mlp", "gpipe", 2, 1, False), ("mlp", "1f1b", 2, 1, False),
           ("mlp", "zero_bubble", 2, 1, False), ("mlp", "interleaved_1f1b", 4, 2, False),
           ("mlp", "zbv", 4, 2, False), ("mlp", "dualpipev", 4, 2, True)]
MODELS = {"gpt2": gpt2, "mlp": mlp}


def _pipe(build: Any, kind: str, num_stages: int, v: int, recompute: bool = False,
          m: int = 4, issue_threads: int | None = None) -> tuple[Any, ...]:
    model, args, target, loss_fn = build()
    captured = capture(model, tuple(a[: 8 // m] for a in args))
    reference = copy.deepcopy(model)
    plan = manual_plan(captured, even_positions(captured, num_stages), m, 8, schedule_kind=kind,
                       stages_per_rank=v, recompute=recompute)
    pipe = local_pipeline(model, captured, plan, ["cpu"] * (num_stages // v), loss_fn=loss_fn)
    pipe.issue_threads = issue_threads
    return pipe, reference, args, target, loss_fn


@pytest.mark.parametrize(("name", "kind", "num_stages", "v", "recompute"), LAYOUTS,
                         ids=[f"{n}-{k}-S{s}-v{v}{'-recompute' if r else ''}"
                              for n, k, s, v, r in LAYOUTS])
def test_a_thread_per_rank_matches_the_plain_model_and_one_thread(
        name: str, kind: str, num_stages: int, v: int, recompute: bool) -> None:
    pipe, reference, args, target, loss_fn = _pipe(MODELS[name], kind, num_stages, v, recompute)
    assert pipe.issue_threads is None
    assert_train_step_matches(pipe, reference, args, target, loss_fn)
    threaded = {n: p.grad.clone() for n, p in pipe.named_parameters()}
    threaded_loss = pipe.train_step(*args, target=target)  # grads accumulate: x2
    pipe.zero_grad(set_to_none=True)
    pipe.issue_threads = 1
    loss = pipe.train_step(*args, target=target)
    # the same kernels on the same values, on CPU with one intra-op thread per worker: any
    # difference is the reduction order inside a kernel, far below the tolerance
    torch.testing.assert_close(threaded_loss, loss, rtol=1e-6, atol=1e-7)
    for fqn, p in pipe.named_parameters():
        torch.testing.assert_close(threaded[fqn], p.grad, rtol=1e-5, atol=1e-6, msg=fqn)
    pipe.issue_threads = None  # pipelined inference (forward actions only) on threads too
    out, ref_out = pipe(*args), reference(*args)
    if name == "gpt2":
        out, ref_out = out.logits, ref_out.logits
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=4e-5)


def test_two_threads_for_four_ranks_match_the_plain_model() -> None:
    """Ranks 0 and 2 on one worker, 1 and 3 on the other: each follows the one global order
    restricted to its ranks, so neither waits on the other in a cycle."""
    pipe, reference, args, target, loss_fn = _pipe(mlp, "1f1b", 4, 1, issue_threads=2)
    assert pipe.issue_threads == 2
    assert_train_step_matches(pipe, reference, args, target, loss_fn)
    pipe.train_step(*args, target=target, trace=True)  # traced from the workers
    schedule = build_schedule("1f1b", 4, 4)
    for rank, acts in enumerate(schedule):  # each rank's slices: its actions, in its order
        slices = sorted((e for e in pipe.last_trace.events if e.rank == rank
                         and e.name not in ("wait", "loss")), key=lambda e: e.start_us)
        assert [e.name for e in slices] == [str(a) for a in acts]


def test_workers_run_under_the_callers_autocast_and_grad_scaler() -> None:
    """torch keeps autocast per thread: the workers take the caller's (bf16 on CPU), so the
    threaded step equals the one-thread step bit for bit in what autocast decides."""
    losses, grads = {}, {}
    for threads in (1, None):
        pipe, _, args, target, _ = _pipe(mlp, "1f1b", 2, 1, issue_threads=threads)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses[threads] = pipe.train_step(*args, target=target, grad_scaler=scaler)
        grads[threads] = {n: p.grad for n, p in pipe.named_parameters()}
        plain_loss = pipe.train_step(*args, target=target)  # no autocast: float32
        assert not torch.equal(plain_loss, losses[threads])  # autocast did change the loss
    torch.testing.assert_close(losses[None], losses[1], rtol=1e-3, atol=1e-3)
    for name, g in grads[1].items():
        torch.testing.assert_close(grads[None][name], g, rtol=2e-2, atol=1e-3, msg=name)


def test_a_rank_per_thread_of_k_follows_rank_modulo_k() -> None:
    schedule = build_schedule("1f1b", 4, 2)
    orders = thread_orders(schedule, 4, 2)
    assert [sorted({a.stage_index for a in acts}) for acts in orders] == [[0, 2], [1, 3]]
    for r, acts in enumerate(schedule):  # each rank's own order is kept
        assert [a for a in orders[r % 2] if a.stage_index == r] == list(acts)
    # hand-worked: 2 ranks, 1F1B, m = 2, one thread per rank is each rank's own list
    two = build_schedule("1f1b", 2, 2)
    assert thread_orders(two, 2, None) == [list(acts) for acts in two]
    assert thread_orders(two, 2, 1) == [[Action(0, "F", 0), Action(0, "F", 1), Action(1, "F", 0),
                                         Action(1, "B", 0), Action(1, "F", 1),
                                         Action(1, "B", 1), Action(0, "B", 0),
                                         Action(0, "B", 1)]]


def test_bad_thread_counts_and_deadlocking_schedules_are_refused() -> None:
    with pytest.raises(PlanError, match="issue_threads=0 must be >= 1"):
        LocalExecutor([nn.Identity()], [torch.device("cpu")], issue_threads=0)
    pipe, *_ = _pipe(mlp, "1f1b", 2, 1)
    with pytest.raises(PlanError, match="issue_threads=-1 must be >= 1"):
        pipe.issue_threads = -1
    executor = LocalExecutor([nn.Identity(), nn.Identity()], [torch.device("cpu")] * 2,
                             issue_threads=None)
    backwards_first = ((Action(0, "B", 0), Action(0, "F", 0)), (Action(1, "F", 0), Action(1, "B", 0)))
    with pytest.raises(PlanError, match="deadlocks"):
        executor.run(backwards_first, [[torch.zeros(1)]], loss_closure=lambda i, o: o[0].sum())


class _Linear(nn.Linear):
    """A stage as codegen builds them: flat outputs, a tuple."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:  # type: ignore[override]
        return (super().forward(x),)


class _Fails(nn.Module):
    """A stage that raises in its forward (or its backward) at microbatch ``at``."""

    def __init__(self, at: int, in_backward: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.at, self.in_backward, self.calls = at, in_backward, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls - 1 == self.at and not self.in_backward:
            raise ValueError(f"stage failed at microbatch {self.at}")
        y = self.lin(x)
        if self.calls - 1 == self.at:
            def boom(grad: torch.Tensor) -> torch.Tensor:
                raise ValueError(f"backward failed at microbatch {self.at}")
            y.register_hook(boom)
        return (y,)


def _run_guarded(executor: LocalExecutor, schedule: Any, m: int) -> BaseException | None:
    """Run a step on a helper thread; a step that hangs fails the test instead of the run."""
    caught: list[BaseException] = []

    def step() -> None:
        try:
            executor.run(schedule, [[torch.randn(2, 4)] for _ in range(m)],
                         loss_closure=lambda i, out: out[0].sum())
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            caught.append(exc)

    t = threading.Thread(target=step, daemon=True)
    t.start()
    t.join(timeout=120)  # a hang guard only: a healthy step takes milliseconds
    assert not t.is_alive(), "the step hung after a stage raised in its worker thread"
    return caught[0] if caught else None


@pytest.mark.parametrize(("failing_stage", "in_backward"), [(0, False), (1, False), (1, True),
                                                            (0, True)])
def test_a_stage_raising_in_its_worker_fails_the_step_on_the_caller(
        failing_stage: int, in_backward: bool) -> None:
    m = 4
    stages: list[nn.Module] = [_Linear(4, 4), _Linear(4, 4)]
    stages[failing_stage] = _Fails(1, in_backward)
    executor = LocalExecutor(stages, [torch.device("cpu")] * 2, issue_threads=None)
    schedule = build_schedule("1f1b", 2, m)
    exc = _run_guarded(executor, schedule, m)
    assert isinstance(exc, ValueError)
    assert "failed at microbatch 1" in str(exc)
    # the workers are free again: the next step runs to the end
    stages[failing_stage].at = -1  # type: ignore[union-attr]
    assert _run_guarded(executor, schedule, m) is None


def test_a_schedule_written_as_text_runs_on_threads() -> None:
    """The executor reads actions: a hand-written schedule runs the same on threads."""
    schedule = from_csv("0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n")
    for threads in (1, None):
        torch.manual_seed(0)
        stages = [_Linear(4, 4), _Linear(4, 4)]
        executor = LocalExecutor(stages, [torch.device("cpu")] * 2, issue_threads=threads)
        torch.manual_seed(1)
        mbs = [[torch.randn(2, 4)] for _ in range(2)]
        result = executor.run(schedule, mbs, loss_closure=lambda i, out: out[0].pow(2).sum())
        grads = [p.grad.clone() for s in stages for p in s.parameters()]
        if threads == 1:
            expected = (result.losses, grads)
        else:
            for a, b in zip(result.losses + grads, expected[0] + expected[1], strict=True):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_compile_passes_the_threads_to_the_pipeline_and_prices_them() -> None:
    import autopart
    from autopart import CompileOptions
    from autopart.runtime.description import describe

    assert describe("local").issue_threads == 1
    assert describe("local", issue_threads=None).issue_threads is None
    with pytest.raises(PlanError, match="issue_threads=0 must be an int >= 1"):
        CompileOptions(issue_threads=0)
    with pytest.raises(PlanError, match="are for backend='local'"):
        CompileOptions(issue_threads=2).check_backend("distributed")
    with pytest.raises(PlanError, match="are for backend='local'"):
        CompileOptions(cuda_graphs=True).check_backend("distributed")
    model, args, target, loss_fn = mlp()
    reference = copy.deepcopy(model)
    _, profile = autopart.plan_model(model, args, loss_fn=loss_fn, devices=["cpu", "cpu"],
                                     num_microbatches=2, schedule_kind="1f1b",
                                     issue_threads=None)
    assert profile.runtime.issue_threads is None  # the solver priced a thread per rank
    pipe = autopart.compile(model, args, loss_fn=loss_fn, devices=["cpu", "cpu"],
                            num_microbatches=2, schedule_kind="1f1b", issue_threads=None)
    assert pipe.issue_threads is None and not pipe.cuda_graphs
    assert_train_step_matches(pipe, reference, args, target, loss_fn)
