"""autopart.compile: capture, profile, solve, split and wrap a model as a pipeline."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from autopart.capture import CapturedGraph, capture, op_nodes
from autopart.cluster import PRESETS, Cluster, DeviceSpec
from autopart.codegen.params import build_stage_modules
from autopart.codegen.split import split_graph
from autopart.errors import PlanError
from autopart.microbatch import split_leaves
from autopart.pipelined import PipelinedModule
from autopart.plan import OPTIMIZE_TARGETS, Plan

__all__ = ["compile", "cluster_for_devices", "library_versions"]

_CUDA_PRESETS = (("H200", "h200"), ("H100", "h100-sxm"), ("A100-SXM4-80GB", "a100-80gb"),
                 ("A100 80GB", "a100-80gb"), ("A100", "a100-40gb"), ("L4", "l4"))


def library_versions() -> dict[str, str]:
    """Versions a plan records: torch and autopart (the solver adds ortools)."""
    import autopart

    return {"torch": torch.__version__, "autopart": autopart.__version__}


def cluster_for_devices(devices: list[str]) -> Cluster:
    """A Cluster for runtime device strings: ``"cpu"`` takes the ``cpu`` preset; a CUDA device
    takes the preset its name matches (H100, H200, A100, L4) with the memory it reports."""
    specs: list[DeviceSpec] = []
    for name in devices:
        dev = torch.device(name)
        if dev.type == "cpu":
            specs.append(PRESETS["cpu"])
            continue
        if dev.type != "cuda":
            raise PlanError(f"device {name!r}: only 'cpu' and 'cuda:N' devices are supported")
        props = torch.cuda.get_device_properties(dev)
        preset = next((PRESETS[p] for key, p in _CUDA_PRESETS if key in props.name), PRESETS["l4"])
        specs.append(dataclasses.replace(preset, name=props.name.replace(" ", "-").lower(),
                                         memory_bytes=int(props.total_memory)))
    return Cluster(tuple(specs), tuple(devices))


def _resolve_devices(devices: list[str] | None, num_stages: int | None) -> list[str]:
    if devices is None:
        if torch.cuda.is_available() and num_stages is None:
            return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
        if torch.cuda.is_available() and num_stages is not None \
                and num_stages <= torch.cuda.device_count():
            return [f"cuda:{i}" for i in range(num_stages)]
        if num_stages is None:
            raise PlanError("no GPU is visible, so pass num_stages=S (stages run on 'cpu') "
                            "or devices=[...]")
        return ["cpu"] * num_stages
    devices = [str(d) for d in devices]
    if not devices:
        raise PlanError("devices is empty; pass at least one device, e.g. ['cuda:0', 'cuda:1']")
    if num_stages is not None and num_stages != len(devices):
        raise PlanError(f"num_stages={num_stages} but {len(devices)} devices were given; this "
                        "version runs one stage per device: make them equal")
    for d in devices:
        dev = torch.device(d)
        if dev.type == "cuda" and (not torch.cuda.is_available()
                                   or (dev.index or 0) >= torch.cuda.device_count()):
            raise PlanError(f"device {d!r} is not available (visible CUDA devices: "
                            f"{torch.cuda.device_count()}); use 'cpu' or a visible GPU")
    return devices


def _microbatch_inputs(args: tuple[Any, ...], kwargs: dict[str, Any], m: int,
                       ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    leaves, spec = pytree.tree_flatten((args, kwargs))
    first = split_leaves(leaves, m)[0]
    mb_args, mb_kwargs = pytree.tree_unflatten(first, spec)
    return tuple(mb_args), dict(mb_kwargs)


def _state_layout(model: nn.Module) -> tuple[list[tuple[str, str]], list[str], list[str]]:
    """(state_dict key, canonical FQN) pairs, canonical parameter order, canonical buffer order."""
    canon: dict[int, str] = {}
    params, buffers = [], []
    for name, p in model.named_parameters():
        canon[id(p)] = name
        params.append(name)
    for name, b in model.named_buffers():
        if id(b) not in canon:
            canon[id(b)] = name
            buffers.append(name)
    keys = [(k, canon[id(v)]) for k, v in model.state_dict(keep_vars=True).items() if id(v) in canon]
    return keys, params, buffers


def compile(model: nn.Module, example_inputs: tuple[Any, ...] = (), *,
            example_kwargs: dict[str, Any] | None = None,
            loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
            devices: list[str] | None = None, num_stages: int | None = None,
            num_microbatches: int | None = None, optimize: str = "speed",
            plan: Plan | str | os.PathLike[str] | None = None,
            time_limit_s: float = 10.0) -> PipelinedModule:
    """Partition ``model`` into pipeline stages and return a module that runs them.

    Steps: capture with ``torch.export`` (non-strict) at the full batch, measure every
    node's cost on ``devices[0]``, let the CP-SAT solver choose the cuts and the number of
    microbatches, capture again at the microbatch size, split the graph into one
    ``fx.GraphModule`` per stage and place each on its device. With ``plan=`` the profile
    and solve steps are skipped and the plan's cuts and microbatch count are replayed.

    Args:
        model: the model; its parameters are shared with the pipeline (not copied) where
            the stage's device is the one they are on. Dropout draws different numbers per
            microbatch, so compare against the unpartitioned model with dropout off;
            BatchNorm statistics depend on the microbatch (as in GPipe).
        example_inputs: positional inputs, tensors ``(batch, ...)``.
        example_kwargs: keyword inputs.
        loss_fn: ``(output, target) -> scalar``; ``None`` = inference only.
        devices: one device string per stage; default: the visible GPUs, else
            ``["cpu"] * num_stages``.
        num_stages: default ``len(devices)``.
        num_microbatches: m; ``None`` lets the solver choose among the batch's divisors.
        optimize: ``"speed"`` (least step time) or ``"memory"`` (least peak memory).
        plan: a :class:`Plan` or a path to a plan file to replay without solving.
        time_limit_s: CP-SAT time limit per solve, seconds (default 10).

    Returns:
        The :class:`PipelinedModule`.

    Raises:
        TraceError: the model cannot be captured.
        PlanError: bad arguments, or a plan that does not match this model.
        InfeasiblePlanError: no partition fits the devices' memory.
    """
    if optimize not in OPTIMIZE_TARGETS:
        raise PlanError(f"optimize={optimize!r}; expected one of {OPTIMIZE_TARGETS}")
    kwargs = dict(example_kwargs or {})
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    timings: dict[str, float] = {}
    full_capture: CapturedGraph | None = None
    if plan is not None:
        loaded = plan if isinstance(plan, Plan) else Plan.load(plan)
        device_names = _resolve_devices(devices, num_stages or loaded.num_stages)
        if len(device_names) != loaded.num_stages:
            raise PlanError(f"the plan has {loaded.num_stages} stages but {len(device_names)} "
                            "devices were given; pass as many devices as stages")
        the_plan = loaded
    else:
        device_names = _resolve_devices(devices, num_stages)
        the_plan, full_capture = _solve(model, example_inputs, kwargs, device_names,
                                        num_microbatches, optimize, loss_fn is not None,
                                        time_limit_s, timings)
    m = the_plan.num_microbatches
    batch = _batch_size(example_inputs, kwargs)
    if batch != the_plan.batch_size:
        raise PlanError(f"the plan was made for batch {the_plan.batch_size}, the example inputs "
                        f"have batch {batch}; pass example inputs of the planned batch or re-plan")
    t0 = time.perf_counter()
    mb_args, mb_kwargs = _microbatch_inputs(example_inputs, kwargs, m)
    # The graph is specialised to its input shapes: stages run at the microbatch size.
    reuse = full_capture is not None and full_capture.batch_size == batch // m
    captured = full_capture if reuse and full_capture is not None else capture(
        model, mb_args, mb_kwargs)
    timings["capture_s"] = timings.get("capture_s", 0.0) + time.perf_counter() - t0
    t0 = time.perf_counter()
    _check_plan_matches(the_plan, captured)
    stage_graphs = split_graph(captured, [c.position for c in the_plan.cuts])
    torch_devices = [torch.device(d) for d in device_names]
    modules, placement = build_stage_modules(captured, stage_graphs, torch_devices)
    state_keys, param_order, buffer_order = _state_layout(model)
    used = set(placement.owner)
    unused = {fqn: t for fqn, t in list(model.named_parameters()) + list(model.named_buffers())
              if fqn not in used}
    mb_leaves = pytree.tree_leaves((mb_args, mb_kwargs))
    shapes = [tuple(t.shape) if isinstance(t, torch.Tensor) and t.dim() > 0 else None
              for t in mb_leaves]
    pipe = PipelinedModule(
        plan=the_plan, stages=modules, devices=torch_devices, placement=placement,
        in_spec=captured.in_spec, out_spec=captured.out_spec, input_shapes=shapes,
        microbatch_size=batch // m, state_keys=state_keys, param_order=param_order,
        buffer_order=buffer_order, unused=unused, loss_fn=loss_fn, timings_s=timings)
    timings["codegen_s"] = time.perf_counter() - t0
    return pipe


def _check_plan_matches(plan: Plan, captured: CapturedGraph) -> None:
    if plan.graph_fingerprint != captured.fingerprint:
        raise PlanError(f"the plan was made for graph {plan.graph_fingerprint}, this model "
                        f"captures as {captured.fingerprint}: a different model or config; "
                        "re-plan (call compile without plan=)")
    names = [n.name for n in op_nodes(captured.graph_module.graph)]
    for cut in plan.cuts:
        if not 1 <= cut.position < len(names) or names[cut.position - 1] != cut.after_node \
                or names[cut.position] != cut.before_node:
            raise PlanError(f"plan cut at position {cut.position} expects nodes "
                            f"{cut.after_node!r} | {cut.before_node!r}, the model has "
                            f"{len(names)} op nodes there; re-plan for this model")


def _solve(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
           device_names: list[str], num_microbatches: int | None, optimize: str,
           training: bool, time_limit_s: float, timings: dict[str, float],
           ) -> tuple[Plan, CapturedGraph]:
    """Capture, profile and solve. Returns the plan and the capture it was made from.

    With ``num_microbatches`` given, the model is captured and profiled at the microbatch
    size, so the same capture serves code generation. Otherwise it is captured at the full
    batch and the solver picks m among the divisors that leave microbatches of at least 2
    rows (export specialises size-1 dimensions, which can change the graph).
    """
    from autopart.profiler import profile_graph
    from autopart.solver import SolveOptions, solve

    t0 = time.perf_counter()
    batch = _batch_size(args, kwargs)
    if num_microbatches is not None:
        if num_microbatches < 1 or batch % num_microbatches:
            raise PlanError(f"num_microbatches={num_microbatches} must be >= 1 and divide the "
                            f"batch of {batch}")
        args, kwargs = _microbatch_inputs(args, kwargs, num_microbatches)
        candidates = None
    else:
        candidates = tuple(m for m in range(1, batch + 1)
                           if batch % m == 0 and (batch // m >= 2 or batch == 1))
    captured = capture(model, args, kwargs)
    timings["capture_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    flat = captured.flatten_inputs(args, kwargs)
    costs = profile_graph(captured, flat, device=device_names[0], training=training)
    timings["profile_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    options = SolveOptions(num_stages=len(device_names), batch_size=batch,
                           num_microbatches=num_microbatches, microbatch_candidates=candidates,
                           optimize=optimize, training=training, time_limit_s=time_limit_s,
                           library_versions=library_versions())
    plan = solve(costs, cluster_for_devices(device_names), options)
    timings["solve_s"] = time.perf_counter() - t0
    return plan, captured


def _batch_size(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    for leaf in pytree.tree_leaves((args, kwargs)):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    raise PlanError("no tensor input with a batch dimension; pass at least one tensor whose "
                    "dim 0 is the batch")
