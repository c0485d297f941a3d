"""Whole models through autopart.compile (capture, profile, solve, split) against the plain model."""

import copy
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

import autopart
import autopart.profiler as autopart_profiler
import autopart.solver as autopart_solver
from autopart.apps.demo import run_demo
from autopart.core.errors import PlanError
from tests.zoo import ZOO, bert, gpt2, mlp, resnet

TOL = {"rtol": 1e-5, "atol": 4e-5}


def _primary(out: Any) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


#: each model at two of the four (stages, m) pairs, the other two on the next model: every
#: model runs 2 and 4 stages and m 1 and 4, and every (stages, m) pair runs on two models
PAIRS = [((2, 1), (4, 4)), ((2, 4), (4, 1))]
CASES = [(build, *PAIRS[i % 2][k]) for i, build in enumerate((gpt2, bert, resnet, mlp))
         for k in range(2)]


@pytest.mark.parametrize(("build", "num_stages", "m"), CASES,
                         ids=[f"{b.__name__}-{s}-{m}" for b, s, m in CASES])
def test_outputs_loss_and_every_gradient_match(build: Any, num_stages: int, m: int) -> None:
    model, args, target, loss_fn = build()
    reference = copy.deepcopy(model)
    pipe = autopart.compile(model, args, loss_fn=loss_fn, num_stages=num_stages,
                            num_microbatches=m, time_limit_s=5.0)
    assert pipe.plan.num_stages == num_stages and pipe.plan.num_microbatches == m
    assert pipe.plan.solver.status in ("OPTIMAL", "FEASIBLE", "HINT")  # HINT: 5 s ran out first
    torch.testing.assert_close(_primary(pipe(*args)), _primary(reference(*args)), **TOL)
    loss = pipe.train_step(*args, target=target)
    ref_loss = loss_fn(reference(*args), target)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
    ref_params = dict(reference.named_parameters())
    checked = 0
    for name, p in pipe.named_parameters():
        ref_grad = ref_params[name].grad
        if ref_grad is None:
            assert p.grad is None, name
            continue
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, ref_grad, **TOL, msg=name)
        checked += 1
    assert checked >= len(ref_params) - 2  # BERT's unused pooler is the only exception


def test_replaying_a_saved_plan_gives_the_same_split_without_solving(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, args, target, loss_fn = ZOO["gpt2"]()
    pipe = autopart.compile(model, args, loss_fn=loss_fn, num_stages=3, time_limit_s=5.0)
    path = tmp_path / "gpt2.plan.json"
    pipe.plan.save(path)
    loaded = autopart.Plan.load(path)
    assert loaded == pipe.plan

    def no_solving(*_: Any, **__: Any) -> None:
        raise AssertionError("replay must not call the solver")

    monkeypatch.setattr(autopart_solver, "solve", no_solving)
    monkeypatch.setattr(autopart_profiler, "profile_graph", no_solving)
    replay = autopart.compile(model, args, loss_fn=loss_fn, plan=str(path))
    assert [s.graph.nodes.__len__() for s in replay.stages] == \
           [s.graph.nodes.__len__() for s in pipe.stages]
    assert [str(s.code) for s in replay.stages] == [str(s.code) for s in pipe.stages]
    torch.testing.assert_close(replay.train_step(*args, target=target),
                               pipe.train_step(*args, target=target), **TOL)


def test_solver_chooses_the_microbatch_count_when_not_given() -> None:
    model, args, target, loss_fn = mlp()
    pipe = autopart.compile(model, args, loss_fn=loss_fn, num_stages=2, time_limit_s=5.0)
    assert 8 % pipe.plan.num_microbatches == 0
    assert pipe.timings_s.keys() >= {"capture_s", "profile_s", "solve_s", "codegen_s"}


def test_demo_on_a_small_gpt2_matches_and_writes_its_files(tmp_path: Path) -> None:
    losses = run_demo(tmp_path, n_layer=2, n_embd=64, n_head=4, vocab_size=512, batch_size=4,
                      seq_len=16, num_stages=2, steps=2)
    assert len(losses) == 2
    for ours, theirs in losses:
        assert ours == pytest.approx(theirs, rel=1e-5, abs=4e-5)
    assert (tmp_path / "gpt2.plan.json").exists()
    assert (tmp_path / "stage_0.py").exists() and (tmp_path / "stage_1.py").exists()


def test_a_plan_for_another_model_is_refused_naming_what_differs(tmp_path: Path) -> None:
    model, args, target, loss_fn = mlp()
    pipe = autopart.compile(model, args, loss_fn=loss_fn, num_stages=2, num_microbatches=2,
                            time_limit_s=5.0)
    wider = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.GELU(), torch.nn.Linear(48, 4))
    with pytest.raises(PlanError, match=r"the plan was made for graph .* a different model"):
        autopart.compile(wider, args, loss_fn=loss_fn, plan=pipe.plan)
    # same graph, but a cut that names nodes the model does not have there
    cut = pipe.plan.cuts[0]
    moved = dataclasses.replace(cut, after_node="no_such_node")
    edited = dataclasses.replace(pipe.plan, cuts=(moved, *pipe.plan.cuts[1:]))
    with pytest.raises(PlanError, match=rf"plan cut at position {cut.position} expects nodes "
                                        r"'no_such_node'"):
        autopart.compile(model, args, loss_fn=loss_fn, plan=edited)
