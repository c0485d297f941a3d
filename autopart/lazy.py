"""LazyPipeline: ``autopart.compile`` without example inputs, planned at the first step's batch."""

from __future__ import annotations

import inspect
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn

from autopart.codegen import plan_for_graph
from autopart.core.capture import CapturedGraph, capture, on_meta
from autopart.core.context import context_inputs
from autopart.core.errors import PlanError
from autopart.core.plan import Plan
from autopart.core.signature import batch_size, microbatch_inputs
from autopart.runtime.distributed.pipeline import DistributedPipeline
from autopart.runtime.local.module import PipelinedModule
from autopart.runtime.pipeline import Pipeline
from autopart.steps.shape_memory import ShapePeaks

__all__ = ["LazyPipeline", "input_key", "plan_summary", "MANY_SHAPES"]

#: ``(args, kwargs, target) -> (pipeline, captured)``: plan (or replay) on this batch and
#: build, as an eager ``compile`` given these example inputs would; ``captured`` is the graph
#: of one microbatch the stages were built from.
FirstBuild = Callable[[tuple[Any, ...], dict[str, Any], Any], tuple[Pipeline, CapturedGraph]]
#: ``(captured, plan, tensor_of, cuts_by_name, cut_already) -> pipeline``: build ``plan``'s
#: stages from another capture of the model, weights from ``tensor_of`` (this rank's tp
#: slices and ep experts already cut where ``cut_already``).
Rebuild = Callable[[CapturedGraph, Plan, Callable[[str], torch.Tensor], bool, bool], Pipeline]
#: ``(plan, planned, new, (planned shapes, new shapes)) -> peaks or None``: the plan's per-rank
#: peaks at the shape ``new`` was captured at, raising :class:`PlanError` where a rank no
#: longer fits (:func:`autopart.steps.shape_memory.check_fits`).
ShapeCheck = Callable[[Plan, CapturedGraph, CapturedGraph, tuple[str, str]], "ShapePeaks | None"]

#: More input shapes than this draw a warning (each keeps its capture and stages).
MANY_SHAPES = 8

_RUNTIME_CLASS: dict[str, type[PipelinedModule] | type[DistributedPipeline]] = {"local": PipelinedModule,
                                             "distributed": DistributedPipeline}


def input_key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """What selects a pipeline for a batch: the inputs' structure, and per leaf its shape
    without dim 0 (the batch) and dtype for a tensor, or its value for anything else (a
    capture bakes it in). Two batches with one key run on one pipeline."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    per_leaf = tuple((tuple(leaf.shape[1:]), leaf.dim(), leaf.dtype)
                     if isinstance(leaf, torch.Tensor) else ("value", repr(leaf))
                     for leaf in leaves)
    return (repr(spec), per_leaf)


def _shapes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """The tensor inputs' shapes, e.g. ``(8, 16)`` or ``(8, 16), (8, 16)``."""
    return ", ".join(str(tuple(leaf.shape)) for leaf in pytree.tree_leaves((args, kwargs))
                     if isinstance(leaf, torch.Tensor))


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


def plan_summary(plan: Plan) -> str:
    """A few lines saying what a plan decided: ranks, its layout (tp, pp, dp, ZeRO stage),
    stages with the module paths at each cut, m, schedule, recompute, the predicted step
    (ms) and each rank's predicted peak memory (MiB)."""
    lines = [f"{len(plan.ranks)} ranks, {plan.num_stages} stages, m={plan.num_microbatches}, "
             f"schedule {plan.schedule_kind}, optimize={plan.optimize}",
             f"  layout: tp {plan.tp} x pp {len(plan.ranks)} x dp {plan.dp}"
             + (f" x cp {plan.cp}" if plan.cp > 1 else "")
             + f", ZeRO-{plan.zero_stage} ({plan.num_gpus} ranks)"]
    for st in plan.stages:
        first, last = (path or "(top level)" for path in st.module_range)
        modules = first if first == last else f"{first} .. {last}"
        lines.append(f"  stage {st.stage_index} on rank {st.rank} ({st.device}): {modules}; "
                     f"recompute {'yes' if st.recompute else 'no'}")
        if st.stage_index < len(plan.cuts):
            cut = plan.cuts[st.stage_index]
            before = plan.stages[st.stage_index + 1].module_range[0] or "(top level)"
            lines.append(f"  cut {st.stage_index + 1}: {last} | {before} (nodes "
                         f"{cut.after_node} | {cut.before_node}, "
                         f"{cut.crossing_bytes / 2**10:.1f} KiB per microbatch)")
    peaks = ", ".join(f"rank {r.rank} {_mib(r.peak_memory_bytes)}" for r in plan.ranks)
    lines.append(f"  predicted step {plan.predicted_step_time_us / 1e3:.1f} ms (bubble "
                 f"{plan.bubble_fraction:.1%}); predicted peak {peaks}")
    return "\n".join(lines)


