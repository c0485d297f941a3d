"""Multi-process pipelines: each rank builds only its stages and runs the plan's schedule on
torch.distributed.pipelining's runtime (gloo on CPU, NCCL on GPU)."""

from __future__ import annotations

import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime
from torch.utils.checkpoint import checkpoint

from autopart.codegen.params import build_stage_modules
from autopart.codegen.split import split_graph
from autopart.core.capture import CapturedGraph
from autopart.core.errors import AutopartError, PlanError
from autopart.core.plan import Plan
from autopart.core.schedule import build_schedule, to_csv

__all__ = ["DistributedPipeline", "PipelineFailure", "broadcast_plan"]


class PipelineFailure(AutopartError):
    """A rank of a multi-process pipeline failed or stopped responding."""


def broadcast_plan(plan: Plan | None, src: int = 0, group: dist.ProcessGroup | None = None) -> Plan:
    """Send ``src``'s plan to every rank as JSON bytes (validated on receipt, never pickled)."""
    import json

    from autopart.core.jsonio import dumps

    payload = dumps(plan.to_dict()).encode() if plan is not None else b""
    size = torch.tensor([len(payload)], dtype=torch.int64)
    dist.broadcast(size, src=src, group=group)
    data = torch.zeros(int(size.item()), dtype=torch.uint8)
    if plan is not None:
        data.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    dist.broadcast(data, src=src, group=group)
    return Plan.from_dict(json.loads(bytes(data.tolist()).decode()))


class _Heartbeat:
    """Each rank stamps ``autopart/alive/<rank>`` in the rendezvous store every ``period_s``;
    after a failure the stalest stamp names the rank that died."""

    def __init__(self, store: dist.Store, rank: int, world: int, period_s: float = 0.5) -> None:
        self.store, self.rank, self.world, self.period_s = store, rank, world, period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="autopart-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.is_set():
            try:
                self.store.set(f"autopart/alive/{self.rank}", repr(time.time()))
            except Exception:  # the store went away with rank 0; the main thread reports it
                return
            self._stop.wait(self.period_s)

    def suspect(self, within_s: float = 5.0) -> list[int]:
        """Ranks whose stamp is older than four periods (or missing), polling for up to
        ``within_s`` seconds: a dead peer's stamp needs a few periods to go stale."""
        deadline = time.time() + within_s
        while True:
            stale = self._stale()
            if stale or time.time() >= deadline:
                return stale
            time.sleep(self.period_s)

    def _stale(self) -> list[int]:
        now, stale = time.time(), []
        for r in range(self.world):
            if r == self.rank:
                continue
            try:
                self.store.wait([f"autopart/alive/{r}"], _timedelta(0.2))
                stamp = float(self.store.get(f"autopart/alive/{r}").decode())
            except Exception:
                stale.append(r)
                continue
            if now - stamp > 4 * self.period_s:
                stale.append(r)
        return stale

    def stop(self) -> None:
        self._stop.set()


def _timedelta(seconds: float) -> Any:
    import datetime

    return datetime.timedelta(seconds=seconds)


class _P2PStage(nn.Module):
    """A stage adapted to point-to-point transfer, which moves dense buffers only.

    Outputs are made contiguous before they are sent (a pass-through mask is often an
    ``expand`` view); inputs whose captured layout was strided (a transposed activation)
    are copied back into that layout, because the stage's graph may ``view`` them. A stage
    the plan marks ``recompute`` runs its forward under non-reentrant
    ``torch.utils.checkpoint`` when gradients are on: only its inputs are kept, and the
    backward rebuilds the rest.
    """

    def __init__(self, stage: fx.GraphModule, recompute: bool = False) -> None:
        super().__init__()
        self.stage = stage
        self.recompute = recompute
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
        if self.recompute and torch.is_grad_enabled():
            out = checkpoint(self.stage, *restored, use_reentrant=False)
        else:
            out = self.stage(*restored)
        return tuple(o.contiguous() if isinstance(o, torch.Tensor) else o for o in out)


