"""autopart.compile and autopart.load: the public front of the compile path
(:mod:`autopart.steps`: plan, capture, build) and of checkpoints."""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autopart.core.capture import CapturedGraph
from autopart.core.errors import PlanError
from autopart.core.plan import Plan
from autopart.devices import cluster_for_devices, plan_devices
from autopart.lazy import LazyPipeline, _say, plan_summary
from autopart.options import CompileOptions, renamed_choices
from autopart.runtime.checkpoint.save_load import checkpoint_plan, load_checkpoint
from autopart.runtime.description import describe
from autopart.runtime.distributed import launch
from autopart.runtime.pipeline import Pipeline
from autopart.steps.build_step import build_pipeline
from autopart.steps.compile_steps import compile_steps
from autopart.steps.shape_memory import ShapePeaks, check_fits

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
            on GPU, see :func:`autopart.runtime.distributed.launch.init_from_env`, unless
            ``backend="local"``), ``checkpoint`` (distributed: a ``pipe.save`` directory
            each rank loads its own weights from, so a ``meta`` model never materialises
            whole; without it a meta model's modules this rank needs are initialised),
            ``mesh`` (distributed: a ``DeviceMesh`` with dims ``("pp", "dp")`` or ``("pp",
            "dp", "tp")``; default: built from the plan, :mod:`autopart.runtime.distributed.mesh`),
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
    options = _options(options, choices)
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
        return LazyPipeline(model, backend=backend, first_build=functools.partial(
            _first_build, model, loss_fn, the_plan, options, backend),
            rebuild=functools.partial(_rebuild, model, loss_fn, options, backend),
            check_shape=functools.partial(_check_shape, model, loss_fn, options, backend))
    pipe, _ = compile_steps(model, args, kwargs, (loss_fn, example_target), the_plan, options,
                            backend)
    if the_plan is None and pipe.plan.num_gpus > len(pipe.plan.ranks):  # a 3D layout
        _say(f"planned a layout for {pipe.plan.num_gpus} ranks: {plan_summary(pipe.plan)}")
    return pipe


def _options(options: CompileOptions | None, choices: dict[str, Any]) -> CompileOptions:
    """The compile's choices as one :class:`CompileOptions` (given, or from keywords).

    Raises:
        PlanError: both given, or a keyword that is not a field of ``CompileOptions``.
    """
    if options is not None and choices:
        raise PlanError(f"pass the choices either as options= or as keywords, not both (got "
                        f"options and {sorted(choices)})")
    if options is not None:
        return options
    choices = renamed_choices(choices)
    if "devices" in choices and choices["devices"] is not None:
        choices["devices"] = tuple(str(d) for d in choices["devices"])
    try:
        return CompileOptions(**choices)
    except TypeError as exc:
        raise PlanError(f"compile() got an unknown argument ({exc}); the choices are the "
                        "fields of autopart.CompileOptions") from None


def _first_build(model: nn.Module, loss_fn: LossFn | None, plan: Plan | None,
                 options: CompileOptions, backend: str, args: tuple[Any, ...],
                 kwargs: dict[str, Any], target: Any) -> tuple[Pipeline, CapturedGraph]:
    """A lazy pipeline's first build: the compile path on its first batch (the pipeline, and
    the graph its stages were built from)."""
    return compile_steps(model, args, kwargs, (loss_fn, target), plan, options, backend)


def _rebuild(model: nn.Module, loss_fn: LossFn | None, options: CompileOptions, backend: str,
             captured: Any, plan: Plan, tensor_of: Callable[[str], torch.Tensor],
             cuts_by_name: bool, cut_already: bool) -> Pipeline:
    """A lazy pipeline's build at a new shape: the plan's stages from another capture."""
    return build_pipeline(model, captured, plan, loss_fn, options, backend, {},
                          tensor_of=tensor_of, cuts_by_name=cuts_by_name,
                          cut_already=cut_already)


def _check_shape(model: nn.Module, loss_fn: LossFn | None, options: CompileOptions, backend: str,
                 plan: Plan, planned: CapturedGraph, new: CapturedGraph,
                 shapes: tuple[str, str]) -> ShapePeaks | None:
    """A lazy pipeline's memory check at a new shape
    (:func:`autopart.steps.shape_memory.check_fits`), on the devices the pipeline's ranks run
    on and the runtime and optimizer state it was planned with."""
    if backend == "local":
        with warnings.catch_warnings():  # the first build already said where the ranks run
            warnings.simplefilter("ignore")
            devices = plan_devices(plan, options.devices)
    else:
        devices = [str(launch.rank_device())] * len(plan.ranks)
    specs = cluster_for_devices(devices).devices
    return check_fits(plan, planned, new, specs, training=loss_fn is not None,
                      state_factor=options.state_factor(model),
                      runtime=describe(backend, issue_threads=options.issue_threads),
                      shapes=shapes)


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
