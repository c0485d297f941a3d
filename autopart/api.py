"""autopart.compile and autopart.load: plan (or replay), build the stages, hand them to a runtime."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn

from autopart.codegen import TensorParallelRank, build_stages
from autopart.core.capture import CapturedGraph, capture
from autopart.core.errors import PlanError
from autopart.core.plan import Plan
from autopart.core.progress import phase, progress
from autopart.core.signature import InputSignature, batch_size, microbatch_inputs
from autopart.devices import plan_devices
from autopart.layout_planning import plan_layout
from autopart.lazy import LazyPipeline, _say, plan_summary
from autopart.options import CompileOptions, optimizer_state_factor, renamed_choices
from autopart.planning import plan_model
from autopart.runtime import launch
from autopart.runtime.checkpoint import checkpoint_plan, checkpoint_tensors, load_checkpoint
from autopart.runtime.distributed import DistributedPipeline
from autopart.runtime.heartbeat import DEFAULT_STEP_TIMEOUT_S
from autopart.runtime.local import PipelinedModule
from autopart.runtime.mesh import mesh_groups, replica_share
from autopart.runtime.pipeline import Pipeline

__all__ = ["compile", "load"]

LossFn = Callable[[Any, Any], torch.Tensor]


def compile(model: nn.Module, example_inputs: tuple[Any, ...] = (), *,
            example_kwargs: dict[str, Any] | None = None, loss_fn: LossFn | None = None,
            example_target: Any = None, plan: Plan | str | os.PathLike[str] | None = None,
            options: CompileOptions | None = None, **choices: Any) -> Pipeline | LazyPipeline:
    """Partition ``model`` into pipeline stages and return a pipeline that runs them.

    Steps: capture with ``torch.export`` (non-strict), measure every node's cost on the
    first device, let the CP-SAT solver choose the cuts, the number of microbatches, the
    schedule, the virtual stages per rank and recompute (any of them can be fixed), build
    one ``fx.GraphModule`` per stage with :func:`autopart.codegen.build_stages` and hand
    them to a runtime. With ``plan=`` the profile and solve steps are skipped and the plan
    is replayed; a choice that contradicts it is refused.

    Args:
        model: the model; its parameters are shared with the pipeline (not copied) where
            the stage's device is the one they are on. Dropout draws different numbers per
            microbatch, so compare against the unpartitioned model with dropout off;
            BatchNorm statistics depend on the microbatch (as in GPipe).
        example_inputs: positional inputs, tensors ``(batch, ...)``. Default ``()`` with no
            ``example_kwargs``: plan at the first ``train_step`` or forward call, on its batch,
            and return a :class:`autopart.lazy.LazyPipeline` (a batch of another shape later
            gets its own pipeline on the same plan's cuts and parameters).
        example_kwargs: keyword inputs.
        loss_fn: ``(output, target) -> scalar``; ``None`` = inference only.
        example_target: a target for ``example_inputs`` (the full batch): the loss's own
            time and memory on the last stage are then measured, not estimated
            (:mod:`autopart.profiler.loss_cost`). Default None (a lazy pipeline uses the
            first ``train_step``'s target).
        plan: a :class:`Plan` or a path to a plan file to replay without solving.
        options: the choices as one :class:`autopart.CompileOptions`; or pass them as
            keywords (not both):
        **choices: the fields of :class:`autopart.CompileOptions`: ``devices`` (one per
            rank; default the visible GPUs, else ``["cpu"] * ranks``), ``num_stages`` (S =
            ranks x stages_per_rank), ``num_microbatches`` (m), ``optimize`` (``"speed"``
            or ``"memory"``), ``schedule_kind`` (``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"``,
            ``"zero_bubble"``, ``"zbv"``, ``"dualpipev"``; ``schedule=`` is accepted as its
            older name),
            ``issue_threads`` (local: 1 host thread issues every stage, default; None: a
            worker thread per rank), ``cuda_graphs`` (local: replay CUDA stages as graphs),
            ``stages_per_rank`` (v), ``recompute`` (True / False /
            None: per stage), ``fuse`` (``torch.compile`` each stage; compile time in
            ``pipe.timings_s["fuse_s"]`` covers wrapping, compilation runs on first call),
            ``backend`` (``"local"``: one process; ``"distributed"``: this process is one
            rank of a ``torchrun`` launch and builds only its own stages; default
            distributed inside an initialised process group of more than one rank; under
            ``torchrun`` with no group yet one is initialised first, gloo on CPU and NCCL
            on GPU, see :func:`autopart.runtime.launch.init_from_env`, unless
            ``backend="local"``), ``checkpoint`` (distributed: a ``pipe.save`` directory
            each rank loads its own weights from, so a ``meta`` model never materialises
            whole; without it a meta model's modules this rank needs are initialised),
            ``mesh`` (distributed: a ``DeviceMesh`` with dims ``("pp", "dp")`` or ``("pp",
            "dp", "tp")``; default: built from the plan, :mod:`autopart.runtime.mesh`),
            ``tp``, ``dp``, ``zero_stage`` (distributed: any of them given, or
            ``layout_search=True``, makes rank 0 choose the (tp, pp, dp, ZeRO) layout of the
            world's ranks with those fixed, the example inputs being the global batch; a
            replayed plan's layout is honoured; each dp replica then runs its rows of the
            global batch every rank passes, or the share it passes), ``time_limit_s`` (CP-SAT limit per
            solve, seconds, default 10), ``step_timeout_s`` (distributed: a pipeline send or
            receive waiting this long fails the step and names the rank that died or hangs,
            default 300). ``None`` leaves a choice to the solver.

    Returns:
        A :class:`autopart.Pipeline`: :class:`autopart.PipelinedModule` (local) or
        :class:`autopart.DistributedPipeline` (distributed); without example inputs a
        :class:`autopart.lazy.LazyPipeline` that builds one at its first call.

    Raises:
        TraceError: the model cannot be captured.
        PlanError: bad or conflicting arguments (``example_target`` without example inputs;
            an argument the backend or a replayed plan
            cannot honour names itself, its value, the plan's and the fix), or a plan that
            does not match this model.
        InfeasiblePlanError: no partition fits the devices' memory.
    """
    if options is not None and choices:
        raise PlanError(f"pass the choices either as options= or as keywords, not both (got "
                        f"options and {sorted(choices)})")
    if options is None:
        choices = renamed_choices(choices)
        if "devices" in choices and choices["devices"] is not None:
            choices["devices"] = tuple(str(d) for d in choices["devices"])
        try:
            options = CompileOptions(**choices)
        except TypeError as exc:
            raise PlanError(f"compile() got an unknown argument ({exc}); the choices are the "
                            "fields of autopart.CompileOptions") from None
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    kwargs = dict(example_kwargs or {})
    if options.backend != "local":
        launch.init_from_env()  # under torchrun without a group: make the default one
    backend = options.backend or ("distributed" if dist.is_available() and dist.is_initialized()
                                  and dist.get_world_size() > 1 else "local")
    options.check_backend(backend)
    the_plan = None
    if plan is not None:
        the_plan = plan if isinstance(plan, Plan) else Plan.load(plan)
        options.check_plan(the_plan, ranks=None if options.devices is None
                           else len(options.devices))
    options.check_runtime(the_plan, backend)
    if not args and not kwargs:  # plan at the first step, on its batch
        if example_target is not None:
            raise PlanError("example_target= goes with example_inputs=; without example inputs "
                            "compile plans at the first train_step and measures the loss with "
                            "its target")
        return _lazy(model, loss_fn, the_plan, options, backend)
    loss = (loss_fn, example_target)
    with progress():  # the phases on stderr (autopart.core.progress)
        if backend == "distributed":
            pipe = _compile_distributed(model, args, kwargs, loss, the_plan, options)
            if the_plan is None and pipe.plan.num_gpus > len(pipe.plan.ranks):  # a 3D layout
                _say(f"planned a layout for {pipe.plan.num_gpus} ranks: "
                     f"{plan_summary(pipe.plan)}")
            return pipe
        return _compile_local(model, args, kwargs, loss, the_plan, options)


def _lazy(model: nn.Module, loss_fn: LossFn | None, plan: Plan | None,
          options: CompileOptions, backend: str) -> LazyPipeline:
    """The pipeline that plans (or replays ``plan``) at its first call, on that batch."""
    distributed = backend == "distributed"

    def first_build(args: tuple[Any, ...], kwargs: dict[str, Any], target: Any) -> Pipeline:
        compile_at = _compile_distributed if distributed else _compile_local
        with progress():  # the phases on stderr (autopart.core.progress)
            return compile_at(model, args, kwargs, (loss_fn, target), plan, options)

    def rebuild(captured: CapturedGraph, the_plan: Plan,
                tensor_of: Callable[[str], torch.Tensor], cuts_by_name: bool) -> Pipeline:
        build = _distributed_pipeline if distributed else _local_pipeline
        return build(model, captured, the_plan, loss_fn, options, {}, tensor_of=tensor_of,
                     cuts_by_name=cuts_by_name)

    return LazyPipeline(model, backend=backend, first_build=first_build, rebuild=rebuild)


def _solve(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
           loss: tuple[LossFn | None, Any], options: CompileOptions,
           devices: tuple[str, ...] | None, *, distributed: bool = False,
           ) -> tuple[Plan, CapturedGraph, dict[str, float]]:
    loss_fn, example_target = loss
    training = loss_fn is not None
    plan, profile = plan_model(model, args, example_kwargs=kwargs, devices=devices,
                               loss_fn=loss_fn, example_target=example_target,
                               num_stages=options.num_stages,
                               num_microbatches=options.num_microbatches,
                               optimize=options.optimize or "speed", schedule_kind=options.schedule_kind,
                               stages_per_rank=options.stages_per_rank,
                               recompute=options.recompute, training=training,
                               time_limit_s=options.time_limit_s,
                               optimizer_state_bytes_per_param_byte=_state_factor(model, options),
                               backend="distributed" if distributed else "local",
                               issue_threads=options.issue_threads, fuse=options.fuse,
                               cuda_graphs=options.cuda_graphs and not distributed)
    return plan, profile.captured, profile.timings_s


def _state_factor(model: nn.Module, options: CompileOptions) -> float:
    """Optimizer state bytes per parameter byte for ``options.optimizer`` on this model's
    trainable parameters (their dtypes)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    return optimizer_state_factor(options.optimizer, sum(p.numel() * p.element_size()
                                                         for p in trainable),
                                  sum(p.numel() for p in trainable))


def _capture_for(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], plan: Plan,
                 profiled: CapturedGraph | None, timings: dict[str, float]) -> CapturedGraph:
    """The model captured at the plan's microbatch size (the profile's capture when it is)."""
    batch = batch_size(args, kwargs)
    replica = plan.batch_size // plan.dp  # a 3D plan's batch is global, over dp replicas
    if batch not in (plan.batch_size, replica):
        also = f" (or one replica's {replica})" if plan.dp > 1 else ""
        raise PlanError(f"the plan was made for batch {plan.batch_size}{also}, the example "
                        f"inputs have batch {batch}; pass example inputs of the planned batch "
                        "or re-plan")
    args, kwargs, _ = replica_share(plan, 0, args, kwargs)  # any replica's rows will do
    if profiled is not None and profiled.batch_size == replica // plan.num_microbatches:
        return profiled
    t0 = time.perf_counter()
    mb_args, mb_kwargs = microbatch_inputs(args, kwargs, plan.num_microbatches)
    if launch.on_meta(model):
        mb_args, mb_kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"),
                                                  (mb_args, mb_kwargs))
    with phase("capture"):
        captured = capture(model, mb_args, mb_kwargs)
    timings["capture_s"] = timings.get("capture_s", 0.0) + time.perf_counter() - t0
    return captured


def _compile_local(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                   loss: tuple[LossFn | None, Any], plan: Plan | None,
                   options: CompileOptions) -> PipelinedModule:
    profiled: CapturedGraph | None = None
    timings: dict[str, float] = {}
    if plan is None:
        plan, profiled, timings = _solve(model, args, kwargs, loss, options,
                                         options.devices)
    captured = _capture_for(model, args, kwargs, plan, profiled, timings)
    return _local_pipeline(model, captured, plan, loss[0], options, timings)


def _local_pipeline(model: nn.Module, captured: CapturedGraph, plan: Plan,
                    loss_fn: LossFn | None, options: CompileOptions, timings: dict[str, float],
                    *, tensor_of: Callable[[str], torch.Tensor] | None = None,
                    cuts_by_name: bool = False) -> PipelinedModule:
    """Build every stage of ``plan`` from ``captured`` (weights from ``tensor_of`` when
    given, see :func:`autopart.codegen.build_stages`) and wrap them for one process."""
    devices = plan_devices(plan, options.devices)
    t0 = time.perf_counter()
    with phase("codegen"):
        stages = build_stages(captured, plan, devices, fuse=options.fuse, tensor_of=tensor_of,
                              cuts_by_name=cuts_by_name)
    timings["codegen_s"] = time.perf_counter() - t0
    if options.fuse:
        timings["fuse_s"] = stages.fuse_s
    pipe = PipelinedModule(model, stages, InputSignature.of(captured), loss_fn=loss_fn,
                           timings_s=timings, issue_threads=options.issue_threads)
    pipe.cuda_graphs = options.cuda_graphs
    return pipe


def _compile_distributed(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                         loss: tuple[LossFn | None, Any], plan: Plan | None,
                         options: CompileOptions) -> DistributedPipeline:
    """One rank's share. Without a plan, global rank 0 profiles and solves (on a
    materialised model) and sends the plan to every rank as JSON, so all ranks follow one
    decision: with ``tp``, ``dp`` or ``zero_stage`` given, a (tp, pp, dp, ZeRO) layout of
    the world's ranks (:func:`autopart.layout_planning.plan_layout`, the example inputs
    being the global batch), else a pipeline over the ranks of the pp group (the world, or
    the mesh's ``pp`` dimension)."""
    loss_fn = loss[0]
    launch.require_process_group()
    mesh = options.mesh
    three_d = options.layout_search or any(v is not None for v in (options.tp, options.dp,
                                                                   options.zero_stage))
    device = launch.rank_device()
    timings: dict[str, float] = {}
    if plan is None and three_d:
        _check_layout_request(options)
        mine = None
        if dist.get_rank() == 0:
            _refuse_meta(model)
            mine, profile = plan_layout(model, args, kwargs, world=dist.get_world_size(),
                                        device=device.type, options=options, loss_fn=loss_fn,
                                        example_target=loss[1],
                                        state_factor=_state_factor(model, options))
            timings = profile.timings_s
        plan = launch.broadcast_plan(mine)  # from global rank 0 to every rank
    elif plan is None:
        pp_size = dist.get_world_size(mesh.get_group("pp") if mesh is not None else None)
        if options.num_stages is not None and options.num_stages % pp_size:
            raise PlanError(f"num_stages={options.num_stages} is not a multiple of the "
                            f"{pp_size} pipeline ranks; pass num_stages = ranks x stages_per_rank")
        mine = None
        if dist.get_rank() == 0:
            _refuse_meta(model)
            names = (["cpu"] * pp_size if device.type == "cpu"
                     else [f"cuda:{i}" for i in range(pp_size)])
            mine, _, timings = _solve(model, args, kwargs, loss, options,
                                      tuple(names), distributed=True)
        plan = launch.broadcast_plan(mine)  # from global rank 0 to every rank
    mesh_groups(plan, mesh)  # the world or the mesh fits the plan's layout (PlanError if not)
    captured = _capture_for(model, args, kwargs, plan, None, timings)
    return _distributed_pipeline(model, captured, plan, loss_fn, options, timings)


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


def _refuse_meta(model: nn.Module) -> None:
    if launch.on_meta(model):
        raise PlanError("a meta-device model cannot be profiled here; plan it first "
                        "(autopart.plan_model on a materialised copy, or `autopart "
                        "plan`) and pass plan=")


def _distributed_pipeline(model: nn.Module, captured: CapturedGraph, plan: Plan,
                          loss_fn: LossFn | None, options: CompileOptions,
                          timings: dict[str, float], *,
                          tensor_of: Callable[[str], torch.Tensor] | None = None,
                          cuts_by_name: bool = False) -> DistributedPipeline:
    """Build this rank's stages of ``plan`` from ``captured`` (weights from ``tensor_of``
    when given, else the checkpoint option, else the model's, materialised from ``meta``
    where it is there) and wrap them as this rank's pipeline, on the groups of the plan's
    (pp, dp, tp) mesh (:func:`autopart.runtime.mesh.mesh_groups`; the tp group is passed
    where tp > 1, the runtime reads ``plan.zero_stage`` with the dp group)."""
    groups = mesh_groups(plan, options.mesh)
    tp = TensorParallelRank.of_group(groups.tp_group) if groups.tp_group is not None else None
    pp_rank = dist.get_rank(groups.pp_group)
    device = launch.rank_device()
    meta = launch.on_meta(model)  # codegen points the capture's meta literals at device
    if tensor_of is None and options.checkpoint is not None:
        tensor_of = checkpoint_tensors(options.checkpoint)
    elif tensor_of is None and meta:
        tensor_of = launch.materialise(model, device)
    t0 = time.perf_counter()
    with phase("codegen"):
        stages = build_stages(captured, plan, [device] * groups.pp, ranks={pp_rank},
                              tensor_of=tensor_of, fuse=options.fuse,
                              cuts_by_name=meta or cuts_by_name, tp=tp)
    timings["codegen_s"] = time.perf_counter() - t0
    if options.fuse:
        timings["fuse_s"] = stages.fuse_s
    return DistributedPipeline(model, stages, InputSignature.of(captured), device,
                               loss_fn=loss_fn, pp_group=groups.pp_group,
                               dp_group=groups.dp_group, tp_group=groups.tp_group,
                               timings_s=timings,
                               step_timeout_s=options.step_timeout_s or DEFAULT_STEP_TIMEOUT_S)


def load(directory: str | os.PathLike[str], model: nn.Module | LazyPipeline,
         example_inputs: tuple[Any, ...] | None = None, *,
         optimizer: torch.optim.Optimizer | None = None, **compile_kwargs: Any,
         ) -> nn.Module | Pipeline | LazyPipeline:
    """Restore a checkpoint written by ``pipe.save(directory)`` onto any plan.

    Args:
        directory: the checkpoint directory (its ``latest``), one committed ``ckpt-<n>``
            folder, or a plain model's weights (a ``.safetensors`` file, a
            ``save_pretrained`` folder, a format 1/2 autopart checkpoint).
        model: where the state goes: a pipeline of any plan (a
            :class:`autopart.DistributedPipeline` on every rank, any rank count; a
            :class:`autopart.lazy.LazyPipeline` not yet planned loads into its model), or the
            plain model. Weights are cast to its dtype.
        example_inputs: with a plain ``model``, compile it with the saved plan first (no
            profiling or solving) and return the pipeline.
        optimizer: an optimizer over ``model``'s parameters (so not with
            ``example_inputs``, whose pipeline does not exist yet); its state and each param
            group's options are restored by FQN.
        **compile_kwargs: passed to :func:`autopart.compile` with ``example_inputs``.

    Returns:
        ``model``, or the compiled pipeline with ``example_inputs``. The ``extra`` dict
        saved with the checkpoint: :func:`autopart.checkpoint_extra`.

    Raises:
        CheckpointError: not a checkpoint, a partial or damaged one, or one saved from
            another model (the message lists the tensors that differ); a checkpoint of a
            plain model given ``example_inputs`` (it has no plan).
    """
    if isinstance(model, LazyPipeline):  # its pipeline once planned, else the plain model
        load_checkpoint(directory, model.pipeline or model.model, optimizer=optimizer)
        return model
    if example_inputs is not None and not isinstance(model, Pipeline):
        pipe = compile(model, example_inputs, plan=checkpoint_plan(directory), **compile_kwargs)
        load_checkpoint(directory, pipe, optimizer=optimizer)  # type: ignore[arg-type, unused-ignore]
        return pipe
    load_checkpoint(directory, model, optimizer=optimizer)
    return model