def _first_tensors(first: Pipeline, shapes: str) -> tuple[dict[str, torch.Tensor], bool]:
    """The tensors a new shape's stages take from the first pipeline, by FQN, and whether
    its tp slices and ep experts are among them already cut (a distributed rank holds
    those; the one-process runtime holds whole tensors).

    Raises:
        PlanError: a rank whose parameters ZeRO 1-3 shard over dp (FSDP2 units cannot be
            shared by two pipelines' stages).
    """
    if not isinstance(first, DistributedPipeline):
        return dict(first.checkpoint_state().holds), False
    if first.zero_sharded:
        raise PlanError(
            f"inputs {shapes} have another shape than the planned one, and this plan's "
            f"ZeRO-{first.plan.zero_stage} shards the parameters over dp with FSDP2 units that "
            "a second pipeline cannot share: a lazy pipeline with ZeRO 1-3 runs one input "
            "shape. Pad or bucket the inputs to the planned shape, compile with zero_stage=0, "
            "or compile one pipeline for this shape with autopart.compile(model, "
            "example_inputs=...) (its own optimizer)")
    return first.rank_tensors(), first.plan.tp > 1 or first.plan.ep > 1


def _another_graph(shapes: str, exc: PlanError) -> PlanError:
    """The refusal of a shape whose graph does not carry the plan's cuts."""
    return PlanError(f"inputs {shapes} give another graph than the planned shape ({exc}): the "
                     "model's graph changes with this shape, so the plan's cuts do not carry "
                     "over. Compile a pipeline for this shape with autopart.compile(model, "
                     "example_inputs=...) (its own parameters' optimizer), or pad the inputs to "
                     "a shape already seen")


