"""Multi-process pipelines: each rank builds only its stages and runs the plan's schedule on
torch.distributed.pipelining's runtime (gloo on CPU, NCCL on GPU)."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime
from torch.utils.checkpoint import checkpoint

from autopart.codegen.recompute import recompute_context
from autopart.codegen.stages import BuiltStages
from autopart.core.errors import PipelineFailure, PlanError
from autopart.core.jsonio import write_text_atomic
from autopart.core.memory import measure_peak_bytes, optimizer_tensors
from autopart.core.schedule import build_schedule, splits_backward, to_csv
from autopart.core.signature import InputSignature, call_loss, require_loss
from autopart.core.trace import Trace, TraceEvent
from autopart.runtime.heartbeat import DEFAULT_STEP_TIMEOUT_S, Heartbeat
from autopart.runtime.host import (
    affinity_enabled,
    core_share,
    on_cores,
    tune_cpu_allocator,
)
from autopart.runtime.tracing import ActionRecorder

__all__ = ["DistributedPipeline"]

#: pipelines built in this process, per pipeline group (``"0-1"``): names their store keys
_BUILT: dict[str, int] = {}


class _P2PStage(nn.Module):
    """A stage adapted to point-to-point transfer, which moves dense buffers only.

    Outputs are made contiguous before they are sent (a pass-through mask is often an
    ``expand`` view); inputs whose captured layout was strided (a transposed activation)
    are copied back into that layout, because the stage's graph may ``view`` them. A stage
    the plan marks ``recompute`` runs its forward under non-reentrant
    ``torch.utils.checkpoint`` when gradients are on: only its inputs are kept, and the
    backward rebuilds the rest.

    A stage whose backward splits (``split_backward``) sends copies of its outputs: torch's
    ``stage_backward_input`` detaches every stage output in place once ``I`` is done, and
    where the stage itself saved one for its ``W`` (a linear's input that also crosses the
    cut) that ``W`` failed with "Trying to use a saved tensor that has been detached
    in-place". A copy is one boundary tensor per microbatch.
    """

    def __init__(self, stage: fx.GraphModule, runner: nn.Module, recompute: bool = False,
                 split_backward: bool = False) -> None:
        super().__init__()
        self.stage = stage
        self._run = [runner]  # the module itself, or torch.compile of it (not a submodule)
        self.recompute = recompute
        self.split_backward = split_backward
        self._layouts: list[tuple[tuple[int, ...], tuple[int, ...]] | None] = []
        for node in stage.graph.nodes:
            if node.op != "placeholder":
                continue
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor) and not val.is_contiguous():
                self._layouts.append((tuple(val.shape), tuple(val.stride())))
            else:
                self._layouts.append(None)

    def forward(self, *args: Any) -> Any:
        restored = []
        for arg, layout in zip(args, self._layouts, strict=True):
            if isinstance(arg, torch.Tensor) and arg.requires_grad:
                # the gradient this stage sends back must be dense too
                arg.register_hook(lambda g: g.contiguous())
            if layout is not None and isinstance(arg, torch.Tensor) and arg.stride() != layout[1]:
                arg = _restride(arg, *layout)
            restored.append(arg)
        runner = self._run[0]
        if self.recompute and torch.is_grad_enabled():
            out = checkpoint(runner, *restored, use_reentrant=False,
                             context_fn=recompute_context(self.stage))
        else:
            out = runner(*restored)
        sent = []
        for o in out:
            if isinstance(o, torch.Tensor):
                dense = o.contiguous()
                if self.split_backward and dense is o and o.requires_grad:
                    dense = o.clone()  # torch's I detaches what it sent; the stage keeps o
                o = dense
            sent.append(o)
        return tuple(sent)


def _restride(dense: torch.Tensor, shape: tuple[int, ...], stride: tuple[int, ...]) -> torch.Tensor:
    """``dense`` laid out like the captured tensor (differentiable).

    Broadcast dimensions (stride 0) are taken from index 0 and expanded again; the other
    dimensions are copied into a buffer with the captured strides.
    """
    expanded = [d for d, st in enumerate(stride) if st == 0 and shape[d] > 1]
    base = dense
    for d in expanded:
        base = base.narrow(d, 0, 1)
    if expanded:
        return base.contiguous().expand(shape)
    strided = torch.empty_strided(shape, stride, dtype=dense.dtype, device=dense.device)
    return strided.copy_(dense)


class _TracedStage(PipelineStage):
    """``PipelineStage`` that marks each action it computes on the heartbeat (``"1F3"``,
    ``"1B3"``, ``"1W3"``), so that a rank stuck inside one is named with it, and times it
    into ``recorder`` during a traced step."""

    def __init__(self, heartbeat: Heartbeat, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._heartbeat = heartbeat
        self.recorder: ActionRecorder | None = None  # set for one traced step
        self.track = 0  # this rank's pipeline rank: the trace's track

    @contextlib.contextmanager
    def _action(self, name: str) -> Iterator[None]:
        with self._heartbeat.action(name):
            if self.recorder is None:
                yield
                return
            stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
            with self.recorder.span(self.track, name, stream):
                yield

    def _to_tensor(self, arg: Any) -> torch.Tensor:
        """torch (2.13) runs each stage's forward once on ``torch.empty`` inputs made from the
        received metadata, to infer shapes. Uninitialised integer inputs are out-of-range
        indices (a stage whose input is the token ids fails in ``embedding`` with an
        IndexError), so integer and bool inputs are zeros here: a valid index for any
        non-empty dimension. Floating inputs stay as torch makes them."""
        tensor = super()._to_tensor(arg)  # type: ignore[misc]
        if (not isinstance(arg, torch.Tensor) and type(tensor) is torch.Tensor
                and not (tensor.is_floating_point() or tensor.is_complex())):
            tensor.zero_()
        return tensor

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        with self._action(f"{self.stage_index}F{fwd_chunk_id}"):
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        kind = "B" if kwargs.get("full_backward", True) else "I"
        with self._action(f"{self.stage_index}{kind}{bwd_chunk_id}"):
            return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        with self._action(f"{self.stage_index}W{bwd_chunk_id}"):
            return super().backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs)


class DistributedPipeline(nn.Module):
    """This rank's share of a pipeline: its stages, run under the plan's schedule.

    Execution uses ``torch.distributed.pipelining``: each local stage module becomes a
    ``PipelineStage`` and the plan's action list (autopart's schedule, written in the CSV
    action format, recomputed stages running whole ``B`` backwards as the schedule says)
    is loaded into its ``_PipelineScheduleRuntime``, which inserts the point-to-point sends
    and receives. That runtime runs all four schedule kinds, split backward (``I``/``W``)
    included, so no P2P code of autopart's own is needed.

    During a step (``train_step``, ``forward``), CPU ranks that share a host run on
    disjoint, contiguous shares of the cores the host lets them use
    (:func:`autopart.runtime.host.core_share`; every thread of the process, gloo's
    included), and get the cores they had back after it. Unpinned, the
    scheduler runs a rank's gloo receive thread beside the other rank's compute; on this
    project's 2-core CPU (torch 2.13.0+cpu, 2 gloo ranks x 1 thread, the torchrun GPT-2
    example, interleaved 1F1B m = 8) posting a receive on the busier rank then waited on
    that thread for 3-7 ms, about every other time: 25-46 ms a step of receive posts
    against 6-12 ms pinned, and steps of 715-769 ms against 699-710 ms pinned
    (``/proc``-wide thread affinity, 4 launches each). Turned off by
    ``$AUTOPART_CPU_AFFINITY=0``, with fewer cores than ranks on the host, and where the
    ranks were already allowed different cores (a user's own pinning).

    After the step: gradients of a tied parameter held by several ranks are summed across
    them (all-reduce), and with a data-parallel group every gradient is averaged across
    its replicas. The loss (mean over microbatches) is broadcast from the last stage's
    rank, so ``train_step`` returns it on every rank; ``pipe(x)`` returns the output on
    every rank the same way.

    Attributes:
        plan: the plan.
        signature: the inputs and outputs compiled for.
        pipeline_stages: torch ``PipelineStage`` objects of this rank's stages, in stage
            order (for driving them with torch's own schedules).
        timings_s: seconds per compile phase.
        cpu_cores: the cores this CPU rank's steps run on, or None (not pinned).

    Args:
        model: the model (its tensors may be on ``meta`` when ``stages`` were built from
            other tensors); only its parameter names are read.
        stages: this rank's stages (:func:`autopart.codegen.build_stages` with
            ``ranks={pp_rank}``).
        signature: the inputs and outputs compiled for.
        device: this rank's device.
        loss_fn: ``(output, target) -> scalar``, or None for inference only.
        pp_group: process group of the pipeline ranks (default: the world).
        dp_group: process group of this rank's data-parallel replicas, or None.
        timings_s: seconds per compile phase, kept as ``timings_s``.
        step_timeout_s: a send or receive of the pipeline that waits this long fails the
            step (default 300 s): every rank then raises :class:`PipelineFailure` naming the
            rank that died or hangs and the action it hangs in, and a hung rank is told to
            exit (its heartbeat thread ends the process; see
            :class:`autopart.runtime.heartbeat.Heartbeat`).

    Raises:
        PlanError: the pipeline group's size differs from the plan's rank count.
    """

    def __init__(self, model: nn.Module, stages: BuiltStages, signature: InputSignature,
                 device: torch.device, *, loss_fn: Callable[[Any, Any], torch.Tensor] | None,
                 pp_group: dist.ProcessGroup | None = None,
                 dp_group: dist.ProcessGroup | None = None,
                 timings_s: dict[str, float] | None = None,
                 step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S) -> None:
        super().__init__()
        plan = stages.plan
        self.plan = plan
        self.signature = signature
        self.timings_s = {} if timings_s is None else timings_s
        self.pp_group = pp_group
        self.dp_group = dp_group
        self.pp_rank = dist.get_rank(pp_group)
        self.pp_size = dist.get_world_size(pp_group)
        if self.pp_size != len(plan.ranks):
            raise PlanError(f"the plan has {len(plan.ranks)} ranks but the pipeline group has "
                            f"{self.pp_size}; launch with --nproc-per-node={len(plan.ranks)} "
                            "(times the data-parallel size)")
        self.device = device
        if device.type == "cpu":
            tune_cpu_allocator()  # freed activations stay in the process (runtime/host.py)
        self.cpu_cores = self._cpu_share()
        self._built: BuiltStages = stages
        self.local_stages = list(stages.local)
        self.stages = nn.ModuleList(stages.modules[s] for s in self.local_stages)
        self._loss_fn = loss_fn
        self._fqn_order = [fqn for fqn, _ in model.named_parameters()]
        placement = stages.placement
        # tensors this rank holds, by FQN (its own copy of a tied one included)
        self._local: dict[str, torch.Tensor] = {}
        for (s, fqn), t in placement.tensors.items():
            if s in self.local_stages:
                self._local.setdefault(fqn, t)
        self.step_timeout_s = step_timeout_s
        pipelines, mine = self._pipelines()
        self._p2p_group = self._make_timed_group(pipelines, mine)
        self._tied_groups = self._make_tied_groups(placement, pipelines, mine)
        self._last_rank = plan.stages[-1].rank
        self._first_rank = plan.stages[0].rank
        self._recompute = [st.stage_index for st in plan.stages if st.recompute]
        self._store = store = dist.distributed_c10d._get_default_store()
        # pipelines are built collectively, in the same order on every rank: the n-th one
        # of these ranks has the same number everywhere, and its gathers their own keys
        group = "-".join(map(str, mine))
        _BUILT[group] = _BUILT.get(group, 0) + 1
        self._gather_prefix = f"autopart/gather/{group}/{_BUILT[group]}"
        self._gathers = 0
        self._heartbeat = Heartbeat(store, dist.get_rank(), dist.get_world_size(),
                                    hung_after_s=step_timeout_s)
        self.pipeline_stages = [
            _TracedStage(self._heartbeat,
                         _P2PStage(stages.modules[s], stages.runners[s], plan.stages[s].recompute,
                                   splits_backward(plan.schedule_kind, plan.stages[s].recompute)),
                         s, plan.num_stages, device, group=self._p2p_group)
            for s in self.local_stages]
        # The last runtime built, kept while steps keep its (m, training): a new runtime re-runs
        # the stages' shape inference and buffer set-up (a P2P exchange). Only one is kept
        # because the stages hold the buffers of whichever runtime set them up last.
        self._runtime: tuple[tuple[int, bool], _PipelineScheduleRuntime] | None = None
        self._recorder: ActionRecorder | None = None
        self.last_trace: Trace | None = None  # set by train_step(trace=True)
        self.last_peak_memory_bytes: list[int] = []  # set by train_step(measure_memory=True)

    def _cpu_share(self) -> tuple[int, ...] | None:
        """This rank's own share of the host's cores for its steps (see the class docstring).

        Every rank of the world takes part (one ``all_gather_object`` of host name and
        allowed cores); a CPU rank gets a share only where it shares the host with other
        ranks that are allowed the same cores (ranks a user pinned apart are left as they
        are), there are at least as many cores as ranks there, and ``$AUTOPART_CPU_AFFINITY``
        is not off. Returns the share, or None."""
        cores = (tuple(sorted(os.sched_getaffinity(0))) if affinity_enabled()
                 and self.device.type == "cpu" else ())
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, (socket.gethostname(), cores))
        me = dist.get_rank()
        host, mine = every[me]
        local = [r for r, (h, _) in enumerate(every) if h == host]
        if not mine or len(local) < 2 or any(every[r][1] != mine for r in local):
            return None
        return core_share(mine, local.index(me), len(local)) or None

    @contextlib.contextmanager
    def _on_own_cores(self) -> Iterator[None]:
        """Every thread of this process on :attr:`cpu_cores` meanwhile (when set), then back
        on the cores each had (:func:`autopart.runtime.host.on_cores`): what runs between
        steps (the optimizer, a profile, processes started from this one) is left as it
        was. Where the OS refuses, this warns once and later steps run unpinned."""
        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(on_cores(self.cpu_cores))
            except OSError as exc:  # e.g. a core the cgroup took away since
                warnings.warn(f"rank {self.pp_rank}: could not pin its threads to cores "
                              f"{list(self.cpu_cores or ())} ({exc}); its steps run unpinned "
                              "(set AUTOPART_CPU_AFFINITY=0 to skip trying)", RuntimeWarning,
                              stacklevel=3)
                self.cpu_cores = None
            yield

    def _pipelines(self) -> tuple[list[tuple[int, ...]], list[int]]:
        """Every pipeline replica's global ranks (sorted), and this rank's pipeline."""
        mine = (dist.get_process_group_ranks(self.pp_group) if self.pp_group is not None
                else list(range(dist.get_world_size())))
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        return sorted({tuple(ranks) for ranks in every}), mine

    def _make_timed_group(self, pipelines: list[tuple[int, ...]], mine: list[int],
                          ) -> dist.ProcessGroup:
        """The pipeline's ranks again, as a group whose operations time out after
        ``step_timeout_s``: its sends, receives and loss broadcast. ``new_group`` is
        collective over the whole world, so every rank makes every replica's group."""
        timeout = datetime.timedelta(seconds=self.step_timeout_s)
        made = [dist.new_group(list(pipeline), timeout=timeout) for pipeline in pipelines]
        return made[pipelines.index(tuple(mine))]

    def _make_tied_groups(self, placement: Any, pipelines: list[tuple[int, ...]],
                          mine: list[int]) -> list[tuple[str, dist.ProcessGroup | None]]:
        """One group per parameter read on several pipeline ranks, per pipeline replica.

        ``new_group`` is collective over the whole world: every rank creates every replica's
        groups in the same order (with a pp x dp mesh each data-parallel replica has its own
        pipeline group), and keeps those it belongs to.
        """
        groups: list[tuple[str, dist.ProcessGroup | None]] = []
        timeout = datetime.timedelta(seconds=self.step_timeout_s)
        for fqn in sorted(placement.replicas):
            readers = [placement.owner[fqn], *placement.replicas[fqn]]
            ranks = sorted({self.plan.stages[s].rank for s in readers})
            if len(ranks) < 2:
                continue
            for pipeline in pipelines:
                group = dist.new_group([pipeline[r] for r in ranks], timeout=timeout)
                if list(pipeline) == mine and self.pp_rank in ranks and fqn in self._local:
                    groups.append((fqn, group))
        return groups

    # ---- parameters -----------------------------------------------------------------
    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters under the original FQNs (a tied one once per rank)."""
        for fqn in self._fqn_order:
            t = self._local.get(fqn)
            if isinstance(t, nn.Parameter):
                yield prefix + fqn, t

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """This rank's tensors by FQN (parameters and buffers of its stages)."""
        return {fqn: t.detach() for fqn, t in self._local.items()}

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Copy values into this rank's tensors by FQN; keys of tensors other ranks hold are
        skipped (a whole model's ``state_dict`` can be given to every rank).

        Raises:
            PlanError: with ``strict``, a tensor this rank holds is missing, or a shape
                differs from the model's.
        """
        missing = sorted(set(self._local) - set(state_dict))
        if strict and missing:
            raise PlanError(f"state_dict lacks {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                            f"which rank {self.pp_rank} holds; pass the whole model's state_dict")
        with torch.no_grad():
            for fqn, target in self._local.items():
                if fqn not in state_dict:
                    continue
                value = state_dict[fqn]
                if tuple(value.shape) != tuple(target.shape):
                    raise PlanError(f"state_dict[{fqn!r}] has shape {tuple(value.shape)}, the "
                                    f"model's is {tuple(target.shape)}")
                target.copy_(value)
        return nn.modules.module._IncompatibleKeys(missing, [])

    # ---- running ---------------------------------------------------------------------
    def _schedule(self, m: int, training: bool) -> _PipelineScheduleRuntime:
        if self._runtime is None or self._runtime[0] != (m, training):
            self._runtime = ((m, training), self._new_runtime(m, training))
        return self._runtime[1]

    def _new_runtime(self, m: int, training: bool) -> _PipelineScheduleRuntime:
        # gradients are divided by m once per step in train_step, not by each stage: torch
        # divides every stage's parameters, so a tensor two local stages share (a tied one)
        # would be divided twice
        runtime = _PipelineScheduleRuntime(self.pipeline_stages, m,
                                           loss_fn=self.loss_of_flat if training else None,
                                           scale_grads=False)
        actions = build_schedule(self.plan.schedule_kind, self.pp_size, m,
                                 self.plan.stages_per_rank, recompute=self._recompute)
        with tempfile.NamedTemporaryFile("w", suffix=".csv", delete=False) as f:
            f.write(to_csv(actions))
        try:
            runtime._load_csv(f.name)
        finally:
            os.unlink(f.name)
        return runtime

    def loss_of_flat(self, out: Any, target: Any) -> torch.Tensor:
        """``loss_fn`` on the last stage's flat output (a tensor or a tuple of them), as
        torch's schedules call it.

        Raises:
            PlanError: compiled without ``loss_fn``, a loss that is not a scalar, or one that
                fails without a target (:func:`autopart.core.signature.call_loss`).
        """
        flat = list(out) if isinstance(out, (tuple, list)) else [out]
        recorder = self._recorder
        if recorder is None:
            return call_loss(require_loss(self._loss_fn), self.signature.output(flat), target)
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        with recorder.span(self.pp_rank, "loss", stream, waits=False):
            return call_loss(require_loss(self._loss_fn), self.signature.output(flat), target)

    def _guarded(self, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except PlanError:
            raise
        except Exception as exc:
            raise self._failure(exc) from exc

    def _failure(self, exc: Exception) -> PipelineFailure:
        """The error a failed step raises: which rank died or hangs, and in which action.

        A hung rank (inside one action for at least half the step timeout while this rank's
        send or receive timed out) is told to exit."""
        dead, hung = self._heartbeat.diagnose(hung_after_s=self.step_timeout_s / 2)
        ranks = self._p2p_ranks()
        pp_of = {g: r for r, g in enumerate(ranks)}
        stages_of = {r: [st.stage_index for st in self.plan.stages if st.rank == r]
                     for r in range(self.pp_size)}
        text = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        who = [f"rank {g} (stages {stages_of.get(pp_of.get(g, -1), '?')}) died or stopped "
               "responding" for g in dead]
        for g, (action, stuck_s) in sorted(hung.items()):
            reason = (f"it hangs in action {action} (no progress for {stuck_s:.0f} s, step "
                      f"timeout {self.step_timeout_s:g} s)")
            told = ("it was told to exit" if self._heartbeat.tell_to_exit(g, reason)
                    else "telling it to exit was not acknowledged")
            who.append(f"rank {g} (stages {stages_of.get(pp_of.get(g, -1), '?')}) hangs in "
                       f"action {action} (no progress for {stuck_s:.0f} s; {told})")
        if not who:
            return PipelineFailure(f"pipeline step failed on rank {self.pp_rank} (stages "
                                   f"{stages_of[self.pp_rank]}): {text}")
        return PipelineFailure(f"pipeline step failed on rank {self.pp_rank}: {'; '.join(who)} "
                               f"({text}); restart the job (from the last checkpoint) once the "
                               "rank is healthy")

    def _p2p_ranks(self) -> list[int]:
        return dist.get_process_group_ranks(self._p2p_group)

    def train_step(self, *args: Any, target: Any = None, trace: bool = False,
                   measure_memory: bool = False, optimizer: torch.optim.Optimizer | None = None,
                   **kwargs: Any) -> torch.Tensor:
        """Every microbatch forward and backward; returns the mean loss on every rank.

        Inputs are needed on the first stage's rank, ``target`` on the last stage's rank
        (passing them everywhere is fine). Gradients accumulate in ``.grad``.

        Args:
            trace: record every action of every rank of this pipeline into ``last_trace``
                on every rank (:class:`autopart.core.trace.Trace`, one track per pipeline
                rank, µs from a barrier all ranks leave together; default False). Must be
                the same on every rank.
            measure_memory: measure this rank's peak memory into
                ``last_peak_memory_bytes`` (one entry per pipeline rank, gathered on every
                rank; see :func:`autopart.core.memory.measure_peak_bytes`; on CPU the
                profiler it uses slows the step, so do not time such a step). Same on every
                rank; default False.
            optimizer: with ``measure_memory``, its state counts as held memory.

        Raises:
            PlanError: compiled without ``loss_fn``, or a batch that does not fit.
            PipelineFailure: a rank failed or stopped responding; names it and its stages.
        """
        require_loss(self._loss_fn)
        with self._on_own_cores():
            return self._train_step(args, kwargs, target, trace, measure_memory, optimizer)

    def _train_step(self, args: tuple[Any, ...], kwargs: dict[str, Any], target: Any,
                    trace: bool, measure_memory: bool,
                    optimizer: torch.optim.Optimizer | None) -> torch.Tensor:
        leaves = self.signature.flatten(args, kwargs)
        m = self.signature.num_microbatches(leaves)
        runtime = self._schedule(m, training=True)
        losses: list[torch.Tensor] = []
        recorder = ActionRecorder(lambda s: self.pp_rank) if trace else None

        def step() -> None:
            first, last = self.pp_rank == self._first_rank, self.pp_rank == self._last_rank
            runtime.step(*(leaves if first else []), target=target if last else None,
                         losses=losses if last else None, return_outputs=False)

        if recorder is not None:
            self._guarded(lambda: dist.barrier(group=self._p2p_group))
            recorder.start([self.device])
        self._set_recorder(recorder)
        try:
            if measure_memory:
                held = [t for _, p in self.named_parameters() for t in (p, p.grad)
                        if t is not None] + list(self._local.values()) + self._receive_buffers()
                _, peaks = measure_peak_bytes(lambda: self._guarded(step), [self.device],
                                              held + optimizer_tensors(optimizer))
                mine = peaks[str(self.device) if self.device.type == "cuda" else "cpu"]
            else:
                self._guarded(step)
        finally:
            self._set_recorder(None)
        # the mean over microbatches (the loss_fn averages within one), as torch's scale_grads
        for p in {id(p): p for mod in self.stages for p in mod.parameters()}.values():
            if p.grad is not None:
                p.grad.div_(m)
        # float32 on every rank: the broadcast needs one dtype (a bf16 model's loss is bf16)
        loss = (torch.stack([x.detach() for x in losses]).mean().float() if losses
                else torch.zeros((), device=self.device))
        self._guarded(lambda: dist.broadcast(loss, src=self._global(self._last_rank),
                                             group=self._p2p_group))
        if recorder is not None:
            with recorder.span(self.pp_rank, "reduce", waits=False):
                self.reduce_grads()
            self.last_trace = Trace(tuple(self._gather_events(recorder.events())),
                                    f"measured:{self.device.type}",
                                    {"schedule_kind": self.plan.schedule_kind,
                                     "num_microbatches": m,
                                     "stages_per_rank": self.plan.stages_per_rank,
                                     "graph_fingerprint": self.plan.graph_fingerprint})
        else:
            self.reduce_grads()
        if measure_memory:
            self.last_peak_memory_bytes = self._gather_ints(mine)
        return loss

    def _receive_buffers(self) -> list[torch.Tensor]:
        """The buffers torch's stages receive into, one per microbatch for each input and
        each output gradient, allocated once and held across steps."""
        infos = [info for st in self.pipeline_stages
                 for table in (st.args_recv_info, getattr(st, "grad_recv_info", {}))
                 for group in table.values() for info in group]
        return [info.buffer for info in infos if getattr(info, "buffer", None) is not None]

    def _set_recorder(self, recorder: ActionRecorder | None) -> None:
        self._recorder = recorder
        for st in self.pipeline_stages:
            st.recorder, st.track = recorder, self.pp_rank

    def _gather_bytes(self, payload: bytes) -> list[bytes]:
        """Every pipeline rank's ``payload``, in pipeline-rank order (JSON, never pickle).

        Through the rendezvous store, not a gloo ``all_gather``: gloo runs a collective on its
        worker thread, which drops its last reference to the collective's tensors some time
        after the caller's wait returns. When that comes after the interpreter has started to
        exit (a process that ends right after a memory-measured step), the thread cannot take
        the GIL to free them and the process aborts ("terminate called without an active
        exception"; a core dump of one such abort showed ``AsyncAllgatherWork``'s destructor
        on gloo's ``runLoop`` thread inside ``take_gil``). Each rank deletes its own key of
        the gather before last, which every rank has read by then.
        """
        self._gathers += 1
        n = self._gathers
        keys = [f"{self._gather_prefix}/{n}/{r}" for r in range(self.pp_size)]
        timeout = datetime.timedelta(seconds=self.step_timeout_s)

        def exchange() -> list[bytes]:
            self._store.set(keys[self.pp_rank], payload)
            self._store.wait(keys, timeout)
            got = [bytes(self._store.get(k)) for k in keys]
            if n > 1:
                self._store.delete_key(f"{self._gather_prefix}/{n - 1}/{self.pp_rank}")
            return got

        return self._guarded(exchange)

    def _gather_events(self, events: list[TraceEvent]) -> list[TraceEvent]:
        rows = [[e.rank, e.name, e.start_us, e.end_us] for e in events]
        out = []
        for blob in self._gather_bytes(json.dumps(rows).encode()):
            out.extend(TraceEvent(int(r), str(n), float(a), float(b))
                       for r, n, a, b in json.loads(blob))
        return out

    def _gather_ints(self, value: int) -> list[int]:
        return [int(blob) for blob in self._gather_bytes(str(int(value)).encode())]

    def _global(self, pp_rank: int) -> int:
        if self.pp_group is None:
            return pp_rank
        return dist.get_process_group_ranks(self.pp_group)[pp_rank]

    def reduce_grads(self) -> None:
        """Sum tied parameters' gradients across the ranks holding them, then average every
        gradient across data-parallel replicas (``train_step`` calls it after the step)."""
        for fqn, group in self._tied_groups:
            p = self._local[fqn]
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=group)
        if self.dp_group is not None:
            size = dist.get_world_size(self.dp_group)
            for _, p in self.named_parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=self.dp_group)
                    p.grad.div_(size)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip every rank's gradients by the whole model's gradient norm.

        The norm equals ``torch.nn.utils.clip_grad_norm_`` on the unpartitioned model: each
        rank takes the p-norm of the parameters it owns (a tied parameter on the rank of
        its owning stage only; its replicas hold the same summed gradient), the pipeline
        ranks sum ``norm ** p`` (max for ``inf``), and data-parallel replicas, whose
        gradients are equal after ``train_step``, are not counted again. Every rank then
        scales all its gradients (replicas included) by ``min(1, max_norm / (norm + 1e-6))``.
        Collective over the pipeline group: call it on every rank after ``train_step``.

        Args:
            max_norm: the largest norm allowed, > 0.
            norm_type: p of the p-norm (default 2.0; ``float("inf")`` for the largest entry).
            error_if_nonfinite: raise when the norm is nan or inf (torch's flag).

        Returns:
            The total norm before clipping, the same on every rank (0-dim float32 tensor).

        Raises:
            RuntimeError: ``error_if_nonfinite`` and the norm is nan or inf (torch's error).
            PipelineFailure: a pipeline rank died during the reduction.
        """
        p = float(norm_type)
        owner = self._built.placement.owner
        grads = [t.grad for fqn, t in self.named_parameters() if t.grad is not None
                 and self.plan.stages[owner.get(fqn, 0)].rank == self.pp_rank]
        if grads:
            local = torch.nn.utils.get_total_norm(grads, p, foreach=None).to(torch.float32)
        else:
            local = torch.zeros((), dtype=torch.float32, device=self.device)
        inf = p == float("inf")
        total = local.clone() if inf else local.pow(p)

        def reduce() -> None:
            op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
            dist.all_reduce(total, op=op, group=self._p2p_group)

        self._guarded(reduce)
        if not inf:
            total = total.pow(1.0 / p)
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(f"the total norm of order {p} of the gradients is non-finite, so "
                               "it cannot be clipped; pass error_if_nonfinite=False to clip "
                               "anyway")
        torch.nn.utils.clip_grads_with_norm_(list(self.parameters()), max_norm, total)
        return total

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Pipelined inference; the output (same structure as the model's) on every rank."""
        with self._on_own_cores():
            return self._forward(args, kwargs)

    def _forward(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        leaves = self.signature.flatten(args, kwargs)
        m = self.signature.num_microbatches(leaves)
        runtime = self._schedule(m, training=False)
        first, last = self.pp_rank == self._first_rank, self.pp_rank == self._last_rank
        out: Any = self._guarded(lambda: runtime.eval(*(leaves if first else [])))
        flat_out: list[Any] = []
        for k, meta in enumerate(self.signature.output_meta):
            mine = (out[k] if isinstance(out, (tuple, list)) else out) if last else None
            if meta is None:  # not a tensor: sent as an object
                box = [mine]
                self._guarded(lambda box=box: dist.broadcast_object_list(
                    box, src=self._global(self._last_rank), group=self._p2p_group))
                flat_out.append(box[0])
                continue
            shape, dtype = meta
            shape = (shape[0] * m, *shape[1:]) if shape else shape
            buf = (mine.detach().contiguous() if isinstance(mine, torch.Tensor)
                   else torch.empty(shape, dtype=dtype, device=self.device))
            self._guarded(lambda buf=buf: dist.broadcast(buf, src=self._global(self._last_rank),
                                                         group=self._p2p_group))
            flat_out.append(buf)
        return self.signature.output(flat_out)

    # ---- checkpoints -------------------------------------------------------------------
    def owned_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors whose owning stage is on this rank, by FQN (a tied parameter's
        replica on another rank excluded): what this rank writes to a checkpoint."""
        owner = self._built.placement.owner
        return {fqn: t for fqn, t in self._local.items()
                if self.plan.stages[owner.get(fqn, 0)].rank == self.pp_rank}

    def save(self, directory: str | os.PathLike[str], *, optimizer: Any = None,
             extra: dict[str, Any] | None = None, async_save: bool = False,
             keep: int = 1) -> Any:
        """Checkpoint model and optimizer state with DCP; call on every rank. See
        :func:`autopart.runtime.checkpoint.save_checkpoint`."""
        from autopart.runtime.checkpoint import save_checkpoint

        return save_checkpoint(self, directory, optimizer=optimizer, extra=extra,
                               async_save=async_save, keep=keep)

    # ---- files ---------------------------------------------------------------------
    def stage_sources(self) -> dict[int, str]:
        """Stage index -> source of this rank's stages; byte-identical to what the
        one-process pipeline of the same plan emits for them."""
        return self._built.sources()

    def save_plan(self, path: str | os.PathLike[str]) -> list[Path]:
        """Write the plan to ``path`` (from the first pipeline rank) and this rank's stage
        sources as ``stage_<s>.py`` beside it, each atomically. Returns the paths written."""
        target = Path(path)
        written = []
        if self.pp_rank == 0:
            self.plan.save(target)
            written.append(target)
        for s, source in self.stage_sources().items():
            out = target.parent / f"stage_{s}.py"
            write_text_atomic(out, source)
            written.append(out)
        return written

    def close(self) -> None:
        """Stop the heartbeat thread (call before ``dist.destroy_process_group``)."""
        self._heartbeat.stop()

