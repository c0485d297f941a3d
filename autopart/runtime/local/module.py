"""PipelinedModule: the partitioned model users call, train and checkpoint under original FQNs."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from autopart.codegen.stages import BuiltStages
from autopart.core.errors import PlanError
from autopart.core.memory import PeakMemory, device_key
from autopart.core.schedule import build_schedule, forward_schedule
from autopart.core.signature import InputSignature, call_loss, require_loss
from autopart.runtime._torch_private import incompatible_keys, version_counter
from autopart.runtime.checkpoint.state import CheckpointState
from autopart.runtime.local.cuda_graphs import StageGraphs
from autopart.runtime.local.executor import LocalExecutor
from autopart.runtime.pipeline import Pipeline
from autopart.runtime.tracing import ActionRecorder

__all__ = ["PipelinedModule", "state_layout"]


def state_layout(model: nn.Module) -> tuple[list[tuple[str, str]], list[str], list[str]]:
    """How ``model``'s state is named: ``(state_dict key, canonical FQN)`` pairs (a tied
    name maps to the FQN that ``named_parameters`` lists), the canonical parameter order
    and the canonical buffer order."""
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


class PipelinedModule(Pipeline):
    """A model split into pipeline stages that run under a schedule.

    Built by :func:`autopart.compile`; not constructed directly. ``pipe(x)`` and
    ``pipe.train_step(x, target=y)`` split the batch into microbatches of the size the
    pipeline was compiled for, so any batch that is a multiple of it works.

    Parameters appear under the original model's FQNs, each once: ``pipe.parameters()`` is
    what an optimizer takes. A parameter several stages read (tied weights) has one owner
    and replicas; after every backward the replicas' gradients are summed into the owner's,
    and the replicas are refreshed from the owner before the next forward whenever the
    owner changed (e.g. after ``opt.step()``).

    Attributes:
        plan: the plan this pipeline runs.
        stages: the stage modules (``fx.GraphModule``), stage ``s`` on ``devices[s]``.
        devices: device of each stage (its rank's device).
        timings_s: seconds spent per compile phase (capture, profile, solve, codegen).
    """

    def __init__(self, model: nn.Module, stages: BuiltStages, signature: InputSignature, *,
                 loss_fn: Callable[[Any, Any], torch.Tensor] | None,
                 timings_s: dict[str, float] | None = None,
                 issue_threads: int | None = 1) -> None:
        """Wrap ``stages`` (every stage built, see :func:`autopart.codegen.build_stages`).

        Args:
            model: the model the stages were built from (its tensor names and the tensors
                the graph never reads).
            stages: the built stages of every rank.
            signature: the inputs and outputs compiled for.
            loss_fn: ``(output, target) -> scalar``, or None for inference only.
            timings_s: seconds per compile phase, kept as ``timings_s``.
            issue_threads: host threads that issue the stages' work (see
                :attr:`issue_threads`; default 1).

        Raises:
            PlanError: ``issue_threads`` below 1.
        """
        super().__init__(stages, signature, loss_fn=loss_fn, timings_s=timings_s,
                         on_cpu=any(torch.device(d).type == "cpu" for d in stages.devices))
        plan = stages.plan
        self.stages = nn.ModuleList(stages.modules)
        self.devices = list(stages.devices)
        self._placement = stages.placement
        self._state_keys, self._param_order, self._buffer_order = state_layout(model)
        used = set(stages.placement.owner)
        self._unused = {fqn: t for fqn, t in list(model.named_parameters())
                        + list(model.named_buffers()) if fqn not in used}
        self._num_ranks = len(plan.ranks)
        self._executor = LocalExecutor(list(stages.runners), self.devices,  # type: ignore[arg-type]
                                       recompute=self._recompute,
                                       recompute_policy=plan.recompute_policy,
                                       issue_threads=issue_threads)
        self._replica_versions: dict[str, int] = {}
        self._cuda_graphs = False

    @property
    def issue_threads(self) -> int | None:
        """Host threads that issue the ranks' actions: 1 (the caller's thread issues every
        stage's work, in one global order), k (rank ``r`` on worker ``r % k``) or None (a
        worker thread per rank: CPU stages run at the same time, CUDA stages are issued in
        parallel; torchgpipe's scheme). Numerics are the same for every setting. Settable
        between steps.

        Raises:
            PlanError: set below 1.
        """
        return self._executor.issue_threads

    @issue_threads.setter
    def issue_threads(self, value: int | None) -> None:
        self._executor.issue_threads = value  # the executor checks it

    @property
    def cuda_graphs(self) -> bool:
        """Replay each stage's training forward and backward as CUDA graphs (default False).

        The first ``train_step`` after it is set runs eagerly and records the microbatch
        shapes; the graphs are captured after it (one copy per microbatch the stage holds at
        once) and replayed from the next step on
        (:class:`autopart.runtime.local.cuda_graphs.StageGraphs`). A stage that cannot be graphed
        (not CUDA, recompute, a split backward, a host sync or data-dependent shape in the
        capture) runs eagerly and its reason is printed once and kept in
        :attr:`cuda_graph_reasons`. Inference (``pipe(x)``) stays eager. Needs the weights
        updated in place (optimizers do) and the same microbatch shape every step.
        """
        return self._cuda_graphs

    @cuda_graphs.setter
    def cuda_graphs(self, value: bool) -> None:
        self._cuda_graphs = bool(value)
        self._executor.graphs = None  # made (and captured) afresh by the next train_step

    @property
    def cuda_graph_reasons(self) -> dict[int, str]:
        """Per stage that runs eagerly with ``cuda_graphs`` on, why (empty before the first
        step; a negative key ``-1 - s`` is a call of stage ``s`` that ran eagerly)."""
        graphs = self._executor.graphs
        return {} if graphs is None else dict(graphs.reasons)

    # ---- tensors under original names ----------------------------------------------
    def _tensor(self, fqn: str) -> torch.Tensor:
        if fqn in self._unused:
            return self._unused[fqn]
        return self._placement.tensors[(self._placement.owner[fqn], fqn)]

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        """The original model's parameters (owner copies), under its FQNs, each once."""
        for fqn in self._param_order:
            p = self._tensor(fqn)
            assert isinstance(p, nn.Parameter)
            yield prefix + fqn, p

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """The original model's buffers (owner copies), under its FQNs."""
        for fqn in self._buffer_order:
            yield prefix + fqn, self._tensor(fqn)

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "",
                   keep_vars: bool = False) -> dict[str, Any]:
        """Exactly the original model's ``state_dict`` keys (tied names included), owner values."""
        out: dict[str, Any] = OrderedDict() if destination is None else destination
        for key, fqn in self._state_keys:
            t = self._tensor(fqn)
            out[prefix + key] = t if keep_vars else t.detach()
        return out

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Copy values into owners and replicas.

        Raises:
            PlanError: with ``strict``, keys are missing or unexpected (both listed), or a
                shape differs from the model's.
        """
        expected = {key for key, _ in self._state_keys}
        missing = sorted(expected - set(state_dict))
        unexpected = sorted(set(state_dict) - expected)
        if strict and (missing or unexpected):
            raise PlanError(f"state_dict does not match the model: missing {missing[:5]}"
                            f"{'...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
                            f"{'...' if len(unexpected) > 5 else ''}; pass a state_dict of the "
                            "model this pipeline was compiled from")
        self._copy_state_in(state_dict, ((key, self._tensor(fqn)) for key, fqn in self._state_keys))
        self._sync_replicas(force=True)
        return incompatible_keys(missing, unexpected)

    def state_layout(self) -> list[tuple[str, str]]:
        """(state_dict key, canonical FQN) pairs: tied names map to the FQN that owns them."""
        return list(self._state_keys)

    def owned_tensors(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer of the model (owner copies, replicas excluded), by FQN:
        one process holds every stage. Ordered stage by stage (tensors the graph never reads
        with stage 0), parameters before buffers within a stage."""
        by_stage: dict[int, dict[str, torch.Tensor]] = {s: {} for s in range(len(self.stages))}
        for fqn in self._param_order + self._buffer_order:
            by_stage[self._placement.owner.get(fqn, 0)][fqn] = self._tensor(fqn)
        return {fqn: t for tensors in by_stage.values() for fqn, t in tensors.items()}

    def checkpoint_state(self) -> CheckpointState:
        """Every tensor, written and loaded by this process; a load refreshes the replicas."""
        owned = self.owned_tensors()
        return CheckpointState(owned, owned, {id(p): f for f, p in self.named_parameters()},
                               dict(self.state_layout()), self.plan, False, self.devices[0],
                               lambda: self._sync_replicas(force=True))

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip every gradient by the whole model's gradient norm, as
        ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` does on the plain model.

        Call after ``train_step`` (which has summed tied replicas' gradients into their
        owner, so each parameter is counted once); with a ``grad_scaler``, after
        ``scaler.unscale_(opt)``, as on the plain model.

        Args:
            max_norm: the largest norm allowed, > 0.
            norm_type: p of the p-norm (default 2.0; ``float("inf")`` for the largest entry).
            error_if_nonfinite: raise when the norm is nan or inf (torch's flag).

        Returns:
            The total norm before clipping (0-dim float tensor on the first stage's device).
        """
        return torch.nn.utils.clip_grad_norm_(list(self.parameters()), max_norm,
                                              norm_type=norm_type,
                                              error_if_nonfinite=error_if_nonfinite)

    # ---- tied-parameter replicas -----------------------------------------------------
    def _sync_replicas(self, force: bool = False) -> None:
        """Refresh replicas from their owner when the owner changed since the last sync."""
        with torch.no_grad():
            for fqn, stages in self._placement.replicas.items():
                owner = self._tensor(fqn)
                if not force and self._replica_versions.get(fqn) == version_counter(owner):
                    continue
                for s in stages:
                    replica = self._placement.tensors[(s, fqn)]
                    if replica is not owner:
                        replica.copy_(owner)
                self._replica_versions[fqn] = version_counter(owner)

    def _reduce_replica_grads(self) -> None:
        """Sum replica gradients into the owner's ``.grad`` (DeepSpeed's tied-weight all-reduce)."""
        with torch.no_grad():
            for fqn, stages in self._placement.replicas.items():
                owner = self._tensor(fqn)
                if not isinstance(owner, nn.Parameter):
                    continue
                for s in stages:
                    replica = self._placement.tensors[(s, fqn)]
                    if replica is owner or replica.grad is None:
                        continue
                    g = replica.grad.to(owner.device)
                    owner.grad = g.clone() if owner.grad is None else owner.grad.add_(g)
                    replica.grad = None

    # ---- running -------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Pipelined inference: microbatches flow forward only, nothing is kept for backward.

        Returns the same structure as ``model(*args, **kwargs)``; see
        :func:`autopart.core.microbatch.merge_leaves` for how microbatch outputs are joined.

        Raises:
            PlanError: inputs that do not fit the pipeline (:class:`InputSignature`).
        """
        self._sync_replicas()
        mbs = self.signature.split(args, kwargs)
        with torch.no_grad():
            schedule = forward_schedule(self._num_ranks, len(mbs), self.plan.stages_per_rank,
                                        kind=self.plan.schedule_kind)
            result = self._executor.run(schedule, mbs)
        return self.signature.merge([list(o) for o in result.outputs])

    def train_step(self, *args: Any, target: Any = None, trace: bool = False,
                   measure_memory: bool = False, optimizer: torch.optim.Optimizer | None = None,
                   grad_scaler: torch.amp.GradScaler | None = None,
                   **kwargs: Any) -> torch.Tensor:
        """Forward and backward of every microbatch; gradients accumulate in ``.grad``.

        With ``loss_fn`` a mean over the batch, the accumulated gradients equal those of
        ``loss_fn(model(*args, **kwargs), target).backward()`` (each microbatch's loss is
        scaled by 1/m). Call ``opt.zero_grad()`` and ``opt.step()`` around it as usual.

        fp16 with loss scaling (torch's AMP recipe)::

            with torch.autocast("cuda", dtype=torch.float16):
                loss = pipe.train_step(x, target=y, grad_scaler=scaler)
            scaler.unscale_(opt)            # optional: e.g. before pipe.clip_grad_norm_
            scaler.step(opt)                # skipped when any gradient is inf or nan
            scaler.update()

        The gradients then equal those of ``scaler.scale(loss).backward()`` on the plain
        model; ``opt`` holds this pipeline's parameters, so the scaler's inf/nan check sees
        every stage's gradients.

        Args:
            *args, **kwargs: model inputs; tensors ``(batch, ...)``, split along dim 0.
            target: passed to ``loss_fn``, split along dim 0 like the inputs.
            trace: record every action's start and end into ``last_trace`` (an
                :class:`autopart.core.trace.Trace`, one track per rank of the plan; default
                False).
            measure_memory: measure the step's peak memory per device into
                ``last_peak_memory_bytes`` (a :class:`autopart.core.memory.PeakMemory`:
                per device, and per rank as its device's figure; see
                :func:`autopart.core.memory.measure_peak_bytes`; on CPU the profiler it
                uses slows the step, so do not time such a step). Default False.
            optimizer: with ``measure_memory``, its state counts as held memory.
            grad_scaler: a ``torch.amp.GradScaler``: each microbatch's backward starts from
                ``grad_scaler.scale(loss / m)`` instead of ``loss / m`` (nothing changes when
                it is disabled); default None, no scaling.

        Returns:
            The full-batch loss (mean of the microbatch losses, unscaled), a detached 0-dim
            tensor.

        Raises:
            PlanError: compiled without ``loss_fn``, inputs that do not fit the pipeline, or
                a ``grad_scaler`` that is not a ``torch.amp.GradScaler``.
        """
        loss_fn = require_loss(self._loss_fn)
        scale_loss = self._loss_scaler(grad_scaler)
        self._sync_replicas()
        mbs = self.signature.split(args, kwargs)
        m = len(mbs)
        targets = self.signature.split_target(target, m)
        signature = self.signature

        def loss_closure(i: int, flat_out: tuple[Any, ...]) -> torch.Tensor:
            return call_loss(loss_fn, signature.output(flat_out), targets[i]) / m

        schedule = build_schedule(self.plan.schedule_kind, self._num_ranks, m,
                                  self.plan.stages_per_rank, recompute=self._recompute)
        rank_of = [st.rank for st in self.plan.stages]
        recorder = ActionRecorder(rank_of.__getitem__) if trace else None
        if self._cuda_graphs and self._executor.graphs is None:
            split = sorted({a.stage_index for acts in schedule for a in acts if a.kind == "I"})
            self._executor.graphs = StageGraphs(self._executor.stages, self.devices,
                                                recompute=self._recompute, split=split)

        def run() -> Any:
            if recorder is not None:
                recorder.start(self.devices)
            return self._executor.run(schedule, mbs, loss_closure=loss_closure,
                                      recorder=recorder, scale_loss=scale_loss)

        if measure_memory:
            result, peaks = self._measure_step(run, self.devices, optimizer,
                                               [b for _, b in self.named_buffers()])
            keys = [device_key(torch.device(d)) for d in self.devices]
            by_rank = {rank_of[s]: peaks[k] for s, k in enumerate(keys) if k in peaks}
            self.last_peak_memory_bytes = PeakMemory(dict(sorted(by_rank.items())), peaks)
        else:
            result = run()
        if recorder is not None:
            self.last_trace = self._trace(recorder.events(), f"measured:{self.devices[0]}", m)
        graphs = self._executor.graphs
        if graphs is not None and not graphs.captured:
            graphs.capture(result.max_live_activations)
        self._reduce_replica_grads()
        return torch.stack([loss for loss in result.losses if loss is not None]).sum()
