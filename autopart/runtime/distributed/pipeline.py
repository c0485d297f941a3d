"""Multi-process pipelines: each rank builds only its stages and runs the plan's schedule on
torch.distributed.pipelining's runtime (gloo on CPU, NCCL on GPU)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autopart.codegen.stages import BuiltStages
from autopart.core.context import context_share
from autopart.core.errors import PipelineFailure, PlanError
from autopart.core.memory import PeakMemory, device_key
from autopart.core.signature import InputSignature, call_loss, replica_share, require_loss
from autopart.runtime._torch_private import (
    ScheduleRuntime,
    receive_buffers,
)
from autopart.runtime.distributed._comm import (
    StoreGather,
    broadcast_outputs,
    cpu_share,
    mesh_coordinates,
    pipelines_of,
    step_failure,
    tied_groups,
    time_out_groups,
    timed_group,
)
from autopart.runtime.distributed._grads import (
    ExpertGrads,
    grad_norm,
    mean_over_microbatches,
    reduce_grads,
    step_loss,
)
from autopart.runtime.distributed._rank_stages import rank_stages
from autopart.runtime.distributed._rank_tensors import RankTensors
from autopart.runtime.distributed._scaling import ScaledLosses, agree_on_overflow
from autopart.runtime.distributed._schedule import StepSchedules
from autopart.runtime.distributed._state import WholeTensors
from autopart.runtime.distributed._tensor_parallel import (
    expert_parallel_state,
    tensor_parallel_state,
)
from autopart.runtime.distributed.heartbeat import DEFAULT_STEP_TIMEOUT_S, Heartbeat
from autopart.runtime.host import on_rank_cores
from autopart.runtime.tracing import ActionRecorder, events_from_json, events_to_json

__all__ = ["DistributedPipeline"]

class DistributedPipeline(RankTensors):
    """This rank's share of a pipeline: its stages, run under the plan's schedule.

    Execution uses ``torch.distributed.pipelining``: each local stage module becomes a
    ``PipelineStage`` and the plan's action lists (autopart's schedule, recomputed stages
    running whole ``B`` backwards as the schedule says and recomputing what the plan's
    ``recompute_policy`` says) are handed to torch's schedule runtime
    (:func:`autopart.runtime._torch_private.new_schedule_runtime`), which inserts the
    point-to-point sends and receives. That runtime runs every schedule kind, split backward
    (``I``/``W``) included, so no P2P code of autopart's own is needed; it maps stages to
    ranks from the actions (the V schedules' two stages per rank included) and hands the
    values between two neighbouring stages of one rank over in memory.

    During a step, CPU ranks that share a host run on disjoint, contiguous shares of its
    cores (:func:`autopart.runtime.host.core_share`, every thread of the process): unpinned,
    the OS runs a rank's gloo receive thread beside the other rank's compute. Off with
    ``$AUTOPART_CPU_AFFINITY=0``, fewer cores than ranks, or ranks already pinned apart.
    After the step, gradients are reduced (:meth:`reduce_grads`: tied sums, dp means or
    ZeRO's reduce-scatter, :mod:`autopart.runtime.distributed._sharding`) and the loss and
    ``pipe(x)``'s output are broadcast from the last stage's rank to every rank.

    Attributes:
        plan: the plan.
        signature: the inputs and outputs compiled for.
        pipeline_stages: torch ``PipelineStage`` objects of this rank's stages, in stage
            order (for driving them with torch's own schedules).
        timings_s: seconds per compile phase.
        cpu_cores: the cores this CPU rank's steps run on, or None (not pinned).
        receives_first: post every receive of a step when it starts (default True on gloo,
            False otherwise), instead of just before the action that needs it, as torch's
            schedule runtime does (:func:`autopart.runtime._torch_private.
            receives_first_order`): gloo holds a send until its receive is posted. Set
            between steps, on every rank alike; True on NCCL raises ``PlanError`` at the
            next step.
        overlap_pairs: where the plan's DualPipe-V pairs may hide their expert all-to-alls
            (:func:`autopart.core.plan_rules.overlaps_expert_exchanges`), run each pair's
            forward and backward at once, on two threads; else one after the other. Default
            True on CUDA ranks, False on CPU ranks, as the solver prices them: on CPU the
            two threads share the rank's cores with the all-to-alls themselves and with the
            other ranks, and measured slower (this project's 2-core CPU, 4 gloo ranks, a
            Mixtral-like model at pp 2 x dp 2 x ep 2, DualPipe-V m 4: 572.4 ms a step
            overlapped against 462.7 ms one after the other, ``benchmarks/expert_parallel``).
            Set between steps, on every rank alike.

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
        tp_group: process group of this rank's tensor-parallel peers (needed when the
            plan's tp > 1; ``stages`` built with ``tp=TensorParallelRank.of_group(it)``):
            parameters are then this rank's shards, ``state_dict`` gathers full tensors
            (:mod:`autopart.runtime.distributed._tensor_parallel`).
        ep_group: the ep consecutive dp replicas this rank splits the experts with (needed
            when the plan's ep > 1; ``stages`` built with ``ep=TensorParallelRank.of_group(
            it)``): the expert weights are then this rank's experts, averaged over
            ``edp_group`` (:class:`autopart.runtime.distributed._grads.ExpertGrads`), and
            ``state_dict`` gathers them whole.
        edp_group: the replicas holding the same experts as this rank, or None (ep = dp).
        timings_s: seconds per compile phase, kept as ``timings_s``.
        step_timeout_s: a send or receive of the pipeline, or a collective of its tp or dp
            group (whose timeout is set to this: :func:`~autopart.runtime.distributed._comm.
            time_out_groups`), that waits this long fails the step (default 300 s): every
            rank then raises :class:`PipelineFailure` naming the rank that died or hangs (its
            global rank, (pp, dp, tp) and stages) and the action it hangs in, and a hung
            rank is told to exit (its heartbeat thread ends the process; see
            :class:`autopart.runtime.distributed.heartbeat.Heartbeat`).

    Raises:
        PlanError: the pipeline group's size differs from the plan's rank count; ep > 1
            without its group, or with tp > 1 or ZeRO 1-3 (not run yet); a ZeRO
            stage the groups or the placement cannot run
            (:class:`autopart.runtime.distributed._sharding.DataSharding`).
    """

    def __init__(self, model: nn.Module, stages: BuiltStages, signature: InputSignature,
                 device: torch.device, *, loss_fn: Callable[[Any, Any], torch.Tensor] | None,
                 pp_group: dist.ProcessGroup | None = None,
                 dp_group: dist.ProcessGroup | None = None,
                 tp_group: dist.ProcessGroup | None = None,
                 ep_group: dist.ProcessGroup | None = None,
                 edp_group: dist.ProcessGroup | None = None,
                 timings_s: dict[str, float] | None = None,
                 step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S) -> None:
        super().__init__(stages, signature, loss_fn=loss_fn, timings_s=timings_s,
                         on_cpu=device.type == "cpu")
        plan = stages.plan
        self.pp_group = pp_group
        self.dp_group = dp_group
        self._tp = tensor_parallel_state(stages, tp_group)
        self._ep = expert_parallel_state(stages, ep_group)
        self.pp_rank = dist.get_rank(pp_group)
        self.pp_size = dist.get_world_size(pp_group)
        if self.pp_size != len(plan.ranks):
            raise PlanError(f"the plan has {len(plan.ranks)} ranks but the pipeline group has "
                            f"{self.pp_size}; launch with --nproc-per-node={len(plan.ranks)} "
                            "(times the data-parallel size)")
        self.device = device
        self.cpu_cores = cpu_share(device)  # see the class docstring
        self.local_stages = list(stages.local)
        self.stages = nn.ModuleList(stages.modules[s] for s in self.local_stages)
        self._fqn_order = [fqn for fqn, _ in model.named_parameters()]
        placement = stages.placement
        # tensors this rank holds, by FQN (its own copy of a tied one included)
        self._local: dict[str, torch.Tensor] = {}
        for (s, fqn), t in placement.tensors.items():
            if s in self.local_stages:
                self._local.setdefault(fqn, t)
        self.step_timeout_s = step_timeout_s
        pipelines, mine = pipelines_of(pp_group)
        self._coords = mesh_coordinates(pp_group, dp_group, tp_group, step_timeout_s)
        self._p2p_group = timed_group(pipelines, mine, step_timeout_s)
        self._tied_groups = tied_groups(placement, plan, pipelines, mine, self.pp_rank,
                                        self._local, step_timeout_s)
        self._gather = StoreGather(mine, self.pp_rank, step_timeout_s, self._guarded)
        time_out_groups([dp_group, tp_group], step_timeout_s)
        self._last_rank = plan.stages[-1].rank
        self._first_rank = plan.stages[0].rank
        self._heartbeat = Heartbeat(self._gather.store, dist.get_rank(), dist.get_world_size(),
                                    hung_after_s=step_timeout_s)
        self._experts = None if self._ep is None else ExpertGrads(
            frozenset(id(self._local[f]) for f in self._ep.shards if f in self._local),
            edp_group, plan.ep)
        built = rank_stages(stages, self.local_stages, self._local, self._fqn_order, device,
                            self._heartbeat, dp_group, self._p2p_group,
                            exclude=self._experts.ids if self._experts else frozenset())
        self._sharding, self._local = built.sharding, built.local
        self.pipeline_stages, self._grad_buckets = built.pipeline_stages, built.grad_buckets
        self._comm_timer = self._sharding.timer  # where the dp collectives report when traced
        whole_shapes = {f: tuple(t.shape) for f, t in [
            *model.named_parameters(remove_duplicate=False),
            *model.named_buffers(remove_duplicate=False)]}
        self._whole = WholeTensors(self._local, whole_shapes, self._sharding, self._tp,
                                   self._ep)
        self._schedules = StepSchedules(self.pipeline_stages, plan, self.pp_size,
                                        self._recompute, self.loss_of_flat,
                                        gloo=dist.get_backend(self._p2p_group) == "gloo")
        self.receives_first = self._schedules.gloo  # see the class docstring
        self.overlap_pairs = device.type == "cuda"  # see the class docstring
        self._recorder: ActionRecorder | None = None
        self._scaled_losses: ScaledLosses | None = None  # during a step with a grad_scaler

    def _on_own_cores(self) -> contextlib.AbstractContextManager[None]:
        """Every thread of this process on :attr:`cpu_cores` meanwhile
        (:func:`autopart.runtime.host.on_rank_cores`)."""
        return on_rank_cores(self)

    # ---- running ---------------------------------------------------------------------
    def _schedule(self, m: int, training: bool) -> ScheduleRuntime:
        return self._schedules.runtime(m, training, bool(self.receives_first),
                                       bool(self.overlap_pairs))

    def loss_of_flat(self, out: Any, target: Any) -> torch.Tensor:
        """``loss_fn`` on the last stage's flat output (a tensor or a tuple of them), as
        torch's schedules call it; during a step with a ``grad_scaler``, the scaled loss
        (the backward's start; the unscaled one is kept for ``train_step`` to return).

        Raises:
            PlanError: compiled without ``loss_fn``, a loss that is not a scalar, or one that
                fails without a target (:func:`autopart.core.signature.call_loss`).
        """
        flat = list(out) if isinstance(out, (tuple, list)) else [out]
        recorder = self._recorder
        with contextlib.ExitStack() as stack:
            if recorder is not None:
                stream = (torch.cuda.current_stream(self.device) if self.device.type == "cuda"
                          else None)
                stack.enter_context(recorder.span(self.pp_rank, "loss", stream, waits=False))
            loss = call_loss(require_loss(self._loss_fn), self.signature.output(flat), target)
            return loss if self._scaled_losses is None else self._scaled_losses.scale(loss)

    def _guarded(self, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except PlanError:
            raise
        except Exception as exc:
            raise self._failure(exc) from exc

    def _failure(self, exc: Exception) -> PipelineFailure:
        """The error a failed step raises (:func:`autopart.runtime.distributed._comm.step_failure`)."""
        return step_failure(exc, self._heartbeat, self.plan, self._coords, dist.get_rank(),
                            self.step_timeout_s)

    def train_step(self, *args: Any, target: Any = None, trace: bool = False,
                   measure_memory: bool = False, optimizer: torch.optim.Optimizer | None = None,
                   grad_scaler: torch.amp.GradScaler | None = None,
                   **kwargs: Any) -> torch.Tensor:
        """Every microbatch forward and backward; returns the global batch's mean loss on
        every rank.

        Inputs are needed on the first stage's rank, ``target`` on the last stage's rank
        (passing them everywhere is fine). Gradients accumulate in ``.grad``. With a plan
        of dp > 1 replicas, pass the global batch (each replica keeps its own rows) or the
        replica's share; either way the loss returned is the global batch's (the replicas'
        mean losses averaged over dp, one scalar all-reduce), and gradients are averaged
        over dp.

        fp16 with loss scaling: every rank passes its own ``torch.amp.GradScaler`` (built
        alike), then runs torch's AMP recipe (``scaler.unscale_(opt)`` and
        ``pipe.clip_grad_norm_`` if wanted, ``scaler.step(opt)``, ``scaler.update()``); a
        step that overflowed on any rank is skipped on every rank, whose scales stay equal
        (:func:`autopart.runtime.distributed._scaling.agree_on_overflow`).

        Args:
            trace: record every action of every rank of this pipeline into ``last_trace``
                on every rank (:class:`autopart.core.trace.Trace`, one track per pipeline
                rank, µs from a barrier all ranks leave together; default False). Must be
                the same on every rank.
            measure_memory: measure this rank's peak memory into
                ``last_peak_memory_bytes`` (a :class:`autopart.core.memory.PeakMemory`:
                every pipeline rank's figure, gathered on every rank, and this rank's
                device's; see :func:`autopart.core.memory.measure_peak_bytes`; on CPU the
                profiler it uses slows the step, so do not time such a step). Same on every
                rank; default False.
            optimizer: with ``measure_memory``, its state counts as held memory.
            grad_scaler: this rank's ``torch.amp.GradScaler``, or None (no scaling, the
                default): each microbatch's backward starts from ``grad_scaler.scale(loss)``
                (gradients are then divided by m, as without it); the loss returned stays
                unscaled. Given on every rank or on none.

        Raises:
            PlanError: compiled without ``loss_fn``, a batch that does not fit, or a
                ``grad_scaler`` that is not a ``torch.amp.GradScaler``.
            PipelineFailure: a rank failed or stopped responding; names it and its stages.
        """
        require_loss(self._loss_fn)
        scale_loss = self._loss_scaler(grad_scaler)
        args, kwargs, target = self._replica_share(args, kwargs, target)
        with self._on_own_cores():
            return self._train_step(args, kwargs, target, trace, measure_memory, optimizer,
                                    scale_loss)

    def _train_step(self, args: tuple[Any, ...], kwargs: dict[str, Any], target: Any,
                    trace: bool, measure_memory: bool,
                    optimizer: torch.optim.Optimizer | None,
                    scale_loss: Callable[[torch.Tensor], torch.Tensor] | None) -> torch.Tensor:
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
        self._comm_timer.attach(recorder, self.pp_rank, self.device)
        try:
            loss, mine = self._run_and_reduce(step, recorder, m, measure_memory, optimizer,
                                              scale_loss, losses)
        finally:
            self._comm_timer.attach(None, self.pp_rank, self.device)
        if recorder is not None:
            rows = self._gather.gather_bytes(events_to_json(recorder.events()))
            self.last_trace = self._trace([e for blob in rows for e in events_from_json(blob)],
                                          f"measured:{self.device.type}", m)
        if measure_memory:
            by_rank = dict(enumerate(self._gather.gather_ints(mine)))
            self.last_peak_memory_bytes = PeakMemory(by_rank, {device_key(self.device): mine})
        return loss

    def _run_and_reduce(self, step: Callable[[], None], recorder: ActionRecorder | None, m: int,
                        measure_memory: bool, optimizer: torch.optim.Optimizer | None,
                        scale_loss: Callable[[torch.Tensor], torch.Tensor] | None,
                        losses: list[torch.Tensor]) -> tuple[torch.Tensor, int]:
        """The schedule (``step``), then the step's loss and the gradient reductions; the
        loss and this rank's peak bytes (0 unless ``measure_memory``). Traced, the
        reductions are the ``reduce`` slice of this rank's compute lane, and their
        collectives after the step (tied sums, dp means, overflow flags) a ``"reduce
        grads"`` slice of its comm lane, exposed on its compute lane (CPU)."""
        mine = 0
        self._set_recorder(recorder)
        scaled = None if scale_loss is None else ScaledLosses(scale_loss, self.device)
        self._scaled_losses = scaled
        try:
            if measure_memory:
                resident = list(self._local.values()) + [
                    b for st in self.pipeline_stages for b in receive_buffers(st)]
                _, peaks = self._measure_step(lambda: self._guarded(step), [self.device],
                                              optimizer, resident)
                mine = peaks[device_key(self.device)]
            else:
                self._guarded(step)
        finally:
            self._set_recorder(None)
            self._scaled_losses = None
        loss = step_loss(losses if scaled is None else scaled.unscaled(losses), self.device,
                         self._global(self._last_rank), self._p2p_group, self.dp_group,
                         self._guarded)

        def collectives() -> None:
            self._guarded(self.reduce_grads)  # a dead or hung replica: PipelineFailure
            if scaled is not None:  # every rank's scaler skips when one overflowed
                for group in (self._p2p_group, self._sharding.dp_group):  # ZeRO: shards differ
                    if group is not None:
                        agree_on_overflow(self.parameters(), self.device, group, self._guarded)

        with (contextlib.nullcontext() if recorder is None
              else recorder.span(self.pp_rank, "reduce", waits=False)):
            if self._grad_buckets is not None:  # the overlapped reduction's exposed tail
                self._guarded(self._grad_buckets.finish)
            mean_over_microbatches(self.stages, m)
            self._comm_timer.blocking("reduce grads", collectives)
        return loss, mine

    def _set_recorder(self, recorder: ActionRecorder | None) -> None:
        self._recorder = recorder
        for st in self.pipeline_stages:
            st.recorder, st.track = recorder, self.pp_rank

    def _global(self, pp_rank: int) -> int:
        if self.pp_group is None:
            return pp_rank
        return dist.get_process_group_ranks(self.pp_group)[pp_rank]

    def reduce_grads(self) -> None:
        """Sum tied parameters' gradients across the ranks holding them, then average every
        gradient across data-parallel replicas (``train_step`` calls it after the step)."""
        params: list[torch.Tensor] = list(self.parameters())
        if self._grad_buckets is not None:  # averaged during the step already
            params = self._grad_buckets.uncovered(params)
        reduce_grads(self._local, self._tied_groups, params, self.dp_group, self._sharding,
                     self._experts)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip every rank's gradients by the whole model's gradient norm.

        The norm equals ``torch.nn.utils.clip_grad_norm_`` on the unpartitioned model: each
        rank takes the p-norm of the parameters it owns (a tied parameter on the rank of
        its owning stage only; its replicas hold the same summed gradient), the pipeline
        ranks sum ``norm ** p`` (max for ``inf``), and data-parallel replicas, whose
        gradients are equal after ``train_step``, are not counted again (under ZeRO 1-3 each
        holds a disjoint shard: the dp group sums those too). Every rank then
        scales all its gradients (replicas included) by ``min(1, max_norm / (norm + 1e-6))``.
        Collective over the pipeline group: call it on every rank after ``train_step``
        (with a ``grad_scaler``, after every rank's ``scaler.unscale_(opt)``).

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
        owner = self._built.placement.owner
        owned = [(fqn, t) for fqn, t in self.named_parameters()
                 if self.plan.stages[owner.get(fqn, 0)].rank == self.pp_rank]
        total = grad_norm(owned, norm_type, self.device, self._p2p_group, self._tp,
                          self._sharding, self._guarded, self._ep)
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(f"the total norm of order {float(norm_type)} of the gradients is "
                               "non-finite, so "
                               "it cannot be clipped; pass error_if_nonfinite=False to clip "
                               "anyway")
        self._sharding.scale_grads(self.parameters(), max_norm, total)
        return total

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Pipelined inference; the output (same structure as the model's) on every rank.
        With a plan of dp > 1 replicas, a global batch gives this replica's rows' output
        (see :meth:`_replica_share`).

        Raises:
            PlanError: a plan with cp > 1 (each rank would get its own tokens' output, in its
                chunks' order; not gathered yet): use ``train_step``, or a cp = 1 plan for
                inference.
        """
        if self.plan.cp > 1:
            raise PlanError(f"forward with cp={self.plan.cp}: each rank holds its own tokens of "
                            "every sequence, and their outputs are not gathered back into "
                            "sequence order yet; train with train_step, and run inference on a "
                            "plan with cp=1")
        args, kwargs, _ = self._replica_share(args, kwargs, None)
        with self._on_own_cores():
            return self._forward(args, kwargs)

    def _replica_share(self, args: tuple[Any, ...], kwargs: dict[str, Any], target: Any,
                       ) -> tuple[tuple[Any, ...], dict[str, Any], Any]:
        """A plan made for dp > 1 replicas takes the global batch (every rank passes the same)
        or this replica's share; the global one is cut to this replica's rows
        (:func:`autopart.core.signature.replica_share`). With cp > 1 the rows' whole sequences
        are then cut to this rank's tokens, with their positions
        (:func:`autopart.core.context.context_share`; the dp group holds dp x cp ranks, cp
        consecutive ones per replica)."""
        rank = dist.get_rank(self.dp_group) if self.dp_group is not None else 0
        cp = self.plan.cp
        args, kwargs, target = replica_share(self.plan, rank // cp, args, kwargs, target)
        return context_share(cp, rank % cp, args, kwargs, target)

    def _forward(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        leaves = self.signature.flatten(args, kwargs)
        m = self.signature.num_microbatches(leaves)
        runtime = self._schedule(m, training=False)
        first, last = self.pp_rank == self._first_rank, self.pp_rank == self._last_rank
        out: Any = self._guarded(lambda: runtime.eval(*(leaves if first else [])))
        flat_out = broadcast_outputs(out if last else None, self.signature.output_meta, m,
                                     self._global(self._last_rank), self._p2p_group,
                                     self.device, self._guarded)
        return self.signature.output(flat_out)

    def _writes_plan_file(self) -> bool:
        return self.pp_rank == 0

    def close(self) -> None:
        """Stop the heartbeat thread (call before ``dist.destroy_process_group``)."""
        self._heartbeat.stop()
