"""ZeRO-1/2/3 over a pipeline's data-parallel replicas: FSDP2 (``fully_shard``) on each stage.

How the plan's ZeRO stage maps onto FSDP2 and torch's pipelining runtime (torch 2.13's
``torch/distributed/pipelining/stage.py`` and ``schedules.py``; torchtitan's
``distributed/fsdp.py`` composes them the same way, sharding the module each
``PipelineStage`` runs):

- ``fully_shard`` goes on the ``PipelineStage``'s submodule, the
  :class:`autopart.runtime.distributed._stages.P2PStage` of each local stage, so that torch's
  FSDP-aware stage logic fires (``isinstance(stage.submod, FSDPModule)``): the runtime
  all-gathers a stage's parameters (``UNSHARD``) before its first action and reshards it
  when it leaves the window of active stages; every microbatch's backward runs with
  ``requires_gradient_sync(False)`` and ``reshard_after_backward(False)``; ``REDUCE_GRAD``
  after the last backward reduce-scatters the accumulated gradients and reshards
  (``perform_reduce_grad``).
- ZeRO-1: ``reshard_after_forward=False`` and torch's flow as is: gradients accumulate
  unsharded over the microbatches and are reduce-scattered once, at the last one. The
  optimizer state is sharded because the parameters the user's optimizer sees
  (``pipe.parameters()``) are DTensor shards. FSDP2 has no mode that keeps whole parameter
  replicas between steps, so parameters are sharded at rest here too (as torchtitan's PP +
  FSDP runs are): ZeRO-1 costs one all-gather per stage per step.
- ZeRO-2: ``reshard_after_forward=False`` (FSDP1's ``SHARD_GRAD_OP``: parameters stay
  gathered between a microbatch's forward and its backward) and gradients reduce-scattered
  after every microbatch's backward (:class:`ShardedStage` calls torch's
  ``perform_reduce_grad`` per microbatch), after which the parameters are resharded.
- ZeRO-3: ``reshard_after_forward=True`` (FSDP1's ``FULL_SHARD``: parameters all-gathered
  for each forward and again for each backward) and gradients reduce-scattered per
  microbatch, as for ZeRO-2. (The FSDP1 names: ``fully_shard``'s docstring, torch 2.13.)
  Split backwards (``I`` then ``W``) keep a stage gathered from its ``I`` to its last
  pending ``W`` (see :class:`ShardedStage`).

With ``plan.zero_layer_units`` (backwards that do not split), each layer of a stage
is a unit of its own, as torchtitan shards a model per transformer block:
:func:`autopart.codegen.fsdp_units.group_layers` moves a layer's ops into a submodule at its
path, ``fully_shard`` goes on every layer and then on the stage's graph module (the root: the
embeddings, final norm and head), each unit prefetching the next one's all-gather in the
forward and the previous one's in the backward (``set_modules_to_forward_prefetch`` /
``set_modules_to_backward_prefetch``), and ZeRO-3's root reshards after its forward too (FSDP2
keeps a root gathered by default). The ``PipelineStage``'s submodule itself is then not an
FSDP module, so torch's stage treats it as a plain module: no ``UNSHARD`` of the whole stage
before its first action, and every microbatch's backward reduce-scatters and reshards each
unit as FSDP2 does outside a pipeline (gradient sync on, ``reshard_after_backward``), the
root's post-backward callback waiting for the reduce-scatters before the backward returns. At
ZeRO-3 a stage is never gathered whole: at most the root and two layers (the running one and
the prefetched one), each layer's unsharded gradients freed at its reduce-scatter. ZeRO-1
(:class:`AccumulatingStage`) keeps each layer gathered from its first forward to the step's
last backward and reduce-scatters it there, layer by layer during that backward; the next
step's first forward gathers the updated shards layer by layer, the next layer's all-gather
prefetched: whole parameters during the step, optimizer state on the shards.

FSDP2 reduce-scatters the mean over the replicas (``fully_shard``'s default), so gradients
end as today's ZeRO-0 all-reduce leaves them: the mean over the global batch. Tensors a
plan shares between stages of one rank cannot be sharded twice (a ``PlanError`` says so);
tied parameters held by several pipeline ranks (GPT-2's ``wte``) are sharded alike on each
rank (same dp mesh, same shape), so their local shards are summed across the ranks.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Collection, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from autopart.codegen.fsdp_units import group_layers
from autopart.core.errors import PlanError
from autopart.core.plan import Plan
from autopart.runtime._torch_private import time_fsdp_collectives
from autopart.runtime.distributed._stages import P2PStage, TracedStage
from autopart.runtime.tracing import CollectiveTimer

__all__ = ["AccumulatingStage", "DataSharding", "ShardedStage", "local_tensor"]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``t`` when it is a DTensor (a view: in-place ops write through),
    else ``t`` itself."""
    return t.to_local() if isinstance(t, DTensor) else t


