from typing import Any

import pytest
import torch
from torch import nn

from autopart.core.capture import capture, op_nodes
from autopart.core.errors import TraceError
from tests.zoo import gpt2


def test_flat_graph_matches_model_and_keeps_module_paths() -> None:
    model, args, _, _ = gpt2()
    captured = capture(model, args)
    out = captured.graph_module(*captured.flatten_inputs(args, {}))
    torch.testing.assert_close(out[0], model(*args).logits, rtol=0, atol=0)
    paths = {n.meta["nn_module_stack"] and list(n.meta["nn_module_stack"].values())[-1][0]
             for n in op_nodes(captured.graph_module.graph) if n.meta.get("nn_module_stack")}
    assert "transformer.h.3.mlp.c_fc" in paths
    # the tied lm_head / wte parameter maps to the model's canonical (first) name
    assert "transformer.wte.weight" in captured.attr_fqns.values()
    assert "lm_head.weight" not in captured.attr_fqns.values()
    assert captured.batch_size == 8


def test_fingerprint_ignores_batch_but_not_architecture() -> None:
    model, args, _, _ = gpt2()
    a = capture(model, args).fingerprint
    b = capture(model, (args[0][:2],)).fingerprint
    assert a == b
    wider = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    narrower = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    x = torch.randn(3, 4)
    assert capture(wider, (x,)).fingerprint != capture(narrower, (x,)).fingerprint


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if h.sum() > 0:  # branches on a tensor's value
            return h * 2
        return h


def test_data_dependent_control_flow_names_the_line_and_the_fix() -> None:
    with pytest.raises(TraceError, match=r"(?s)test_capture\.py:\d+.*if h\.sum\(\) > 0.*fix: .*torch\.cond"):
        capture(DataDependent(), (torch.randn(2, 4),))


def test_example_inputs_must_be_a_tuple() -> None:
    with pytest.raises(TraceError, match="must be a tuple"):
        capture(nn.Linear(2, 2), torch.randn(2, 2))  # type: ignore[arg-type]


def test_inputs_of_another_structure_are_rejected() -> None:
    captured = capture(nn.Linear(2, 2), (torch.randn(2, 2),))
    with pytest.raises(TraceError, match="structure"):
        captured.flatten_inputs((torch.randn(2, 2), torch.randn(2, 2)), {})


class _Positions(torch.nn.Module):
    """Reads a position index made on the input's device (as GPT-2 and Llama do)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(x.shape[1], device=x.device)
        return x + self.emb(pos)


def test_the_fingerprint_does_not_depend_on_the_capture_device() -> None:
    model = _Positions()
    on_cpu = capture(model, (torch.randn(2, 8, 4),))
    on_meta = capture(_Positions().to("meta"), (torch.randn(2, 8, 4, device="meta"),))
    assert any(isinstance(n.kwargs.get("device"), torch.device)
               for n in on_cpu.graph_module.graph.nodes)
    assert on_cpu.fingerprint == on_meta.fingerprint


class _Square(torch.autograd.Function):
    """x * x with a backward that is exact (2x) or, with ``approx``, not (3x)."""

    approx = False

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return grad * (3 if _Square.approx else 2) * x


class _UsesSquare(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Square.apply(self.lin(x)).sum(-1)


def test_a_custom_backward_that_the_graph_would_change_is_refused(monkeypatch: Any) -> None:
    monkeypatch.setattr(_Square, "approx", True)
    for args, kwargs in [((torch.randn(2, 4),), {}), ((), {"x": torch.randn(2, 4)})]:
        with pytest.raises(TraceError, match=r"_Square defines its own backward .* gradients "
                                             r"differ from the model's \(largest relative "):
            capture(_UsesSquare(), args, kwargs)
    assert torch.autograd.Function.__dict__["apply"].__func__.__name__ == "apply"


def test_a_custom_function_whose_backward_is_its_forwards_derivative_is_captured() -> None:
    model = _UsesSquare()
    x = torch.randn(2, 4)
    captured = capture(model, (x,))
    torch.testing.assert_close(captured.graph_module(x)[0], model(x))
