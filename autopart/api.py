"""autopart.compile: capture, profile, solve, split and wrap a model as a pipeline."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from autopart.codegen.params import build_stage_modules
from autopart.codegen.split import split_graph
from autopart.core.capture import CapturedGraph, capture, op_nodes
from autopart.core.cluster import PRESETS, Cluster, DeviceSpec
from autopart.core.costgraph import CostGraph
from autopart.core.errors import PlanError
from autopart.core.plan import OPTIMIZE_TARGETS, Plan
from autopart.profiler.split_cost import measure_split_backward_factor
from autopart.runtime.local import PipelinedModule
from autopart.runtime.microbatch import split_leaves

if TYPE_CHECKING:
    from autopart.solver import SolveOptions

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


def _resolve_devices(devices: list[str] | None, num_ranks: int | None) -> list[str]:
    """One device string per rank.

    Raises:
        PlanError: nothing to go on (no GPU, no count), a count that differs from the
            devices given, or a CUDA device that is not visible.
    """
    if devices is None:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count and (num_ranks is None or num_ranks <= count):
            return [f"cuda:{i}" for i in range(num_ranks or count)]
        if num_ranks is None:
            raise PlanError("no GPU is visible, so pass num_stages=S (stages run on 'cpu') "
                            "or devices=[...]")
        return ["cpu"] * num_ranks
    devices = [str(d) for d in devices]
    if not devices:
        raise PlanError("devices is empty; pass at least one device, e.g. ['cuda:0', 'cuda:1']")
    if num_ranks is not None and num_ranks != len(devices):
        raise PlanError(f"the plan has {num_ranks} ranks but {len(devices)} devices were "
                        "given; pass one device per rank")
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
            schedule: str | None = None, stages_per_rank: int | None = None,
            recompute: bool | None = None, fuse: bool = False,
            backend: str | None = None, checkpoint: str | os.PathLike[str] | None = None,
            mesh: Any = None, time_limit_s: float = 10.0) -> Any:
    """Partition ``model`` into pipeline stages and return a module that runs them.

    Steps: capture with ``torch.export`` (non-strict), measure every node's cost on the
    first device, let the CP-SAT solver choose the cuts, the number of microbatches, the
    schedule, the virtual stages per rank and recompute (any of them can be fixed by the
    arguments below), split the graph into one ``fx.GraphModule`` per stage and place each
    on its rank's device. With ``plan=`` the profile and solve steps are skipped and the
    plan is replayed.

    Args:
        model: the model; its parameters are shared with the pipeline (not copied) where
            the stage's device is the one they are on. Dropout draws different numbers per
            microbatch, so compare against the unpartitioned model with dropout off;
            BatchNorm statistics depend on the microbatch (as in GPipe).
        example_inputs: positional inputs, tensors ``(batch, ...)``.
        example_kwargs: keyword inputs.
        loss_fn: ``(output, target) -> scalar``; ``None`` = inference only.
        devices: one device string per rank; default: the visible GPUs, else
            ``["cpu"] * ranks`` with ``ranks = num_stages // stages_per_rank``.
        num_stages: total stages S (``ranks * stages_per_rank``); default ``len(devices)``
            times the chosen stages per rank. Giving it fixes ``stages_per_rank``.
        num_microbatches: m; ``None`` lets the solver choose among the batch's divisors.
        optimize: ``"speed"`` (least step time) or ``"memory"`` (least peak memory).
        plan: a :class:`Plan` or a path to a plan file to replay without solving.
        schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"`` or ``"zero_bubble"``;
            ``None`` lets the solver choose.
        stages_per_rank: v virtual stages per rank (interleaving); ``None``: solver's choice.
        recompute: recompute activations in backward on every stage (``True``), on none
            (``False``), or where the solver decides (``None``).
        fuse: compile each stage with ``torch.compile`` (Inductor); the compile time is
            reported in ``pipe.timings_s["fuse_s"]`` (compilation happens on first call).
        backend: ``"local"`` (one process) or ``"distributed"`` (this process is one rank of
            a ``torchrun`` launch; it builds only its own stages, see
            :class:`autopart.runtime.distributed.DistributedPipeline`). Default: distributed when a
            process group with more than one rank is initialised, else local.
        checkpoint: distributed only: a ``pipe.save`` directory each rank loads its own
            stages' weights from, so a model built on the ``meta`` device never materialises
            whole. Without it, a meta model's modules that this rank needs are initialised
            (``reset_parameters`` / Hugging Face ``_init_weights``).
        mesh: distributed only: a 2-D ``DeviceMesh`` with dims ``("pp", "dp")``: stages go
            along ``pp``; gradients are averaged across ``dp`` replicas of each stage.
        time_limit_s: CP-SAT time limit per solve, seconds (default 10).

    Returns:
        The :class:`PipelinedModule` (local) or :class:`DistributedPipeline` (distributed).

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
    if backend is None:
        import torch.distributed as dist

        backend = ("distributed" if dist.is_available() and dist.is_initialized()
                   and dist.get_world_size() > 1 else "local")
    if backend not in ("local", "distributed"):
        raise PlanError(f"backend={backend!r}; expected 'local' or 'distributed'")
    if backend == "distributed":
        from autopart.runtime.launch import compile_distributed

        return compile_distributed(model, example_inputs, kwargs, loss_fn=loss_fn, plan=plan,
                                   num_microbatches=num_microbatches, schedule=schedule,
                                   stages_per_rank=stages_per_rank, recompute=recompute,
                                   optimize=optimize, checkpoint=checkpoint,
                                   mesh=mesh, time_limit_s=time_limit_s)
    if plan is not None:
        the_plan = plan if isinstance(plan, Plan) else Plan.load(plan)
        device_names = _resolve_devices(devices, len(the_plan.ranks))
    else:
        device_names, v = _ranks_and_v(devices, num_stages, stages_per_rank)
        choices = {"schedule_kind": schedule, "stages_per_rank": v, "recompute": recompute}
        the_plan, full_capture = _solve(model, example_inputs, kwargs, device_names,
                                        num_microbatches, optimize, loss_fn is not None,
                                        time_limit_s, timings, choices)
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
    return build_pipeline(model, captured, the_plan, device_names, loss_fn=loss_fn,
                          fuse=fuse, timings=timings)


