"""The zero-bubble backward split: I then W computes what one full backward computes."""

from collections.abc import Callable

import pytest
import torch
from torch import nn

from autopart.codegen.split_backward import SplitBackward


class _CountBackward(torch.autograd.Function):
    """Identity whose backward counts its runs (a marker on the input-gradient path)."""

    runs = 0

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        _CountBackward.runs += 1
        return g


class Chain(nn.Module):
    """Three linears with a counted identity between them and a weight used twice."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6)
        self.scale = nn.Parameter(torch.rand(6) + 0.5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = _CountBackward.apply(torch.tanh(self.a(x)) * self.scale)
        h = self.b(h) + self.a(h)  # a's weight on two input paths
        return (self.c(h) * self.scale,)


class Mixed(nn.Module):
    """Outputs that hit every special case: a pass-through input, an output made of
    parameters alone, and an output computed from another output."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 5)
        self.bias = nn.Parameter(torch.randn(5))
        self.emb = nn.Embedding(7, 5)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = self.lin(x) + self.emb(ids)
        weight_only = self.emb.weight[:2].sum(0) * self.bias  # no input on its path
        return x, h, h.exp(), weight_only, weight_only.sin()


def _cases() -> list[tuple[str, Callable[[], tuple[nn.Module, list[torch.Tensor]]]]]:
    def chain() -> tuple[nn.Module, list[torch.Tensor]]:
        return Chain(), [torch.randn(4, 6)]

    def mixed() -> tuple[nn.Module, list[torch.Tensor]]:
        return Mixed(), [torch.randn(3, 5), torch.randint(0, 7, (3,))]

    def first_stage() -> tuple[nn.Module, list[torch.Tensor]]:  # no input needs a gradient
        model = nn.Sequential(nn.Embedding(9, 4), nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4))
        return model, [torch.randint(0, 9, (2, 3))]

    def batchnorm() -> tuple[nn.Module, list[torch.Tensor]]:  # one node for input and weight
        model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 2, 1))
        return model, [torch.randn(2, 3, 6, 6)]

    return [("chain", chain), ("mixed", mixed), ("first_stage", first_stage),
            ("batchnorm", batchnorm)]


@pytest.mark.parametrize(("name", "make"), _cases(), ids=[n for n, _ in _cases()])
def test_input_then_weight_gradients_equal_the_full_backward(
        name: str, make: Callable[[], tuple[nn.Module, list[torch.Tensor]]]) -> None:
    torch.manual_seed(0)
    model, raw = make()
    results = []
    for split in (False, True):
        torch.manual_seed(1)
        model.zero_grad(set_to_none=True)
        inputs = [x.clone().requires_grad_(x.is_floating_point()) for x in raw]
        outs = model(*inputs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        roots = [o for o in outs if o.requires_grad]
        root_grads = [torch.randn_like(o) for o in roots]
        if split:
            sb = SplitBackward(roots, root_grads, inputs, list(model.parameters()))
            input_grads = sb.input_grads()
            assert all(p.grad is None for p in model.parameters()), "I touched a weight grad"
            sb.weight_grads()
        else:
            torch.autograd.backward(roots, root_grads, inputs=[x for x in inputs
                                                               if x.requires_grad]
                                    + list(model.parameters()))
            input_grads = [x.grad if x.requires_grad else None for x in inputs]
        results.append((input_grads, [p.grad for p in model.parameters()]))
    (full_in, full_w), (split_in, split_w) = results
    for a, b in zip(full_in, split_in, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)
    for (name_p, _), a, b in zip(model.named_parameters(), full_w, split_w, strict=True):
        assert b is not None, f"{name_p} got no weight gradient"
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6, msg=name_p)


def test_weight_pass_does_not_recompute_input_gradients() -> None:
    # the marker sits on the input path between layers that share no weight: a full
    # backward runs it once, and so must I + W together (a W that re-walked the graph from
    # the roots would run it a second time)
    torch.manual_seed(0)
    first, second = nn.Sequential(nn.Linear(6, 6), nn.Tanh()), nn.Linear(6, 6)
    params = list(first.parameters()) + list(second.parameters())
    x = torch.randn(4, 6, requires_grad=True)
    out = second(_CountBackward.apply(first(x)))
    _CountBackward.runs = 0
    sb = SplitBackward([out], [torch.ones_like(out)], [x], params)
    sb.input_grads()
    assert _CountBackward.runs == 1
    sb.weight_grads()
    assert _CountBackward.runs == 1
    assert all(p.grad is not None for p in params)
