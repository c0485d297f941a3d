"""The plan step: the plan a compile runs, replayed as given or profiled and solved here
(one process), or on global rank 0 and sent to every rank (a torchrun world)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autopart.core.capture import CapturedGraph, on_meta
from autopart.core.errors import PlanError
from autopart.core.jsonio import dumps
from autopart.core.plan import Plan
from autopart.layout_planning import plan_layout
from autopart.options import CompileOptions
from autopart.planning import Profile, plan_model
from autopart.runtime.distributed import launch

__all__ = ["choose_plan", "Loss"]

#: ``(loss_fn, example_target)``: ``loss_fn(output, target) -> scalar`` or None (inference).
Loss = tuple[Callable[[Any, Any], torch.Tensor] | None, Any]


def choose_plan(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], loss: Loss,
                plan: Plan | None, options: CompileOptions, backend: str,
                timings: dict[str, float]) -> tuple[Plan, CapturedGraph | None]:
    """The plan to build: ``plan`` when given (replayed), else one profiled and solved for
    ``model`` on ``args, kwargs``.

    One process (``backend="local"``): :func:`autopart.planning.plan_model` on
    ``options.devices``. A torchrun world (``"distributed"``): global rank 0 profiles and
    solves on a materialised model and sends the plan to every rank as JSON, so all ranks
    follow one decision: with ``tp``, ``dp``, ``zero_stage`` or ``layout_search`` given, a
    (tp, pp, dp, ZeRO) layout of the world's ranks (:func:`autopart.layout_planning.
    plan_layout`, the example inputs being the global batch), else a pipeline over the ranks
    of the pp group (the world, or the mesh's ``pp`` dimension). Whether the world (or
    ``options.mesh``) fits the plan's layout is the build step's check.

    Args:
        model: the model (materialised where this process profiles it).
        args, kwargs: example inputs, tensors ``(batch, ...)``.
        loss: ``(loss_fn, example_target)``.
        plan: the plan to replay, or None.
        options: the choices.
        backend: ``"local"`` or ``"distributed"``.
        timings: seconds per phase, updated with the profile's (capture, profiling, solve).

    Returns:
        ``(plan, captured)``: ``captured`` is the graph this process profiled (None where
        nothing was profiled here), for the capture step to reuse.

    Raises:
        PlanError: no process group for the distributed backend; choices the search does
            not take (``mesh`` or ``num_stages`` with a layout search; ``num_stages`` not a
            multiple of the pp ranks); a ``meta`` model to profile.
        InfeasiblePlanError: nothing fits the devices' memory.
        TraceError, ProfileError: capture or profiling failed.
    """
    distributed = backend != "local"
    if distributed:
        launch.require_process_group()
    profile = None
    if plan is None:
        world = _world_request(options) if distributed else None  # checked on every rank
        if not distributed or dist.get_rank() == 0:
            plan, profile = _solve(model, args, kwargs, loss, options, world)
            timings.update(profile.timings_s)
        if distributed:
            plan = _broadcast_plan(plan)  # global rank 0's, to every rank
    assert plan is not None
    return plan, profile.captured if profile is not None else None


def _world_request(options: CompileOptions) -> tuple[str, ...]:
    """What rank 0 is asked to plan for the torchrun world: ``()`` for a (tp, pp, dp, ZeRO)
    layout search (``tp``, ``dp``, ``zero_stage`` or ``layout_search`` given), else the
    devices of the pp ranks to pipeline over (the world, or the mesh's ``pp`` dimension).
    Every rank checks it, so a refused request fails on all of them rather than leave them
    waiting for rank 0's plan.

    Raises:
        PlanError: ``mesh`` or ``num_stages`` with a layout search; ``num_stages`` not a
            multiple of the pp ranks.
    """
    if options.layout_search or options.ep != 1 or options.cp != 1 or any(
            v is not None for v in (options.tp, options.dp, options.zero_stage)):
        _check_layout_request(options)
        return ()
    mesh = options.mesh
    pp_size = dist.get_world_size(mesh.get_group("pp") if mesh is not None else None)
    if options.num_stages is not None and options.num_stages % pp_size:
        raise PlanError(f"num_stages={options.num_stages} is not a multiple of the "
                        f"{pp_size} pipeline ranks; pass num_stages = ranks x stages_per_rank")
    device = launch.rank_device()
    return (("cpu",) * pp_size if device.type == "cpu"
            else tuple(f"cuda:{i}" for i in range(pp_size)))


def _solve(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], loss: Loss,
           options: CompileOptions, world: tuple[str, ...] | None) -> tuple[Plan, Profile]:
    """Profile ``model`` here and solve: for ``options.devices`` in this process (``world``
    None), for the pp ranks ``world`` names (a pipeline for ranks that are processes), or
    (``world == ()``) a (tp, pp, dp, ZeRO) layout of the torchrun world.

    Raises:
        PlanError: a ``meta`` model under torchrun (nothing to measure), or bad choices.
    """
    loss_fn, example_target = loss
    state_factor = options.state_factor(model)
    if world is not None and on_meta(model):
        raise PlanError("a meta-device model cannot be profiled here; plan it first "
                        "(autopart.plan_model on a materialised copy, or `autopart "
                        "plan`) and pass plan=")
    if world == ():
        return plan_layout(model, args, kwargs, world=dist.get_world_size(),
                           device=launch.rank_device().type, options=options,
                           loss_fn=loss_fn, example_target=example_target,
                           state_factor=state_factor)
    distributed = world is not None
    return plan_model(model, args, example_kwargs=kwargs, devices=world or options.devices,
                      loss_fn=loss_fn, example_target=example_target,
                      num_stages=options.num_stages, num_microbatches=options.num_microbatches,
                      optimize=options.optimize or "speed", schedule_kind=options.schedule_kind,
                      stages_per_rank=options.stages_per_rank, recompute=options.recompute,
                      training=loss_fn is not None, time_limit_s=options.time_limit_s,
                      optimizer_state_bytes_per_param_byte=state_factor,
                      backend="distributed" if distributed else "local",
                      issue_threads=options.issue_threads, fuse=options.fuse,
                      cuda_graphs=options.cuda_graphs and not distributed,
                      recompute_policy=options.solve_recompute_policy())


