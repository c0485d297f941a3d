"""The loss's own cost on the last stage: measured with an example target, else estimated.

``loss_fn`` runs outside the captured graph (the runtimes call it on the last stage's
outputs), so the profile of the graph alone misses its time and memory: for a language
model's cross-entropy over a large vocabulary that is a copy of the logits, the saved
log-softmax and the logits' gradient, per microbatch in flight. The cost is folded into the
graph's last node, so it lands on the last stage.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from autopart.core.capture import CapturedGraph
from autopart.core.costgraph import CostGraph
from autopart.core.memory import measure_peak_bytes
from autopart.core.signature import InputSignature, call_loss
from autopart.profiler.cache import load_measure, store_measure
from autopart.profiler.meters import SavedTensorMeter
from autopart.profiler.timer import RngState, time_calls

__all__ = ["LossCost", "measure_loss_cost", "estimate_loss_cost", "with_loss_cost", "cached_loss",
           "loss_source", "loss_tag"]


@dataclass(frozen=True)
class LossCost:
    """What one call of the loss costs at the profiled batch.

    Attributes:
        fwd_us: ``loss_fn(output, target)``, µs.
        bwd_us: its backward down to the model's outputs, µs.
        saved_bytes: what autograd keeps from it until its backward (the model's outputs
            included when the loss saves them), bytes.
        transient_bytes: the most memory its forward and backward allocate beyond
            ``saved_bytes`` (the outputs' gradients, temporary copies), bytes.
        source: ``"measured:<device>"`` or ``"estimated"``.
    """

    fwd_us: float
    bwd_us: float
    saved_bytes: int
    transient_bytes: int
    source: str


def _outputs(signature: InputSignature, device: torch.device) -> list[Any]:
    """Random leaves shaped as the captured graph's outputs (floating ones need grad)."""
    leaves: list[Any] = []
    for meta in signature.output_meta:
        if meta is None:
            leaves.append(None)
            continue
        shape, dtype = meta
        if dtype.is_floating_point:
            leaves.append(torch.randn(shape, dtype=dtype, device=device).requires_grad_(True))
        else:
            leaves.append(torch.zeros(shape, dtype=dtype, device=device))
    return leaves


def measure_loss_cost(captured: CapturedGraph, loss_fn: Any, target: Any, device: str, *,
                      repeats: int = 3, long_us: float = 100_000.0) -> LossCost:
    """Time and size ``loss_fn`` on outputs shaped as ``captured``'s (random values; the
    cost of a loss does not depend on them) and ``target`` (one captured batch of it).

    Time: medians of ``repeats`` calls after one warm-up, forward and backward apart (a
    first call of ``long_us`` or more is the one sample, as in the profiler).
    Saved bytes: :class:`autopart.profiler.meters.SavedTensorMeter` over one forward.
    Transient: the largest allocation during forward + backward
    (:func:`autopart.core.memory.measure_peak_bytes`) less the saved bytes; the outputs
    the loss reads are allocated before (the stage holds them, and the plan counts them).

    Raises:
        ProfileError: ``device`` is not valid (see :func:`autopart.profiler.timer.check_device`).
        PlanError: the loss does not return a scalar floating-point tensor.
    """
    from autopart.profiler.timer import check_device

    dev = check_device(device)
    signature = InputSignature.of(captured)
    target = _to(target, dev)

    with RngState(dev):
        # random outputs made once (a 134 MB logits tensor takes longer to fill than the
        # loss takes to run); each call reads fresh leaves aliasing them, so every call's
        # gradients are its own
        base = _outputs(signature, dev)

        def leaves_now() -> list[Any]:
            return [x.detach().requires_grad_(x.requires_grad)
                    if isinstance(x, torch.Tensor) else x for x in base]

        def forward() -> tuple[list[Any], torch.Tensor]:
            leaves = leaves_now()
            return leaves, call_loss(loss_fn, signature.output(leaves), target)

        def forward_factory() -> Any:
            leaves = leaves_now()
            return lambda: call_loss(loss_fn, signature.output(leaves), target)

        fwd_us, _ = time_calls(dev, forward_factory, 1, repeats, long_us)

        def backward_factory() -> Any:
            _, loss = forward()
            return loss.backward

        bwd_us, _ = time_calls(dev, backward_factory, 1, repeats, long_us)
        meter = SavedTensorMeter(set())
        with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
            leaves, loss = forward()
        saved = meter.saved_bytes
        del leaves, loss

        outputs = leaves_now()  # held by the stage anyway: not the loss's

        def whole() -> None:
            loss = call_loss(loss_fn, signature.output(outputs), target)
            loss.backward()

        _, peaks = measure_peak_bytes(whole, [dev])
    peak = peaks["cpu" if dev.type == "cpu" else str(dev)]
    return LossCost(fwd_us=fwd_us, bwd_us=bwd_us, saved_bytes=saved,
                    transient_bytes=max(peak - saved, 0), source=f"measured:{dev}")


def estimate_loss_cost(captured: CapturedGraph, device: str | None = None) -> LossCost:
    """The guess when no example target is given: a cross-entropy over the last dimension of
    each floating output, the usual loss of a model whose output is large enough for its loss
    to matter (a language model's or a classifier's logits).

    With ``device`` (a real one) that loss is run and measured as
    :func:`measure_loss_cost` measures a user's loss (class 0 as every row's target), and
    the source is ``"estimated:cross-entropy:<device>"``. Without one (or on ``meta``): no
    time, saved bytes the floating outputs' (cross-entropy's log-softmax) and a transient of
    twice that (a shifted copy and the outputs' gradient), source ``"estimated"``. Either
    way a guess: pass ``example_target`` to :func:`autopart.compile` to measure the real
    loss.

    Raises:
        ProfileError: ``device`` is not valid.
    """
    if device is not None and torch.device(device).type != "meta":
        cost = measure_loss_cost(captured, _cross_entropy_over_outputs, None, device)
        return dataclasses.replace(cost, source=f"estimated:cross-entropy:{torch.device(device)}")
    signature = InputSignature.of(captured)
    nbytes = sum(int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
                 for meta in signature.output_meta if meta is not None
                 for shape, dtype in [meta] if dtype.is_floating_point)
    return LossCost(0.0, 0.0, nbytes, 2 * nbytes, "estimated")


def _cross_entropy_over_outputs(output: Any, _target: Any) -> torch.Tensor:
    """The stand-in loss of :func:`estimate_loss_cost`: the sum over the floating tensors of
    ``output`` of ``cross_entropy(x.reshape(-1, x.shape[-1]), class 0)``."""
    import torch.utils._pytree as pytree

    total: torch.Tensor | None = None
    for x in pytree.tree_leaves(output):
        if not (isinstance(x, torch.Tensor) and x.is_floating_point() and x.dim() >= 1
                and x.numel() > 0):
            continue
        rows = x.reshape(-1, x.shape[-1])
        loss = torch.nn.functional.cross_entropy(
            rows, torch.zeros(rows.shape[0], dtype=torch.long, device=x.device))
        total = loss if total is None else total + loss
    if total is None:  # no floating output: nothing for a loss to cost
        return torch.zeros((), requires_grad=True)
    return total


def with_loss_cost(costs: CostGraph, loss: LossCost) -> CostGraph:
    """``costs`` with ``loss`` added to its last node (the last stage always holds it); its
    saved bytes are also recorded apart (``CostGraph.loss_saved_bytes``)."""
    last = costs.nodes[-1]
    bwd = loss.bwd_us
    node = dataclasses.replace(
        last, fwd_us=last.fwd_us + loss.fwd_us, bwd_input_us=last.bwd_input_us + bwd,
        saved_bytes=last.saved_bytes + loss.saved_bytes,
        transient_bytes=max(last.transient_bytes, loss.transient_bytes))
    return dataclasses.replace(costs, nodes=(*costs.nodes[:-1], node),
                               loss_saved_bytes=costs.loss_saved_bytes + loss.saved_bytes)


def _to(value: Any, device: torch.device) -> Any:
    import torch.utils._pytree as pytree

    return pytree.tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, value)