class ShardedStage(TracedStage):
    """A traced stage whose gradients are reduce-scattered after each microbatch's backward
    (ZeRO-2 and -3; see the module docstring): after a full backward ``B``, or after the
    weight backward ``W`` that completes the last pending split one, of a stage whose
    submodule is an ``FSDPModule``, torch's ``perform_reduce_grad`` (reduce-scatter,
    accumulate into the sharded gradient, reshard).

    Split backwards (``I`` then ``W``) need the gathered parameters from ``I`` to ``W``:
    torch's ``I`` takes ``submod.parameters()`` when it starts, before FSDP's pre-backward
    hook gathers them, and its ``W`` differentiates towards those tensors. So before an
    ``I`` the stage is gathered (``unshard``), and until the last pending ``W`` is done it
    is neither resharded after a forward (ZeRO-3's ``reshard_after_forward`` is off
    meanwhile) nor reduced: a V schedule's microbatches whose ``W`` comes after another
    one's ``I`` are reduced together.

    Args:
        *args: ``TracedStage``'s.
        reshard_after_forward: the ZeRO stage's setting (True for ZeRO-3).
        **kwargs: ``TracedStage``'s.
    """

    def __init__(self, *args: Any, reshard_after_forward: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._reshard_after_forward = reshard_after_forward
        self._pending_weight = 0  # I done, W to come

    def _reduce_now(self) -> None:
        if self._pending_weight == 0 and isinstance(self.submod, FSDPModule):
            self.submod.set_reshard_after_forward(self._reshard_after_forward)
            self.perform_reduce_grad(1)

    def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        full = kwargs.get("full_backward", True)
        if not full and isinstance(self.submod, FSDPModule):
            self.submod.unshard()
            self.submod.set_reshard_after_forward(False)
            self._pending_weight += 1
        out = super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)
        if full:
            self._reduce_now()
        return out

    def backward_weight_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        out = super().backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs)
        self._pending_weight -= 1
        self._reduce_now()
        return out


class AccumulatingStage(TracedStage):
    """ZeRO-1 with one FSDP unit per layer (``plan.zero_layer_units``): gradients accumulate
    unsharded over the step's microbatches and each layer reduce-scatters in the stage's
    last backward, as its gradients become final (Megatron-LM's distributed optimizer with
    ``--overlap-grad-reduce``), and parameters stay gathered from their first forward to that
    backward: before every backward the stage's FSDP root (recursively) is told whether it
    is the step's last one for this stage (torch's ``last_backward``):
    ``set_requires_gradient_sync``, ``set_reshard_after_backward`` and
    ``set_is_last_backward`` follow it.

    Args:
        *args: ``TracedStage``'s; its submodule is a :class:`P2PStage` whose ``stage`` is
            the FSDP root.
        **kwargs: ``TracedStage``'s.
    """

    def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        root = self.submod.stage
        if isinstance(root, FSDPModule):
            last = bool(kwargs.get("last_backward", False))
            root.set_requires_gradient_sync(last)
            root.set_reshard_after_backward(last)
            root.set_is_last_backward(last)
        return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)


