"""autopart.compile without example inputs: planned at the first step on its batch, one pipeline
per input shape on the same cuts and parameters, numerics equal to the unpartitioned model."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import autopart
import autopart.lazy as lazy
import autopart.profiler.profile_state as profile_state
import autopart.steps.plan_step as plan_step
from autopart.apps.demo import gpt2_loss
from autopart.core.capture import capture
from tests.plans import even_positions, manual_plan
from tests.zoo import _lm_loss

TOL = {"rtol": 1e-5, "atol": 4e-5}  # float32, as tests/e2e/test_models.py


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128,
                                      n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0, use_cache=False, bos_token_id=0,
                                      eos_token_id=0))


def _bert() -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    return BertForMaskedLM(BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                                      intermediate_size=64, vocab_size=128,
                                      max_position_embeddings=32, hidden_dropout_prob=0.0,
                                      attention_probs_dropout_prob=0.0))


def _tokens(step: int, seq: int) -> torch.Tensor:
    """(4, seq) token ids, the same for a step in every run."""
    return torch.randint(0, 128, (4, seq), generator=torch.Generator().manual_seed(step))


def _counting(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> list[int]:
    """Count the calls of ``module.<name>`` (still calling it)."""
    calls: list[int] = []
    real = getattr(module, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def _train_alternating(pipe: Any, reference: nn.Module, loss_fn: Any,
                       seqs: list[int]) -> list[float]:
    """One optimizer (built from ``pipe.parameters()`` before the first step) and one on the
    reference; per step the loss and every gradient must match, then both step."""
    opt = torch.optim.SGD(pipe.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    ref_params = dict(reference.named_parameters())
    losses = []
    for step, seq in enumerate(seqs):
        x = _tokens(step, seq)
        opt.zero_grad()
        ref_opt.zero_grad()
        loss = pipe.train_step(x, target=x)
        ref_loss = loss_fn(reference(x), x)
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
        checked = 0
        for name, p in pipe.named_parameters():
            if ref_params[name].grad is None:  # BERT's unused pooler
                assert p.grad is None, name
                continue
            torch.testing.assert_close(p.grad, ref_params[name].grad, **TOL, msg=name)
            checked += 1
        assert checked >= len(ref_params) - 2
        opt.step()
        ref_opt.step()
        losses.append(float(loss))
    return losses


def test_gpt2_as_written_plans_at_the_first_step_and_trains_two_lengths_in_alternation(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    profiled = _counting(monkeypatch, profile_state, "profile_graph")
    solved = _counting(monkeypatch, plan_step, "plan_model")
    recaptured = _counting(monkeypatch, lazy, "capture")
    model = _gpt2()
    reference = copy.deepcopy(model)
    loss_fn = gpt2_loss
    pipe = autopart.compile(model, loss_fn=loss_fn, optimize="memory", num_stages=2)
    assert isinstance(pipe, autopart.LazyPipeline) and pipe.pipeline is None
    assert (len(profiled), len(solved)) == (0, 0)  # nothing happens before the first step
    # before the first step parameters are the model's own, and the pipeline keeps them
    assert [id(p) for p in pipe.parameters()] == [id(p) for p in model.parameters()]
    losses = _train_alternating(pipe, reference, loss_fn, [8, 16, 8, 16, 16])
    assert all(0 < x < 10 for x in losses)
    assert len(solved) == 1 and len(profiled) >= 1  # planned once, at the first step
    assert len(recaptured) == 1  # the second length captured once, later calls reuse it
    first, second = pipe.pipelines.values()
    assert first.plan is second.plan and pipe.plan.optimize == "memory"
    assert pipe.plan.num_stages == 2
    assert [id(p) for _, p in first.named_parameters()] == \
        [id(p) for _, p in second.named_parameters()] == [id(p) for p in model.parameters()]
    out = capsys.readouterr().out
    assert out.count("autopart: planned at the first train_step on inputs (4, 8):") == 1
    assert f"2 ranks, 2 stages, m={pipe.plan.num_microbatches}" in out
    assert "cut 1: " in out and "predicted peak rank 0" in out
    assert out.count("; recompute ") == 2  # one line per stage
    assert out.count("new input shape (4, 16)") == 1
    # forward at a seen and an unseen length, same as the (trained) reference
    for seq in (16, 12):
        x = _tokens(9, seq)
        torch.testing.assert_close(pipe(x).logits, reference(x).logits, **TOL)
    assert len(recaptured) == 2 and len(solved) == 1


def test_bert_on_a_replayed_plan_trains_two_lengths_in_alternation(
        monkeypatch: pytest.MonkeyPatch) -> None:
    profiled = _counting(monkeypatch, profile_state, "profile_graph")
    model = _bert()
    reference = copy.deepcopy(model)
    captured = capture(model, (_tokens(0, 16)[:2],), {})  # the microbatch: 4 rows / m=2
    plan = manual_plan(captured, even_positions(captured, 2), 2, 4, schedule_kind="1f1b")
    pipe = autopart.compile(model, loss_fn=_lm_loss, plan=plan)
    _train_alternating(pipe, reference, _lm_loss, [16, 8, 16, 8])
    assert len(profiled) == 0 and len(pipe.pipelines) == 2
    assert all(p.plan is plan for p in pipe.pipelines.values())


class _ShapeBranch(nn.Module):
    """Runs four layers on short sequences and one on long ones: the graph changes with the
    sequence length, so a plan cut inside the later layers cannot carry over."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, seq, 8)
        layers = self.layers if x.shape[1] <= 4 else self.layers[:1]
        for layer in layers:
            x = torch.relu(layer(x))
        return x.sum(dim=1)  # (batch, 8)


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)


