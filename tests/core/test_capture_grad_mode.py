"""``torch.no_grad()`` regions inside forward: the captured graph must not differentiate them.

The model below has HRM's pattern (``hrm_text`` in transformers): a recurrent state is
refined by the same stack several times, the early cycles under ``torch.no_grad()`` and
only the last one with gradients. torch.export keeps the early cycles as
``wrap_with_set_grad_enabled(False, ...)`` calls; functionalising the program inlined them
without their grad mode, and the pipeline's gradients were up to 66 % off. A no-op cast
of an input inside the region (``hidden_states.to(weight.dtype)`` in Dots3's indexer) is
that input itself and keeps its gradient. A no-grad region inside a custom autograd
Function's forward (Reformer's reversible layers) is not detached: eagerly its output has a
gradient, through the Function's own backward.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import autopart
from autopart.core.capture import capture
from tests.numerics import assert_train_step_matches

B, T, D = 4, 5, 8


class Cycles(nn.Module):
    """``z`` refined ``cycles`` times by one layer; all but the last cycle without gradients."""

    def __init__(self, cycles: int = 3) -> None:
        super().__init__()
        self.cycles = cycles
        self.embed = nn.Linear(D, D)
        self.layers = nn.ModuleList(nn.Linear(D, D) for _ in range(2))
        self.head = nn.Linear(D, 3)

    def step(self, z: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            z = torch.tanh(layer(z + x))
        return z

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        z = torch.zeros_like(x)
        for i in range(self.cycles):
            if i < self.cycles - 1:
                with torch.no_grad():
                    # a no-op cast returns x itself, whose later uses keep their gradient
                    # (torch.export reads them from the region's output)
                    z = self.step(z, x) * x.to(torch.float32).sigmoid()
                    peek = x.view(-1)  # a view made without gradients has none either
            else:
                z = self.step(z, x)
        return self.head(z + peek.view_as(x))  # (B, T, 3)


def _model() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return Cycles(), torch.randn(B, T, D)


def _grads(model: nn.Module, run: object) -> dict[str, torch.Tensor | None]:
    model.zero_grad(set_to_none=True)
    run().square().mean().backward()  # type: ignore[operator]
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def test_export_really_keeps_the_region_as_a_grad_mode_call() -> None:
    """Guard on the premise: the region reaches capture as ``wrap_with_set_grad_enabled``."""
    model, x = _model()
    ep = torch.export.export(model, (x,), strict=False)
    calls = [n for n in ep.graph.nodes if "wrap_with_set_grad_enabled" in str(n.target)]
    assert len(calls) == 2


def test_the_captured_graph_has_the_models_gradients() -> None:
    model, x = _model()
    captured = capture(model, (x,))
    eager = _grads(model, lambda: model(x))
    graph = _grads(model, lambda: captured.graph_module.forward(x)[0])
    assert eager.keys() == graph.keys()
    for name, want in eager.items():
        if want is None:
            assert graph[name] is None, name
        else:
            torch.testing.assert_close(graph[name], want, rtol=1e-6, atol=1e-7, msg=name)
    assert any(n.target == torch.ops.aten.detach.default
               for n in captured.graph_module.graph.nodes)


@pytest.mark.parametrize("num_stages", [2, 3])
def test_stages_match_the_model_loss_and_every_gradient(num_stages: int) -> None:
    model, x = _model()
    reference = copy.deepcopy(model)
    target = torch.randint(0, 3, (B, T))

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out.reshape(-1, 3), y.reshape(-1))

    pipe = autopart.compile(model, (x,), loss_fn=loss_fn, num_stages=num_stages,
                            num_microbatches=2, time_limit_s=5.0)
    assert_train_step_matches(pipe, reference, (x,), target, loss_fn)


class _Reversible(torch.autograd.Function):
    """Reformer's pattern (``_ReversibleFunction``): the forward runs its layers under
    ``torch.no_grad()`` and keeps only the output; the backward recomputes them with gradients
    on, accumulates the parameters' gradients into ``.grad`` itself and returns the input's."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, layers: nn.ModuleList) -> torch.Tensor:
        ctx.layers = layers
        ctx.save_for_backward(x)
        with torch.no_grad():
            for layer in layers:
                x = x + layer(x)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            x = x.detach().requires_grad_(True)
            y = x
            for layer in ctx.layers:
                y = y + layer(y)
            torch.autograd.backward(y, grad)  # the parameters' .grad, and x.grad
        return x.grad, None


class ReversibleStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4))
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(_Reversible.apply(self.embed(x), self.layers))


def test_a_no_grad_region_inside_a_custom_function_stays_differentiable() -> None:
    """The no-grad regions of a custom Function's forward are not detached (its output has a
    gradient eagerly, through its own backward): the graph differentiates the forward as
    written, which here is the same gradient, and the pipeline matches the model."""
    torch.manual_seed(0)
    model, x, y = ReversibleStack(), torch.randn(8, 8), torch.randint(0, 3, (8,))
    reference = copy.deepcopy(model)
    pipe = autopart.compile(model, (x,), loss_fn=nn.functional.cross_entropy, example_target=y,
                            num_stages=2, num_microbatches=2, schedule="1f1b")
    assert_train_step_matches(pipe, reference, (x,), y, nn.functional.cross_entropy)