class DataSharding:
    """What the plan's ``zero_stage`` does to this rank's stages over its data-parallel group.

    ZeRO-0 (or no dp group) changes nothing: the pipeline all-reduces every gradient after
    the step. ZeRO 1-3 shard each local stage's parameters over the dp group with FSDP2, as
    the module docstring maps them.

    Args:
        plan: the plan (its ``zero_stage`` and ``dp``).
        dp_group: the data-parallel group of this rank, or None.
        device: this rank's device (its type names the dp mesh's device type).
        placement: the stages' parameter placement (``BuiltStages.placement``: owner and
            replica stages of every tensor, all ranks').
        parameters: the model's parameter FQNs.

    Attributes:
        timer: where every FSDP unit's all-gathers and reduce-scatters report during a
            traced step (``"all_gather <unit>"``, the unit a layer's path or ``"stage s"``;
            :func:`autopart.runtime._torch_private.time_fsdp_collectives`).

    Raises:
        PlanError: ZeRO 1-3 without a data-parallel group of at least 2 ranks, or with one
            whose size differs from the plan's ``dp``, or a parameter read by two stages of
            one rank (they share the tensor, which FSDP2 cannot shard in two modules).
    """

    def __init__(self, plan: Plan, dp_group: dist.ProcessGroup | None, device: torch.device,
                 placement: Any, parameters: Iterable[str]) -> None:
        self.zero_stage = plan.zero_stage
        self.layer_units = plan.zero_layer_units
        self.mesh: DeviceMesh | None = None
        self.units: dict[int, list[str]] = {}  # stage -> its layers sharded as units
        self._ignored: set[nn.Parameter] | None = None  # left whole (shard's ``ignored``)
        self.timer = CollectiveTimer()
        if self.zero_stage == 0:
            return
        size = dist.get_world_size(dp_group) if dp_group is not None else 1
        if size < 2:
            raise PlanError(f"zero_stage={self.zero_stage} shards over data-parallel replicas, "
                            f"but this pipeline has a data-parallel group of {size} rank(s); "
                            "pass mesh= (a DeviceMesh with dims ('pp', 'dp'), dp >= 2) or use "
                            "a plan with zero_stage=0")
        line = plan.dp * plan.cp  # cp is folded into dp
        if line > 1 and size != line:
            cp = f" x cp={plan.cp}" if plan.cp > 1 else ""
            raise PlanError(f"the plan has dp={plan.dp}{cp} but the data-parallel group has "
                            f"{size} ranks; launch tp x pp x dp{' x cp' if cp else ''} = "
                            f"{plan.num_gpus} ranks with a mesh of dp={line}")
        names = set(parameters)
        for fqn, copies in sorted(placement.replicas.items()):
            ranks = [plan.stages[s].rank for s in [placement.owner[fqn], *copies]]
            if fqn in names and len(set(ranks)) < len(ranks):
                raise PlanError(f"parameter {fqn!r} is read by stages "
                                f"{[placement.owner[fqn], *copies]}, two of them on one rank, "
                                f"which share it; zero_stage={self.zero_stage} (FSDP2) cannot "
                                "shard one tensor in two stage modules. Use zero_stage=0, or a "
                                "plan that puts those stages on different ranks (e.g. not a "
                                "V schedule for a model with tied embeddings)")
        assert dp_group is not None  # size >= 2
        self.mesh = DeviceMesh.from_group(dp_group, device.type)

    @property
    def sharded(self) -> bool:
        """Whether parameters and gradients are DTensor shards over dp (ZeRO 1-3)."""
        return self.mesh is not None

    def new_stage(self, *args: Any, **kwargs: Any) -> TracedStage:
        """This rank's ``PipelineStage`` of one stage (``TracedStage``'s arguments): a
        :class:`ShardedStage` for ZeRO-2/3 with one unit per stage, an
        :class:`AccumulatingStage` for ZeRO-1 with one unit per layer, else a
        ``TracedStage``."""
        if self.sharded and self.zero_stage == 1 and self.layer_units:
            return AccumulatingStage(*args, **kwargs)
        if self.sharded and self.zero_stage >= 2 and not self.layer_units:
            return ShardedStage(*args, reshard_after_forward=self.zero_stage == 3, **kwargs)
        return TracedStage(*args, **kwargs)

    def shard(self, submods: Mapping[int, nn.Module],
              ignored: Collection[nn.Parameter] = ()) -> None:
        """``fully_shard`` each stage's ``PipelineStage`` submodule (no-op for ZeRO-0).

        Args:
            submods: stage index -> the module its ``PipelineStage`` runs.
            ignored: parameters FSDP leaves whole (``fully_shard``'s ``ignored_params``): an
                ep rank's experts, split over ep already and reduced over their own
                replicas after the step (:class:`autopart.runtime.distributed._grads.
                ExpertGrads`).
        """
        if self.mesh is None:
            return
        self._ignored = set(ignored) or None
        # FSDP2 warns once per process when a sharded module returns a view (an in-place op
        # on it would skip its pre-backward hook). The runtime makes none: P2PStage sends
        # its outputs, and copies those that torch's split backward detaches in place.
        warnings.filterwarnings("ignore", category=UserWarning,
                                message=r"FSDP2-wrapped module \(FSDPP2PStage\) returned a view")
        # Layer units and their stage root return views too; the captured graph is
        # functional, and group_layers leaves inline a layer whose output a later op writes
        warnings.filterwarnings("ignore", category=UserWarning,
                                message=r"FSDP2-wrapped module \(FSDP(Layer_\w+|Stage\d+)\) "
                                        r"returned a view")
        for s, submod in submods.items():
            if self.layer_units:
                self.units[s] = self._shard_layers(submod, s)
            else:
                fully_shard(submod, mesh=self.mesh, reshard_after_forward=self.zero_stage == 3,
                            ignored_params=self._ignored)
                self._time(submod, f"stage {s}")

    def _time(self, unit: nn.Module, label: str) -> None:
        """Time ``unit``'s collectives in traced steps, on CPU ranks only (where the traced
        step times them; on CUDA FSDP2's own collectives run untouched)."""
        if self.mesh is not None and self.mesh.device_type == "cpu":
            time_fsdp_collectives(unit, label, self.timer)

    def _shard_layers(self, submod: nn.Module, stage_index: int) -> list[str]:
        """One FSDP unit per layer of the stage, then its graph module as the root (see the
        module docstring); the layers' paths."""
        if not isinstance(submod, P2PStage) or submod.runner is not submod.stage:
            raise PlanError("zero_layer_units=True shards the layers of a stage's own graph "
                            "module; a torch.compile'd stage (fuse=True) is one unit: compile "
                            "with fuse=False, or use a plan with zero_layer_units=False")
        stage = submod.stage
        paths = group_layers(stage)
        units = [stage.get_submodule(p) for p in paths]
        after_forward = self.zero_stage == 3
        for path, unit in zip(paths, units, strict=True):
            fully_shard(unit, mesh=self.mesh, reshard_after_forward=after_forward,
                        ignored_params=self._ignored)
            self._time(unit, path)
        root = fully_shard(stage, mesh=self.mesh, reshard_after_forward=after_forward,
                           ignored_params=self._ignored)
        self._time(root, f"stage {stage_index}")
        if after_forward:
            root.set_reshard_after_forward(True, recurse=False)
        chain = [root, *units]
        for unit, following in itertools.pairwise(chain):
            unit.set_modules_to_forward_prefetch([following])
        for previous, unit in itertools.pairwise(units):
            unit.set_modules_to_backward_prefetch([previous])
        return paths

    @staticmethod
    def refreshed(local: Mapping[str, torch.Tensor], modules: Mapping[int, nn.Module],
                  placement: Any) -> dict[str, torch.Tensor]:
        """``local`` (FQN -> tensor this rank holds) with every parameter replaced by the one
        its stage module holds now (``fully_shard`` swaps in DTensor parameters)."""
        out = dict(local)
        for (s, fqn), t in placement.tensors.items():
            if s in modules and isinstance(t, nn.Parameter) and out.get(fqn) is t:
                out[fqn] = modules[s].get_parameter(fqn)
        return out

    def grad_norm_power(self, local_power: torch.Tensor, inf: bool) -> None:
        """Add up (max for ``inf``) ``local_power``, this rank's ``sum |g| ** p`` (or
        ``max |g|``) over its gradient shards, across the dp group in place: the shards are
        disjoint, so each element counts once. A no-op for ZeRO-0, whose replicas hold equal
        whole gradients, counted once."""
        if self.mesh is None:
            return
        op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
        dist.all_reduce(local_power, op=op, group=self.mesh.get_group())

    @staticmethod
    def scale_grads(params: Iterable[torch.Tensor], max_norm: float,
                    total: torch.Tensor) -> None:
        """Every gradient times ``min(1, max_norm / (total + 1e-6))`` (torch's
        ``clip_grads_with_norm_`` on the local shards of DTensor gradients)."""
        params = list(params)
        if not any(isinstance(p.grad, DTensor) for p in params):
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
            return
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        with torch.no_grad():
            for p in params:
                if p.grad is not None:
                    g = local_tensor(p.grad)
                    g.mul_(coef.to(g.device, g.dtype))

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        """The dp group when sharded (overflow flags and norms are reduced over it)."""
        return self.mesh.get_group() if self.mesh is not None else None