def loss_source(device: str, measured: bool) -> str:
    """The :class:`LossCost` source of a loss timed on ``device``: the user's loss
    (``measured``) or the cross-entropy stand-in (:func:`estimate_loss_cost`)."""
    dev = torch.device(device)
    return f"measured:{dev}" if measured else f"estimated:cross-entropy:{dev}"


def loss_tag(measured: bool) -> str:
    """What a loss timed as the cross-entropy stand-in adds to its figures' cache names, so
    that they never stand in for the user's loss measured later, nor the other way round."""
    return "" if measured else ",loss=estimated-cross-entropy"


def cached_loss(key: dict[str, Any] | None, suffix: str,
                measure: Callable[[], LossCost | None], source: str) -> LossCost | None:
    """``measure()``'s :class:`LossCost` (None: no loss), a timed one read from (and stored
    in) the profile cache as numbers ``loss_<field><suffix>`` on ``key``'s profile (``key``
    None: the cache is off), so a second launch plans on the loss cost of the first.
    ``source`` labels a cached one."""
    fields = ("fwd_us", "bwd_us", "saved_bytes", "transient_bytes")
    names = [f"loss_{f}{suffix}" for f in fields]
    cached = [load_measure(key, n) for n in names] if key is not None else [None]
    if all(v is not None for v in cached):
        fwd, bwd, saved, transient = (float(v) for v in cached if v is not None)
        return LossCost(fwd, bwd, int(saved), int(transient), source)
    loss = measure()
    if loss is not None and key is not None and loss.source != "estimated":
        for n, v in zip(names, (loss.fwd_us, loss.bwd_us, loss.saved_bytes,
                                loss.transient_bytes), strict=True):
            store_measure(key, n, v)
    return loss