class _Stage(PipelineStage):
    """``PipelineStage`` whose recomputed stage does not split its backward.

    Every autograd call that reads a checkpointed stage's saved tensors re-runs its forward,
    and torch's input/weight split makes several such calls per microbatch (one for the
    input gradients, then one per parameter group): measured, 5-6 forwards per microbatch
    instead of 2. So, as in the local executor, a recomputed stage's ``I`` runs its whole
    backward and its ``W`` has nothing left to do; the solver prices it that way.
    """

    def __init__(self, submod: _P2PStage, *args: Any, **kwargs: Any) -> None:
        super().__init__(submod, *args, **kwargs)
        self._whole: set[int] = set()  # microbatches whose I ran the whole backward

    def backward_one_chunk(self, bwd_chunk_id: int, loss: Any = None, full_backward: bool = True,
                           last_backward: bool = False) -> Any:
        if self.submod.recompute and not full_backward:
            self._whole.add(bwd_chunk_id)
            full_backward = True
        return super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                          last_backward=last_backward)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> Any:
        if bwd_chunk_id in self._whole:
            self._whole.discard(bwd_chunk_id)
            return None
        return super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)


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


class DistributedPipeline(nn.Module):
    """This rank's share of a pipeline: its stages, run under the plan's schedule.

    Execution uses ``torch.distributed.pipelining``: each local stage module becomes a
    ``PipelineStage`` and the plan's action list (autopart's schedule, written in the CSV
    action format) is loaded into its ``_PipelineScheduleRuntime``, which inserts the
    point-to-point sends and receives. That runtime runs all four schedule kinds, split
    backward (``I``/``W``) included, so no P2P code of autopart's own is needed.

    After the step: gradients of a tied parameter held by several ranks are summed across
    them (all-reduce), and with a data-parallel group every gradient is averaged across
    its replicas. The loss (mean over microbatches) is broadcast from the last stage's
    rank, so ``train_step`` returns it on every rank; ``pipe(x)`` returns the output on
    every rank the same way.

    Args:
        model: the model (its tensors may be on ``meta``; then ``tensor_of`` supplies them).
        captured: the model captured at the plan's microbatch size.
        plan: the plan; stage ``s`` runs on pipeline rank ``plan.stages[s].rank``.
        device: this rank's device.
        loss_fn: ``(output, target) -> scalar``, or None for inference only.
        pp_group: process group of the pipeline ranks (default: the world).
        dp_group: process group of this rank's data-parallel replicas, or None.
        tensor_of: canonical FQN -> tensor, for materialised weights (see ``autopart.compile``).
    """

    def __init__(self, model: nn.Module, captured: CapturedGraph, plan: Plan, device: torch.device,
                 *, loss_fn: Callable[[Any, Any], torch.Tensor] | None,
                 pp_group: dist.ProcessGroup | None = None,
                 dp_group: dist.ProcessGroup | None = None,
                 tensor_of: Callable[[str], torch.Tensor] | None = None) -> None:
        super().__init__()
        self.plan = plan
        self.pp_group = pp_group
        self.dp_group = dp_group
        self.pp_rank = dist.get_rank(pp_group)
        self.pp_size = dist.get_world_size(pp_group)
        if self.pp_size != len(plan.ranks):
            raise PlanError(f"the plan has {len(plan.ranks)} ranks but the pipeline group has "
                            f"{self.pp_size}; launch with --nproc-per-node={len(plan.ranks)} "
                            "(times the data-parallel size)")
        self.device = device
        self.local_stages = [st.stage_index for st in plan.stages if st.rank == self.pp_rank]
        stage_graphs = split_graph(captured, [c.position for c in plan.cuts])
        devices = [device] * len(stage_graphs)
        built, placement = build_stage_modules(captured, stage_graphs, devices,
                                               keep=set(self.local_stages), tensor_of=tensor_of)
        self.stages = nn.ModuleList(mod for mod in built if mod is not None)
        self._in_spec, self._out_spec = captured.in_spec, captured.out_spec
        self._out_examples = [n for n in next(
            n for n in captured.graph_module.graph.nodes if n.op == "output").args[0]]
        self._microbatch_size = captured.batch_size
        self._loss_fn = loss_fn
        self._fqn_order = [fqn for fqn, _ in model.named_parameters()]
        # tensors this rank holds, by FQN (its own copy of a tied one included)
        self._local: dict[str, torch.Tensor] = {}
        for (s, fqn), t in placement.tensors.items():
            if s in self.local_stages:
                self._local.setdefault(fqn, t)
        self._tied_groups = self._make_tied_groups(placement)
        self._last_rank = plan.stages[-1].rank
        self._first_rank = plan.stages[0].rank
        self._stages_pp = [_Stage(_P2PStage(mod, plan.stages[s].recompute), s,
                                  len(stage_graphs), device, group=pp_group)
                           for mod, s in zip(self.stages, self.local_stages, strict=True)]
        store = dist.distributed_c10d._get_default_store()
        self._heartbeat = _Heartbeat(store, dist.get_rank(), dist.get_world_size())
        # The last runtime built, kept while steps keep its (m, training): a new runtime re-runs
        # the stages' shape inference and buffer set-up (a P2P exchange). Only one is kept
        # because the stages hold the buffers of whichever runtime set them up last.
        self._runtime: tuple[tuple[int, bool], _PipelineScheduleRuntime] | None = None

    def _make_tied_groups(self, placement: Any) -> list[tuple[str, dist.ProcessGroup | None]]:
        """One group per parameter read on several pipeline ranks, per pipeline replica.

        ``new_group`` is collective over the whole world: every rank creates every replica's
        groups in the same order (with a pp x dp mesh each data-parallel replica has its own
        pipeline group), and keeps those it belongs to.
        """
        groups: list[tuple[str, dist.ProcessGroup | None]] = []
        mine = (dist.get_process_group_ranks(self.pp_group) if self.pp_group is not None
                else list(range(dist.get_world_size())))
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        pipelines = sorted({tuple(ranks) for ranks in every})
        for fqn in sorted(placement.replicas):
            readers = [placement.owner[fqn], *placement.replicas[fqn]]
            ranks = sorted({self.plan.stages[s].rank for s in readers})
            if len(ranks) < 2:
                continue
            for pipeline in pipelines:
                group = dist.new_group([pipeline[r] for r in ranks])
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

    # ---- running ---------------------------------------------------------------------
    def _schedule(self, m: int, training: bool) -> _PipelineScheduleRuntime:
        if self._runtime is None or self._runtime[0] != (m, training):
            self._runtime = ((m, training), self._new_runtime(m, training))
        return self._runtime[1]

    def _new_runtime(self, m: int, training: bool) -> _PipelineScheduleRuntime:
        def loss(out: Any, target: Any) -> torch.Tensor:
            assert self._loss_fn is not None
            flat = list(out) if isinstance(out, (tuple, list)) else [out]
            return self._loss_fn(pytree.tree_unflatten(flat, self._out_spec), target)

        runtime = _PipelineScheduleRuntime(self._stages_pp, m,
                                           loss_fn=loss if training else None, scale_grads=True)
        actions = build_schedule(self.plan.schedule_kind, self.pp_size, m,
                                 self.plan.stages_per_rank)
        with tempfile.NamedTemporaryFile("w", suffix=".csv", delete=False) as f:
            f.write(to_csv(actions))
        try:
            runtime._load_csv(f.name)
        finally:
            os.unlink(f.name)
        return runtime

    def _flat(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        if spec != self._in_spec:
            raise PlanError(f"inputs have structure {spec}, but the pipeline was compiled for "
                            f"{self._in_spec}; pass the same positional and keyword inputs")
        return leaves

    def _num_microbatches(self, leaves: list[Any]) -> int:
        batch = next(int(t.shape[0]) for t in leaves if isinstance(t, torch.Tensor) and t.dim())
        if batch % self._microbatch_size:
            raise PlanError(f"batch of {batch} is not a multiple of the microbatch size "
                            f"{self._microbatch_size} this pipeline was compiled for")
        return batch // self._microbatch_size

    def _guarded(self, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except PlanError:
            raise
        except Exception as exc:
            suspects = self._heartbeat.suspect()
            stages_of = {r: [st.stage_index for st in self.plan.stages if st.rank == r]
                         for r in range(self.pp_size)}
            text = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            if not suspects:
                raise PipelineFailure(f"pipeline step failed on rank {self.pp_rank} (stages "
                                      f"{stages_of[self.pp_rank]}): {text}") from exc
            who = ", ".join(f"rank {r} (stages {stages_of.get(r, '?')})" for r in suspects)
            raise PipelineFailure(f"pipeline step failed on rank {self.pp_rank}: {who} failed or "
                                  f"stopped responding ({text})") from exc

    def train_step(self, *args: Any, target: Any = None, **kwargs: Any) -> torch.Tensor:
        """Every microbatch forward and backward; returns the mean loss on every rank.

        Inputs are needed on the first stage's rank, ``target`` on the last stage's rank
        (passing them everywhere is fine). Gradients accumulate in ``.grad``.

        Raises:
            PlanError: compiled without ``loss_fn``, or a batch that does not fit.
            PipelineFailure: a rank failed or stopped responding; names it and its stages.
        """
        if self._loss_fn is None:
            raise PlanError("train_step needs a loss: pass loss_fn=... to autopart.compile")
        leaves = self._flat(args, kwargs)
        m = self._num_microbatches(leaves)
        runtime = self._schedule(m, training=True)
        losses: list[torch.Tensor] = []

        def step() -> None:
            first, last = self.pp_rank == self._first_rank, self.pp_rank == self._last_rank
            runtime.step(*(leaves if first else []), target=target if last else None,
                         losses=losses if last else None, return_outputs=False)

        self._guarded(step)
        loss = (torch.stack([x.detach() for x in losses]).mean() if losses
                else torch.zeros((), device=self.device))
        self._guarded(lambda: dist.broadcast(loss, src=self._global(self._last_rank),
                                             group=self.pp_group))
        self._reduce_grads()
        return loss

    def _global(self, pp_rank: int) -> int:
        if self.pp_group is None:
            return pp_rank
        return dist.get_process_group_ranks(self.pp_group)[pp_rank]

    def _reduce_grads(self) -> None:
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

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Pipelined inference; the output (same structure as the model's) on every rank."""
        leaves = self._flat(args, kwargs)
        m = self._num_microbatches(leaves)
        runtime = self._schedule(m, training=False)
        first, last = self.pp_rank == self._first_rank, self.pp_rank == self._last_rank
        out: Any = self._guarded(lambda: runtime.eval(*(leaves if first else [])))
        flat_out: list[torch.Tensor] = []
        for k, node in enumerate(self._out_examples):
            val = node.meta["val"]
            shape = (val.shape[0] * m, *val.shape[1:]) if val.dim() else val.shape
            if last:
                mine = out[k] if isinstance(out, (tuple, list)) else out
                buf = mine.detach().contiguous()
            else:
                buf = torch.empty(shape, dtype=val.dtype, device=self.device)
            self._guarded(lambda buf=buf: dist.broadcast(buf, src=self._global(self._last_rank),
                                                         group=self.pp_group))
            flat_out.append(buf)
        return pytree.tree_unflatten(flat_out, self._out_spec)

    def close(self) -> None:
        """Stop the heartbeat thread (call before ``dist.destroy_process_group``)."""
        self._heartbeat.stop()