def _branch_pipe() -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    model = _ShapeBranch()
    captured = capture(model, (torch.randn(2, 4, 8),), {})
    plan = manual_plan(captured, [5], 2, 4)  # after the third layer's linear
    return model, autopart.compile(model, loss_fn=_mse, plan=plan)


def test_a_shape_whose_graph_loses_the_cut_is_refused_with_the_fix() -> None:
    _, pipe = _branch_pipe()
    # train_step's own keywords reach the pipeline's train_step; they are not model inputs
    pipe.train_step(torch.randn(4, 4, 8), target=torch.randn(4, 8), trace=True)
    assert pipe.last_trace is not None and pipe.last_trace.events
    with pytest.raises(autopart.PlanError, match=r"inputs \(4, 6, 8\) give another graph.*"
                       r"cuts do not carry over.*example_inputs="):
        pipe.train_step(torch.randn(4, 6, 8), target=torch.randn(4, 8))
    with pytest.raises(autopart.PlanError, match="batch of 3 is not a multiple of the "
                       "microbatch size 2"):
        pipe.train_step(torch.randn(3, 2, 8), target=torch.randn(3, 8))


def test_before_the_first_step(tmp_path: Path) -> None:
    model, pipe = _branch_pipe()
    for name in ("plan", "save", "timings_s"):
        with pytest.raises(autopart.PlanError, match=rf"pipe.{name} does not exist yet.*"
                           r"first pipe.train_step.*example_inputs="):
            getattr(pipe, name)
    with pytest.raises(autopart.PlanError, match="example_target= goes with example_inputs="):
        autopart.compile(model, loss_fn=_mse, example_target=torch.zeros(4, 8))
    pipe.zero_grad()  # the model's, before the first call
    # state goes into the model, which the pipeline is built from
    state = {k: v + 1.0 for k, v in model.state_dict().items()}
    pipe.load_state_dict(state)
    assert pipe.state_dict().keys() == state.keys()
    torch.testing.assert_close(pipe.state_dict(), state)
    x = torch.randn(4, 4, 8)
    torch.testing.assert_close(pipe(x), model(x), **TOL)
    torch.testing.assert_close(pipe.state_dict(), state)  # the pipeline's, same values
    assert pipe.save_plan(tmp_path / "p.json")  # now the pipeline's own methods
    pipe.save(tmp_path / "ckpt")
    # autopart.load into a pipeline not planned yet: into its model, then built from it
    other_model, other = _branch_pipe()
    assert autopart.load(tmp_path / "ckpt", other) is other and other.pipeline is None
    torch.testing.assert_close(other_model.state_dict(), state)
    torch.testing.assert_close(other(x), model(x), **TOL)


def test_an_optimizer_of_parameters_the_pipeline_copied_is_refused() -> None:
    torch.manual_seed(0)
    model = _ShapeBranch()
    elsewhere = copy.deepcopy(model)  # stands for stages on another device: other tensors
    captured = capture(model, (torch.randn(2, 4, 8),), {})
    plan = manual_plan(captured, [5], 2, 4)

    def first_build(args: Any, kwargs: Any, target: Any) -> Any:
        return (autopart.compile(elsewhere, args, example_kwargs=kwargs, loss_fn=_mse, plan=plan),
                captured)

    pipe = lazy.LazyPipeline(model, backend="local", first_build=first_build,
                             rebuild=lambda *a: None)  # type: ignore[arg-type, return-value]
    torch.optim.SGD(pipe.parameters(), lr=0.1)
    with pytest.raises(autopart.PlanError, match=r"holds copies of \['layers.0.weight'.*Build "
                       r"the optimizer after the first pipe.train_step"):
        pipe.train_step(torch.randn(4, 4, 8), target=torch.randn(4, 8))
    # the pipeline is kept: its parameters are now the ones to build the optimizer from
    assert [id(p) for p in pipe.parameters()] == [id(p) for p in elsewhere.parameters()]
    pipe.train_step(torch.randn(4, 4, 8), target=torch.randn(4, 8))


def test_many_shapes_draw_a_warning_to_pad_or_bucket() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))  # any (batch, seq, 8)
    captured = capture(model, (torch.randn(2, 1, 8),), {})
    pipe = autopart.compile(model, plan=manual_plan(captured, [2], 1, 2))
    for seq in range(1, lazy.MANY_SHAPES + 1):
        x = torch.randn(2, seq, 8)
        torch.testing.assert_close(pipe(x), model(x), **TOL)
    with pytest.warns(RuntimeWarning, match=f"{lazy.MANY_SHAPES + 1} input shapes so far.*pad "
                      "or bucket"):
        pipe(torch.randn(2, lazy.MANY_SHAPES + 1, 8))
    assert len(pipe.pipelines) == lazy.MANY_SHAPES + 1


class _Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.out = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, *, mask: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.inp(x)) * mask)  # x, mask: (batch, 8)


def test_model_keywords_are_inputs_and_step_keywords_are_the_pipelines() -> None:
    torch.manual_seed(0)
    model = _Masked()
    reference = copy.deepcopy(model)
    x, mask, y = torch.randn(4, 8), (torch.rand(4, 8) > 0.5).float(), torch.randn(4, 8)
    captured = capture(model, (x[:2],), {"mask": mask[:2]})
    pipe = autopart.compile(model, loss_fn=_mse, plan=manual_plan(captured, [2], 2, 4))
    loss = pipe.train_step(x, mask=mask, target=y, trace=True)
    ref_loss = _mse(reference(x, mask=mask), y)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
    ref = dict(reference.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, ref[name].grad, **TOL, msg=name)
    assert pipe.last_trace is not None