def _check_layout_request(options: CompileOptions) -> None:
    """Refuse choices the layout search does not take.

    Raises:
        PlanError: ``mesh`` (autopart builds the mesh from the plan it chooses) or
            ``num_stages`` (the search chooses pp; fix it through tp and dp).
    """
    if options.mesh is not None:
        raise PlanError("mesh= with tp=/dp=/zero_stage=: autopart builds the (pp, dp, tp) mesh "
                        "from the layout it chooses; drop mesh=, or drop tp=/dp=/zero_stage= "
                        "to plan a pipeline on your mesh")
    if options.num_stages is not None:
        raise PlanError(f"num_stages={options.num_stages} with tp=/dp=/zero_stage=: the layout "
                        "search chooses pp; fix it through tp= and dp= (pp = ranks / (tp x dp)) "
                        "and stages_per_rank=")


def _broadcast_plan(plan: Plan | None) -> Plan:
    """Global rank 0's ``plan`` on every rank, sent as JSON bytes (validated on receipt by
    :meth:`Plan.from_dict`, never pickled); the other ranks pass None."""
    payload = dumps(plan.to_dict()).encode() if plan is not None else b""
    size = torch.tensor([len(payload)], dtype=torch.int64)
    dist.broadcast(size, src=0)
    data = torch.zeros(int(size.item()), dtype=torch.uint8)
    if plan is not None:
        data.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    dist.broadcast(data, src=0)
    return Plan.from_dict(json.loads(bytes(data.tolist()).decode()))
