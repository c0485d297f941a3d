"""The workloads where balance matters (benchmarks/pipeline_cpu/workloads.py, issue 17), at tiny
sizes: each layer list computes the model exactly (outputs, loss, every gradient), every stage
boundary meets DeepSpeed's pipeline contract, and autopart captures, splits and trains each one
like the unpartitioned model."""

from __future__ import annotations

import copy
import functools
import re
import sys
from typing import Any

import pytest
import torch
from torch import nn

import autopart
from autopart.core.errors import UsageError
from benchmarks.pipeline_cpu.peer_workload import PeerWorkload
from benchmarks.pipeline_cpu.workloads import (
    WORKLOADS,
    TiedLayer,
    hetero_workload,
    plain_layers,
    resnet50_workload,
    run_layers,
    t5_workload,
)

TINY: dict[str, PeerWorkload] = {
    "resnet50": resnet50_workload(image=32, batch=4, width=0.125, num_classes=10,
                                  depths=(1, 2, 2, 1), num_microbatches=2),
    "t5_encdec": t5_workload(batch=4, src=12, tgt=8, d_model=32, d_ff=64, heads=4, layers=2,
                             vocab=100, num_microbatches=2),
    "hetero": hetero_workload(batch=4, seq=32, dim_a=16, dim_b=32, heads=2, depth_a=2, depth_b=3,
                              stride=4, vocab=50, classes=5, num_microbatches=2),
}
# the repeated blocks of each tiny model: what partition_method="type:<regex>" balances
BLOCKS = {"resnet50": 1 + 2 + 2 + 1, "t5_encdec": 2 + 2, "hetero": 2 + 3}
NAMES = sorted(TINY)


def _reference(w: PeerWorkload) -> tuple[nn.Module, tuple[Any, ...], Any, torch.Tensor,
                                         torch.Tensor, dict[str, torch.Tensor]]:
    """A fresh model, its inputs and target, and the unpartitioned output, loss and gradients."""
    model, inputs, target, loss_fn = w.build()
    ref = copy.deepcopy(model)
    out = ref(*inputs)
    loss = loss_fn(out, target)
    loss.backward()
    grads = {n: p.grad for n, p in ref.named_parameters()}
    return model, inputs, target, out.detach(), loss.detach(), grads


def _close(got: torch.Tensor, want: torch.Tensor, rtol: float) -> None:
    # float32 sums in another order (microbatches, stages) err relative to the summed terms'
    # size, so the absolute tolerance scales with the tensor's largest entry
    torch.testing.assert_close(got, want, rtol=rtol, atol=rtol * float(want.detach().abs().max()) + 1e-7)


def _check_grads(model: nn.Module, grads: dict[str, torch.Tensor], rtol: float) -> None:
    got = dict(model.named_parameters())
    assert got.keys() == grads.keys()
    for name, want in grads.items():
        assert got[name].grad is not None, name
        _close(got[name].grad, want, rtol)


def _module_of(layer: Any) -> nn.Module:
    return layer.module if isinstance(layer, TiedLayer) else layer


def _blocks(w: PeerWorkload, layers: list[Any]) -> list[nn.Module]:
    """The layers DeepSpeed's ``type:<regex>`` partitioning counts (it searches class names,
    ignoring case)."""
    return [layer for layer in layers if not isinstance(layer, TiedLayer)
            and re.search(w.ds_type_regex, type(layer).__name__, re.IGNORECASE)]


def test_benchmark_sizes() -> None:
    assert sorted(WORKLOADS) == ["hetero", "resnet50", "t5_encdec"]
    for name, w in WORKLOADS.items():
        assert w.name == name and w.description
        # m = 8 like every arm, and microbatches of at least 2 rows (export specialises 1)
        assert w.num_microbatches == 8 and w.batch % 8 == 0 and w.batch // 8 >= 2


@pytest.mark.parametrize("name", NAMES)
def test_layer_list_computes_the_model(name: str) -> None:
    w = TINY[name]
    model, inputs, target, out_ref, loss_ref, grads = _reference(w)
    layers = plain_layers(name, model)
    # the list holds every parameter of the model (and nothing else), so DeepSpeed trains them all
    held = {id(p) for layer in layers for p in _module_of(layer).parameters()}
    assert held == {id(p) for p in model.parameters()}
    x, y = w.ds_batch(inputs, target)
    out = run_layers(layers, x)
    _close(out, out_ref, 1e-5)
    loss = w.ds_loss_fn(out, y)
    _close(loss, loss_ref, 1e-5)
    loss.backward()
    _check_grads(model, grads, 1e-5)
    # partition_method="type:<regex>" finds exactly the repeated blocks
    assert len(_blocks(w, layers)) == BLOCKS[name]


