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


_SDPA = torch.ops.aten.scaled_dot_product_attention.default


class MaskedAttention(nn.Module):
    """One attention whose mask the forward builds from the sequence length, as transformers
    does under torch.export: causal, every key ("full"), or a sliding window of 4."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.qkv = nn.Linear(16, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, 2, 8).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        pos = torch.arange(s, device=x.device)
        mask = pos[None, :] <= pos[:, None]
        if self.kind == "full":
            mask = mask | ~mask
        elif self.kind == "window":
            mask = mask & (pos[:, None] - pos[None, :] < 4)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return out.transpose(1, 2).reshape(b, s, 16)


def _attention_args(captured: Any) -> list[tuple[Any, dict[str, Any]]]:
    return [(n.args, dict(n.kwargs)) for n in captured.graph_module.graph.nodes
            if n.target is _SDPA]


@pytest.mark.parametrize(("kind", "flags"), [("causal", {"is_causal": True}),
                                             ("full", {"is_causal": False}), ("window", None)])
def test_attention_masks_built_from_the_shapes_become_flags(kind: str, flags: Any) -> None:
    torch.manual_seed(0)
    model, x = MaskedAttention(kind), torch.randn(2, 12, 16)
    captured = capture(model, (x,))
    ((args, kwargs),) = _attention_args(captured)
    if flags is None:  # a sliding window is neither: the mask stays as captured
        assert len(args) == 4 and "is_causal" not in kwargs
    else:
        assert len(args) == 3 and kwargs["is_causal"] is flags["is_causal"]
        assert "attn_mask" not in kwargs
        # what computed the mask went with it: no [12, 12] value is left in the graph
        assert not [n for n in captured.graph_module.graph.nodes
                    if getattr(n.meta.get("val"), "shape", ())[-2:] == (12, 12)]
    out = captured.graph_module.forward(*captured.flatten_inputs((x,), {}))
    torch.testing.assert_close(out[0], model(x), rtol=1e-6, atol=1e-6)
    ((kept, _),) = _attention_args(capture(model, (x,), attention_flags=False))
    assert len(kept) == 4  # attention_flags=False keeps every mask


def test_attention_masks_from_inputs_or_over_budget_stay(monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers

    from autopart.core import _capture_rewrites

    cfg = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=2, intermediate_size=64,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                   use_cache=False)
    model, x = transformers.LlamaForCausalLM(cfg), torch.randint(0, 64, (2, 16))
    rewritten = _attention_args(capture(model, (x,)))
    assert [len(a) for a, _ in rewritten] == [3, 3]
    assert all(k["is_causal"] for _, k in rewritten)
    # positions passed in: packed sequences would make another mask, so it stays
    positions = torch.arange(16).expand(2, 16)
    assert [len(a) for a, _ in _attention_args(capture(model, (x,),
                                                       {"position_ids": positions}))] == [4, 4]
    monkeypatch.setattr(_capture_rewrites, "MASK_CHECK_BUDGET_BYTES", 1024)
    assert [len(a) for a, _ in _attention_args(capture(model, (x,)))] == [4, 4]
