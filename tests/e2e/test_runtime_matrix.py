"""Every schedule kind x stages x interleaving, with and without recompute, on a model zoo,
against the plain model.

Plans are written by hand (cuts at even op-node counts) so the matrix tests the runtime
alone; each model is captured once per module and deep-copied per case. Every (model,
layout) pair runs once, recomputing where ``(model index + layout index)`` is odd: each model
runs half its layouts recomputing, and each layout recomputes on some models and keeps on
the others (every pair of the three factors is covered; the 140 triples took 7 minutes of
the 2-core CI's CPU, these 70 half that).
"""

import copy
from typing import Any

import pytest
import torch

from autopart.core.capture import CapturedGraph, capture
from autopart.core.microbatch import split_leaves
from tests.plans import even_positions, local_pipeline, manual_plan
from tests.zoo import ZOO

TOL = {"rtol": 1e-5, "atol": 4e-5}
M = 4  # microbatches; batch 8 -> microbatch 2
MODELS = ["gpt2", "bert", "llama", "vit", "resnet", "skip_mlp", "tied_mlp"]
# (schedule kind, total stages, stages per rank)
LAYOUTS = [("gpipe", 2, 1), ("gpipe", 4, 1), ("1f1b", 2, 1), ("1f1b", 4, 1),
           ("zero_bubble", 2, 1), ("zero_bubble", 4, 1),
           ("interleaved_1f1b", 2, 2), ("interleaved_1f1b", 4, 2),
           ("zbv", 4, 2), ("dualpipev", 4, 2)]  # V: 2 ranks, stages 0, 3 on rank 0

_CAPTURED: dict[str, tuple[Any, ...]] = {}


def _captured(name: str) -> tuple[Any, ...]:
    if name not in _CAPTURED:
        model, args, target, loss_fn = ZOO[name]()
        mb_args = tuple(split_leaves(list(args), M)[0])
        _CAPTURED[name] = (model, capture(model, mb_args), args, target, loss_fn)
    return _CAPTURED[name]


def _primary(out: Any) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


#: (model, schedule kind, total stages, stages per rank, recompute): pairwise (see above)
CASES = [(name, kind, s, v, (i + j) % 2 == 1) for i, name in enumerate(MODELS)
         for j, (kind, s, v) in enumerate(LAYOUTS)]


def test_the_cases_cover_every_pair_of_model_layout_and_recompute() -> None:
    pairs = {(c[0], c[1:4]) for c in CASES}
    assert len(pairs) == len(MODELS) * len(LAYOUTS) == len(CASES)
    assert {(c[0], c[4]) for c in CASES} == {(m, r) for m in MODELS for r in (False, True)}
    assert {(c[1:4], c[4]) for c in CASES} == {(lay, r) for lay in LAYOUTS
                                              for r in (False, True)}


@pytest.mark.parametrize(("name", "kind", "num_stages", "v", "recompute"), CASES,
                         ids=[f"{n}-{k}-S{s}-v{v}-{'recompute' if r else 'keep'}"
                              for n, k, s, v, r in CASES])
def test_schedule_matches_the_unpartitioned_model(name: str, kind: str, num_stages: int, v: int,
                                                  recompute: bool) -> None:
    model0, captured0, args, target, loss_fn = _captured(name)
    # fresh parameters for this case: the model and its capture are copied together
    model, captured = copy.deepcopy((model0, captured0))
    assert isinstance(captured, CapturedGraph)
    reference = copy.deepcopy(model0)
    plan = manual_plan(captured, even_positions(captured, num_stages), M, 8,
                       schedule_kind=kind, stages_per_rank=v, recompute=recompute)
    pipe = local_pipeline(model, captured, plan, ["cpu"] * (num_stages // v), loss_fn=loss_fn)

    torch.testing.assert_close(_primary(pipe(*args)), _primary(reference(*args)), **TOL)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    ref_params = dict(reference.named_parameters())
    for step in range(3):
        opt.zero_grad()
        ref_opt.zero_grad()
        loss = pipe.train_step(*args, target=target)
        ref_loss = loss_fn(reference(*args), target)
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
        if step == 0:
            for pname, p in pipe.named_parameters():
                ref_grad = ref_params[pname].grad
                if ref_grad is None:
                    assert p.grad is None, pname
                else:
                    assert p.grad is not None, pname
                    torch.testing.assert_close(p.grad, ref_grad, **TOL, msg=pname)
        opt.step()
        ref_opt.step()
    for pname, p in pipe.named_parameters():
        torch.testing.assert_close(p, ref_params[pname], **TOL, msg=pname)


@pytest.mark.requires_cuda
@pytest.mark.parametrize(("kind", "num_stages", "v"), LAYOUTS,
                         ids=[f"{k}-S{s}-v{v}" for k, s, v in LAYOUTS])
def test_cuda_streams_match_the_unpartitioned_model(kind: str, num_stages: int, v: int) -> None:
    model0, captured0, args, target, loss_fn = _captured("gpt2")
    model, captured = copy.deepcopy((model0, captured0))
    reference = copy.deepcopy(model0).cuda()
    plan = manual_plan(captured, even_positions(captured, num_stages), M, 8,
                       schedule_kind=kind, stages_per_rank=v)
    pipe = local_pipeline(model, captured, plan, ["cuda:0"] * (num_stages // v), loss_fn=loss_fn)
    cuda_args = tuple(a.cuda() for a in args)
    torch.testing.assert_close(_primary(pipe(*args)), _primary(reference(*cuda_args)), **TOL)
    loss = pipe.train_step(*args, target=target.cuda())
    ref_loss = loss_fn(reference(*cuda_args), target.cuda())
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
    ref_params = dict(reference.named_parameters())
    for pname, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, ref_params[pname].grad, **TOL, msg=pname)