def build_pipeline(model: nn.Module, captured: CapturedGraph, plan: Plan, device_names: list[str],
                   *, loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
                   fuse: bool = False, timings: dict[str, float] | None = None,
                   ) -> PipelinedModule:
    """Split ``captured`` as ``plan`` says and wrap the stages (the codegen half of compile).

    Args:
        model: the model ``captured`` was captured from (for its parameter names).
        captured: the model captured at the plan's microbatch size.
        plan: the plan to follow; stage ``s`` runs on ``device_names[plan.stages[s].rank]``.
        device_names: one device per rank.

    Raises:
        PlanError: the plan does not match the captured graph or the device count.
    """
    timings = {} if timings is None else timings
    if len(device_names) != len(plan.ranks):
        raise PlanError(f"the plan has {len(plan.ranks)} ranks but {len(device_names)} devices "
                        "were given; pass one device per rank")
    t0 = time.perf_counter()
    _check_plan_matches(plan, captured)
    stage_graphs = split_graph(captured, [c.position for c in plan.cuts])
    torch_devices = [torch.device(device_names[st.rank]) for st in plan.stages]
    built, placement = build_stage_modules(captured, stage_graphs, torch_devices)
    modules = [mod for mod in built if mod is not None]
    state_keys, param_order, buffer_order = _state_layout(model)
    used = set(placement.owner)
    unused = {fqn: t for fqn, t in list(model.named_parameters()) + list(model.named_buffers())
              if fqn not in used}
    examples = [n.meta.get("val") for n in captured.graph_module.graph.nodes
                if n.op == "placeholder"]  # one per flattened input, in call order
    shapes = [tuple(t.shape) if isinstance(t, torch.Tensor) and t.dim() > 0 else None
              for t in examples]
    runners: list[nn.Module] = list(modules)
    if fuse:
        t1 = time.perf_counter()
        runners = [torch.compile(mod) for mod in modules]  # type: ignore[misc]
        timings["fuse_s"] = time.perf_counter() - t1
    pipe = PipelinedModule(
        plan=plan, stages=modules, runners=runners, devices=torch_devices, placement=placement,
        in_spec=captured.in_spec, out_spec=captured.out_spec, input_shapes=shapes,
        microbatch_size=captured.batch_size, state_keys=state_keys, param_order=param_order,
        buffer_order=buffer_order, unused=unused, loss_fn=loss_fn, timings_s=timings)
    timings["codegen_s"] = time.perf_counter() - t0
    return pipe


