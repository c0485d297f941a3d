"""The capture step: the model captured at the plan's microbatch size, and the plan made for
that graph."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from autopart.codegen import plan_for_graph
from autopart.core.capture import CapturedGraph, capture, on_meta
from autopart.core.context import context_inputs
from autopart.core.errors import PlanError
from autopart.core.plan import Plan
from autopart.core.progress import phase
from autopart.core.signature import batch_size, microbatch_inputs, replica_share

__all__ = ["capture_for_plan"]


def capture_for_plan(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                     plan: Plan, profiled: CapturedGraph | None,
                     timings: dict[str, float]) -> tuple[Plan, CapturedGraph]:
    """``model`` captured on one microbatch of the plan: the profile's own capture when it
    was taken at that size, else a new one (on ``meta`` tensors for a ``meta`` model).

    A graph captured at one row is not the one captured at any other batch size:
    ``torch.export`` specialises size-1 dimensions (GPT-2 drops its position ``expand`` and
    renumbers its kind). A plan profiled at more rows whose replicas run one row each (a 3D
    plan's global batch split over dp and m) is moved onto the one-row graph by node name
    (:func:`autopart.codegen.plan_for_graph`); every rank does the same on the same graph.

    Args:
        model: the model.
        args, kwargs: example inputs of the planned batch (a 3D plan's global batch, or one
            replica's share of it).
        plan: the plan (its ``batch_size``, ``dp`` and ``num_microbatches``).
        profiled: the capture the profile was taken on, or None (a replayed plan, or a plan
            solved on another rank).
        timings: seconds per phase; ``capture_s`` grows by this capture's time.

    Returns:
        ``(plan, captured)``: the plan for the graph of one microbatch of one replica, and
        that graph.

    Raises:
        PlanError: the inputs' batch is neither the plan's nor one replica's share of it; at
            one row, a cut of the plan not found by name in the one-row graph.
        TraceError: the model cannot be captured.
    """
    batch = batch_size(args, kwargs)
    replica = plan.batch_size // plan.dp  # a 3D plan's batch is global, over dp replicas
    if batch not in (plan.batch_size, replica):
        also = f" (or one replica's {replica})" if plan.dp > 1 else ""
        raise PlanError(f"the plan was made for batch {plan.batch_size}{also}, the example "
                        f"inputs have batch {batch}; pass example inputs of the planned batch "
                        "or re-plan")
    args, kwargs, _ = replica_share(plan, 0, args, kwargs)  # any replica's rows will do
    args, kwargs, _ = context_inputs(model, plan.cp, args, kwargs)
    rows = replica // plan.num_microbatches
    if profiled is not None and profiled.batch_size == rows:
        return plan, profiled
    t0 = time.perf_counter()
    mb_args, mb_kwargs = microbatch_inputs(args, kwargs, plan.num_microbatches)
    if on_meta(model):
        mb_args, mb_kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"),
                                                  (mb_args, mb_kwargs))
    with phase("capture"):
        captured = capture(model, mb_args, mb_kwargs)
    timings["capture_s"] = timings.get("capture_s", 0.0) + time.perf_counter() - t0
    if rows == 1 and captured.fingerprint != plan.graph_fingerprint:
        plan = plan_for_graph(plan, captured)
    return plan, captured