def _say(text: str) -> None:
    """Print ``text`` once per launch: on global rank 0 only under torch.distributed."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        print(f"autopart: {text}", flush=True)


class LazyPipeline:
    """The pipeline ``autopart.compile(model, loss_fn=...)`` returns without example inputs.

    The first ``train_step(...)`` or forward call captures, profiles and plans on its batch
    (under ``torchrun`` global rank 0 plans and every rank receives the plan, as an eager
    compile does), builds the pipeline an eager ``autopart.compile(model, (x,),
    example_target=y, ...)`` would, prints a summary of the decision (:func:`plan_summary`)
    and from then on hands every call to it: ``pipe.plan``, ``pipe.save(...)``,
    ``pipe.clip_grad_norm_(...)``, ... are that pipeline's.

    Shapes: a batch whose non-batch dimensions (e.g. the sequence length), dtypes or input
    structure differ from every batch seen so far runs on a pipeline of its own, built once
    per such :func:`input_key` and kept: the model is captured again at that shape and split
    at the first plan's cuts (found by node name), with the same microbatch size, schedule
    and recompute, and the same parameter objects. Nothing is profiled or solved again: the
    plan's predicted times are those of the first shape, and its per-rank peaks are
    predicted again at the new shape (:func:`autopart.steps.shape_memory.peaks_at_shape`:
    the planned peaks plus what the analytical memory model adds between the two graphs,
    in :attr:`peaks_bytes`); a shape at which a rank would exceed its device's memory is
    refused with :class:`PlanError` before anything is built, so plan on the largest shape
    when memory is tight. A later batch of a seen key reuses its pipeline.

    Parameters: before the first step ``parameters()`` / ``named_parameters()`` /
    ``state_dict()`` / ``load_state_dict()`` are the model's own. The pipeline shares them
    where a stage runs on the device they are on (CPU, or a model already on its GPU), so an
    optimizer built before the first step keeps working; where the pipeline had to copy a
    parameter so handed out (a stage on another device) the first step raises
    :class:`PlanError` rather than train a copy the optimizer does not see.

    Attributes:
        model: the model it partitions.
        pipelines: input key (:func:`input_key`) -> its built pipeline, first shape first.
        peaks_bytes: input key of each shape after the first -> its predicted per-rank peaks
            (:class:`autopart.steps.shape_memory.ShapePeaks`; absent where the analytical
            walk could not cost the graph, with a warning).
    """

    def __init__(self, model: nn.Module, *, backend: str, first_build: FirstBuild,
                 rebuild: Rebuild, check_shape: ShapeCheck | None = None) -> None:
        """Keep what the first call needs.

        Args:
            model: the model.
            backend: ``"local"`` or ``"distributed"`` (decided at ``compile`` time).
            first_build: plans on a batch and builds its pipeline (see :data:`FirstBuild`).
            rebuild: builds a plan's stages from a capture at another shape
                (:data:`Rebuild`).
            check_shape: prices the plan at another shape and refuses it where it does not
                fit (:data:`ShapeCheck`); None: no check.
        """
        self.model = model
        self.pipelines: dict[tuple[Any, ...], Pipeline] = {}
        self._first_build = first_build
        self._rebuild = rebuild
        self._check_shape = check_shape
        self.peaks_bytes: dict[tuple[Any, ...], ShapePeaks] = {}
        self._planned: tuple[CapturedGraph, str] | None = None  # the first graph, its shapes
        self._current: Pipeline | None = None
        step = inspect.signature(_RUNTIME_CLASS[backend].train_step).parameters.values()
        # train_step's own keywords (trace=, optimizer=, ...); every other keyword is the model's
        self._step_options = {p.name for p in step if p.kind is p.KEYWORD_ONLY} - {"target"}
        self._handed_out: dict[str, nn.Parameter] = {}  # parameters given out before planning

    @property
    def pipeline(self) -> Pipeline | None:
        """The pipeline the last call ran on, or None before the first call."""
        return self._current

    # ---- running ---------------------------------------------------------------------
    def train_step(self, *args: Any, target: Any = None, **kwargs: Any) -> torch.Tensor:
        """Plan on this batch if nothing is planned for its shape yet, then the pipeline's
        ``train_step`` with every argument as given (see
        :meth:`autopart.PipelinedModule.train_step`, :meth:`autopart.DistributedPipeline.train_step`).

        Raises:
            PlanError: as ``autopart.compile`` and the pipeline's ``train_step``; cuts that
                are not in the graph captured at a new shape (the message gives the fix).
        """
        model_kwargs = {k: v for k, v in kwargs.items() if k not in self._step_options}
        pipe = self._pipeline_for(args, model_kwargs, target, "train_step")
        return pipe.train_step(*args, target=target, **kwargs)  # type: ignore[no-any-return, operator]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Pipelined inference (``pipe(x)``), planning on this batch first if needed."""
        return self._pipeline_for(args, kwargs, None, "forward")(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Same as calling the pipeline."""
        return self(*args, **kwargs)

    def _pipeline_for(self, args: tuple[Any, ...], kwargs: dict[str, Any], target: Any,
                      call: str) -> Pipeline:
        key = input_key(args, kwargs)
        pipe = self.pipelines.get(key)
        if pipe is None and not self.pipelines:
            pipe, captured = self._first_build(args, kwargs, target)
            self._planned = (captured, _shapes(args, kwargs))
            self.pipelines[key] = self._current = pipe  # kept even if the check below fails
            _say(f"planned at the first {call} on inputs {_shapes(args, kwargs)}: "
                 f"{plan_summary(pipe.plan)}")
            self._check_handed_out(pipe)
        elif pipe is None:
            pipe = self._build_at(key, args, kwargs)
            self.pipelines[key] = pipe
            if len(self.pipelines) == MANY_SHAPES + 1:
                warnings.warn(f"{len(self.pipelines)} input shapes so far, each captured and "
                              "built once and kept: pad or bucket the inputs to a few lengths",
                              RuntimeWarning, stacklevel=3)
            peaks = self.peaks_bytes.get(key)
            _say(f"new input shape {_shapes(args, kwargs)}: captured and split at the plan's "
                 "cuts (no profiling); its predicted step is the first shape's"
                 + ("" if peaks is None else ", its largest predicted peak "
                    f"{_mib(max(peaks.bytes))} (planned {_mib(max(peaks.planned_bytes))})"))
        self._current = pipe
        return pipe

    def _build_at(self, key: tuple[Any, ...], args: tuple[Any, ...], kwargs: dict[str, Any],
                  ) -> Pipeline:
        """The first pipeline's plan built from a capture at these inputs' shapes, on the
        same tensors, once its peaks there are checked against the devices' memory.

        Raises:
            PlanError: a batch that is not a multiple of the microbatch size; a graph whose
                cuts are not those of the planned one; a rank predicted over its device's
                memory at this shape.
        """
        first = next(iter(self.pipelines.values()))
        plan, mb, shapes = first.plan, first.signature.microbatch_size, _shapes(args, kwargs)
        held, cut_already = _first_tensors(first, shapes)
        batch = batch_size(args, kwargs)
        if batch % mb:
            raise PlanError(f"batch of {batch} is not a multiple of the microbatch size {mb} "
                            "this pipeline was planned for; pass such a batch")
        # a cp plan's stages hold one cp rank's tokens (any rank's graph is the same)
        args, kwargs, _ = context_inputs(self.model, plan.cp, args, kwargs)
        mb_args, mb_kwargs = microbatch_inputs(args, kwargs, batch // mb)
        if on_meta(self.model):
            mb_args, mb_kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"),
                                                      (mb_args, mb_kwargs))
        t0 = time.perf_counter()
        captured = capture(self.model, mb_args, mb_kwargs)
        capture_s = time.perf_counter() - t0
        try:
            plan_for_graph(plan, captured)  # the cuts by name, before pricing or building
        except PlanError as exc:
            raise _another_graph(shapes, exc) from exc
        if self._check_shape is not None and self._planned is not None:
            peaks = self._check_shape(plan, self._planned[0], captured,
                                      (self._planned[1], shapes))
            if peaks is not None:
                self.peaks_bytes[key] = peaks
        own = {fqn: target for target, fqn in captured.attr_fqns.items()}

        def tensor_of(fqn: str) -> torch.Tensor:
            return held[fqn] if fqn in held else captured.attr_value(own.get(fqn, fqn))

        try:
            pipe = self._rebuild(captured, plan, tensor_of,
                                 captured.fingerprint != plan.graph_fingerprint, cut_already)
        except PlanError as exc:
            raise _another_graph(shapes, exc) from exc
        pipe.timings_s["capture_s"] = capture_s
        return pipe

    # ---- before the first call: the model's own tensors --------------------------------
    def _check_handed_out(self, pipe: Pipeline) -> None:
        copied = [fqn for fqn, p in pipe.named_parameters()
                  if fqn in self._handed_out and self._handed_out[fqn] is not p]
        if copied:
            raise PlanError(
                f"pipe.parameters() was called before the first step and gave the model's "
                f"parameters, but the pipeline holds copies of {copied[:3]}"
                f"{'...' if len(copied) > 3 else ''} (on its stages' devices, or this rank's "
                "tensor-parallel slices and ZeRO shards), which an optimizer built then would "
                "not update. Build the optimizer after the first "
                "pipe.train_step(...) (pipe.parameters() is then the pipeline's), move the "
                "model to the device its stages run on first, or pass example_inputs= to "
                "autopart.compile")

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        """The pipeline's parameters (see the runtime's ``named_parameters``); before the
        first call the model's own, under their FQNs, each once."""
        if self._current is not None:
            yield from self._current.named_parameters(prefix, recurse, remove_duplicate)
            return
        for name, p in self.model.named_parameters():
            self._handed_out[name] = p
            yield prefix + name, p

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """What an optimizer takes: :meth:`named_parameters`' values."""
        for _, p in self.named_parameters():
            yield p

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """The pipeline's buffers; before the first call the model's."""
        source: nn.Module = self.model if self._current is None else self._current
        yield from source.named_buffers(prefix, recurse, remove_duplicate)

    def buffers(self, recurse: bool = True) -> Iterator[torch.Tensor]:
        """:meth:`named_buffers`' values."""
        for _, b in self.named_buffers():
            yield b

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The pipeline's ``state_dict``; before the first call the model's."""
        source: nn.Module = self.model if self._current is None else self._current
        return source.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True,
                        assign: bool = False) -> Any:
        """Load into the pipeline; before the first call into the model (which the pipeline
        is then built from)."""
        if self._current is None:
            return self.model.load_state_dict(state_dict, strict=strict, assign=assign)
        return self._current.load_state_dict(state_dict, strict=strict, assign=assign)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear every parameter's gradient (the model's before the first call):
        ``nn.Module.zero_grad`` of the model or of the current pipeline."""
        (self.model if self._current is None else self._current).zero_grad(set_to_none)

    def train(self, mode: bool = True) -> LazyPipeline:
        """Set training mode on the model and every pipeline built (before the first call
        it decides the mode the model is captured in, as for an eager compile)."""
        self.model.train(mode)
        for pipe in self.pipelines.values():
            pipe.train(mode)
        return self

    def eval(self) -> LazyPipeline:
        """``train(False)``."""
        return self.train(False)

    def close(self) -> None:
        """Close every pipeline built (a distributed one stops its heartbeat thread; call
        before ``dist.destroy_process_group``)."""
        for pipe in self.pipelines.values():
            close = getattr(pipe, "close", None)
            if close is not None:
                close()

    def __getattr__(self, name: str) -> Any:
        """The built pipeline's attribute (``plan``, ``save``, ``timings_s``, ...).

        Raises:
            PlanError: nothing is planned yet (no ``train_step`` or forward call so far).
        """
        if name.startswith("__") or name in ("_current", "pipelines", "model"):
            raise AttributeError(name)
        current = self.__dict__.get("_current")
        if current is None:
            raise PlanError(f"pipe.{name} does not exist yet: autopart.compile was given no "
                            "example inputs, so it plans at the first pipe.train_step(x, "
                            "target=y) or pipe(x) call; make that call first, or pass "
                            "example_inputs=(x,) to autopart.compile to plan at once")
        return getattr(current, name)

    def __repr__(self) -> str:
        state = (f"{len(self.pipelines)} input shape(s) built" if self.pipelines
                 else "plans at its first train_step or forward call")
        return f"LazyPipeline({type(self.model).__name__}, {state})"