def _ranks_and_v(devices: list[str] | None, num_stages: int | None,
                 stages_per_rank: int | None) -> tuple[list[str], int | None]:
    """Device per rank, and the stages per rank fixed by the arguments (None: solver's)."""
    if stages_per_rank is not None and stages_per_rank < 1:
        raise PlanError(f"stages_per_rank={stages_per_rank} must be >= 1")
    if devices is not None:
        names = _resolve_devices(devices, None)
        if num_stages is None:
            return names, stages_per_rank
        if num_stages % len(names) or (stages_per_rank is not None
                                       and num_stages != len(names) * stages_per_rank):
            raise PlanError(f"num_stages={num_stages} does not equal {len(names)} devices x "
                            f"stages_per_rank={stages_per_rank or num_stages / len(names):g}; "
                            "pass num_stages = devices x stages_per_rank")
        return names, num_stages // len(names)
    v = stages_per_rank or 1
    if num_stages is not None and num_stages % v:
        raise PlanError(f"num_stages={num_stages} is not a multiple of stages_per_rank={v}")
    ranks = None if num_stages is None else num_stages // v
    names = _resolve_devices(None, ranks)
    return names, (v if num_stages is not None or stages_per_rank is not None else None)


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
           choices: dict[str, Any] | None = None) -> tuple[Plan, CapturedGraph]:
    """Capture, profile and solve. Returns the plan and the capture it was made from."""
    from autopart.solver import solve

    fixed = {k: v for k, v in (choices or {}).items() if v is not None}
    # the split cost matters only where the solver may still pick zero_bubble (v = 1)
    may_split = (fixed.get("stages_per_rank", 1) == 1
                 and fixed.get("schedule_kind", "zero_bubble") == "zero_bubble")
    measured = _measure(model, args, kwargs, device_names, num_microbatches, training, timings,
                        split_cost=may_split)
    t0 = time.perf_counter()
    plan = solve(measured.costs, cluster_for_devices(device_names),
                 measured.options(optimize=optimize, time_limit_s=time_limit_s, **fixed))
    timings["solve_s"] = time.perf_counter() - t0
    return plan, measured.captured


@dataclasses.dataclass(frozen=True)
class _Measured:
    """What the solver needs about one model on one device: its capture, measured costs and
    the cost of splitting backward into I and W (1.0 when not measured)."""

    captured: CapturedGraph
    costs: CostGraph
    batch_size: int
    num_microbatches: int | None
    microbatch_candidates: tuple[int, ...] | None
    training: bool
    split_backward_factor: float

    def options(self, **choices: Any) -> SolveOptions:
        """``SolveOptions`` for these measurements; ``choices`` fixes or sets the rest
        (``optimize``, ``time_limit_s``, ``schedule_kind``, ``stages_per_rank``, ...)."""
        from autopart.solver import SolveOptions

        return SolveOptions(batch_size=self.batch_size, num_microbatches=self.num_microbatches,
                            microbatch_candidates=self.microbatch_candidates,
                            training=self.training, library_versions=library_versions(),
                            split_backward_factor=self.split_backward_factor, **choices)


def _measure(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
             device_names: list[str], num_microbatches: int | None, training: bool,
             timings: dict[str, float], *, split_cost: bool = True) -> _Measured:
    """Capture and profile ``model`` on ``device_names[0]``; times go into ``timings``.

    With ``num_microbatches`` given, the model is captured and profiled at the microbatch
    size, so the same capture serves code generation. Otherwise it is captured at the full
    batch and the solver picks m among the divisors that leave microbatches of at least 2
    rows (export specialises size-1 dimensions, which can change the graph). With
    ``split_cost`` (and training on more than one rank) the zero-bubble I/W split factor is
    measured too (``autopart.profiler.split_cost``).

    Raises:
        PlanError: ``num_microbatches`` is < 1 or does not divide the batch.
        TraceError: the model cannot be captured.
        ProfileError: a node fails to run on the device.
    """
    from autopart.profiler import profile_graph

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
    split_factor = 1.0
    if split_cost and training and len(device_names) > 1:
        t0 = time.perf_counter()
        split_factor = measure_split_backward_factor(captured, flat, costs, device_names[0])
        timings["split_cost_s"] = time.perf_counter() - t0
    return _Measured(captured, costs, batch, num_microbatches, candidates, training, split_factor)


def _batch_size(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    for leaf in pytree.tree_leaves((args, kwargs)):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    raise PlanError("no tensor input with a batch dimension; pass at least one tensor whose "
                    "dim 0 is the batch")