@pytest.mark.parametrize("name", NAMES)
def test_every_stage_boundary_meets_deepspeeds_contract(name: str) -> None:
    """DeepSpeed's engine sends a tuple of tensors between stages, marks the received floats
    as requiring grad, sends back each one's gradient (asserting it exists) and calls
    ``backward(grad)`` on each float it sent; cut the list at every boundary and do the same."""
    w = TINY[name]
    model, inputs, target, _, loss_ref, grads = _reference(w)
    layers = plain_layers(name, model)
    x, y = w.ds_batch(inputs, target)
    for k in range(1, len(layers)):
        model.zero_grad(set_to_none=True)
        sent = run_layers(layers[:k], x)
        tensors = sent if isinstance(sent, tuple) else (sent,)
        assert all(isinstance(t, torch.Tensor) for t in tensors), (k, tensors)
        got = tuple(t.detach().clone().requires_grad_(t.is_floating_point()) for t in tensors)
        loss = w.ds_loss_fn(run_layers(layers[k:], got if isinstance(sent, tuple) else got[0]), y)
        _close(loss, loss_ref, 1e-5)
        loss.backward()
        for i, t in enumerate(got):
            assert (t.grad is not None) == t.is_floating_point(), (k, i, t.dtype)
        floats = [(s, r.grad) for s, r in zip(tensors, got, strict=True) if s.is_floating_point()]
        for i, (s, g) in enumerate(floats):
            s.backward(g, retain_graph=i < len(floats) - 1)
        _check_grads(model, grads, 1e-5)


def test_unknown_workload_and_t5_dropout_are_refused() -> None:
    with pytest.raises(UsageError, match="no workload 'gpt3'.*resnet50"):
        plain_layers("gpt3", nn.Linear(1, 1))
    w = TINY["t5_encdec"]
    model = w.build()[0]
    model.t5.config.dropout_rate = 0.1
    with pytest.raises(UsageError, match="dropout_rate 0"):
        plain_layers("t5_encdec", model)


def test_deepspeed_is_imported_only_for_tied_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # as if not installed
    model = TINY["resnet50"].build()[0]
    assert TINY["resnet50"].ds_layers(model) == plain_layers("resnet50", model)
    t5 = TINY["t5_encdec"].build()[0]
    with pytest.raises(ImportError, match="DS_BUILD_OPS=0"):
        TINY["t5_encdec"].ds_layers(t5)


@pytest.mark.parametrize("name", NAMES)
def test_deepspeed_layer_specs_compute_the_model(name: str) -> None:
    """The list as DeepSpeed gets it, built the way ``PipelineModule._build`` builds it."""
    pytest.importorskip("deepspeed")
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    w = TINY[name]
    model, inputs, target, out_ref, loss_ref, grads = _reference(w)
    tied: dict[str, nn.Module] = {}
    funcs = []
    for spec in w.ds_layers(model):
        if isinstance(spec, TiedLayerSpec):
            module = tied.setdefault(spec.key, spec.build())
            for attr in spec.tied_weight_attr:  # names the model's own parameter
                assert functools.reduce(getattr, attr.split("."), module) is model.t5.shared.weight
            funcs.append(module if spec.forward_fn is None
                         else functools.partial(spec.forward_fn, module))
        elif isinstance(spec, LayerSpec):
            funcs.append(spec.build())
        else:
            assert isinstance(spec, nn.Module)
            funcs.append(spec)
    assert bool(tied) == (name == "t5_encdec")
    x, y = w.ds_batch(inputs, target)
    for f in funcs:
        x = f(x)
    _close(x, out_ref, 1e-5)
    loss = w.ds_loss_fn(x, y)
    _close(loss, loss_ref, 1e-5)
    loss.backward()
    _check_grads(model, grads, 1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_hand_split_halves_the_blocks(name: str) -> None:
    from torch.distributed.pipelining import SplitPoint, pipeline

    w = TINY[name]
    model, inputs, _, out_ref, _, _ = _reference(w)
    split = w.hand_split(model)
    assert list(split.values()) == [SplitPoint.BEGINNING]
    # the block it starts is the first of the second half
    blocks = [getattr(b, "block", b) for b in _blocks(w, plain_layers(name, model))]
    assert model.get_submodule(next(iter(split))) is blocks[len(blocks) // 2]
    # torch's pipeline() accepts it: two stages computing the model
    mb = tuple(t.chunk(w.num_microbatches)[0] for t in inputs)
    pipe = pipeline(model, mb_args=mb, split_spec=split)
    assert pipe.num_stages == 2
    _close(pipe(*mb)[0], model(*mb), 1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_autopart_captures_splits_and_trains(name: str) -> None:
    w = TINY[name]
    model, inputs, target, _, loss_ref, grads = _reference(w)
    loss_fn = w.build()[3]
    pipe = autopart.compile(model, inputs, loss_fn=loss_fn, example_target=target, num_stages=2,
                            num_microbatches=w.num_microbatches, schedule="1f1b")
    assert len(pipe.plan.stages) == 2
    assert all(s.num_parameters > 0 for s in pipe.plan.stages)
    loss = pipe.train_step(*inputs, target=target)
    _close(loss, loss_ref, 1e-4)
    _check_grads(pipe, grads, 1e-4)
