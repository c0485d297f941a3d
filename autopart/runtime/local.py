"""PipelinedModule: the partitioned model users call, train and checkpoint under original FQNs."""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from autopart.codegen.params import Placement
from autopart.core.errors import PlanError
from autopart.core.jsonio import write_text_atomic
from autopart.core.plan import Plan
from autopart.core.schedule import build_schedule, forward_schedule
from autopart.runtime.executor import LocalExecutor
from autopart.runtime.microbatch import merge_leaves, split_leaves, split_tree

__all__ = ["PipelinedModule"]


class PipelinedModule(nn.Module):
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

    def __init__(self, *, plan: Plan, stages: list[fx.GraphModule], runners: list[nn.Module],
                 devices: list[torch.device],
                 placement: Placement, in_spec: pytree.TreeSpec, out_spec: pytree.TreeSpec,
                 input_shapes: list[tuple[int, ...] | None], microbatch_size: int,
                 state_keys: list[tuple[str, str]], param_order: list[str],
                 buffer_order: list[str], unused: dict[str, torch.Tensor],
                 loss_fn: Callable[[Any, Any], torch.Tensor] | None,
                 timings_s: dict[str, float]) -> None:
        super().__init__()
        self.plan = plan
        self.stages = nn.ModuleList(stages)
        self.devices = devices
        self.timings_s = timings_s
        self._placement = placement
        self._in_spec = in_spec
        self._out_spec = out_spec
        self._input_shapes = input_shapes
        self._microbatch_size = microbatch_size
        self._state_keys = state_keys
        self._param_order = param_order
        self._buffer_order = buffer_order
        self._unused = unused
        self._loss_fn = loss_fn
        self._num_ranks = len(plan.ranks)
        recompute = [st.stage_index for st in plan.stages if st.recompute]
        self._executor = LocalExecutor(runners, devices, recompute=recompute)
        self._replica_versions: dict[str, int] = {}

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
        with torch.no_grad():
            for key, fqn in self._state_keys:
                if key not in state_dict:
                    continue
                value = state_dict[key]
                target = self._tensor(fqn)
                if tuple(value.shape) != tuple(target.shape):
                    raise PlanError(f"state_dict[{key!r}] has shape {tuple(value.shape)}, the "
                                    f"model's is {tuple(target.shape)}")
                target.copy_(value)
        self._sync_replicas(force=True)
        return nn.modules.module._IncompatibleKeys(missing, unexpected)

    def state_layout(self) -> list[tuple[str, str]]:
        """(state_dict key, canonical FQN) pairs: tied names map to the FQN that owns them."""
        return list(self._state_keys)

    def owned_tensors(self) -> dict[int, dict[str, torch.Tensor]]:
        """Per stage, the parameters and buffers it owns (replicas excluded), by FQN; tensors
        the graph never reads are listed with stage 0."""
        owned: dict[int, dict[str, torch.Tensor]] = {s: {} for s in range(len(self.stages))}
        for fqn in self._param_order + self._buffer_order:
            stage = self._placement.owner.get(fqn, 0)
            owned[stage][fqn] = self._tensor(fqn)
        return owned

    def save(self, directory: str | os.PathLike[str]) -> Path:
        """Checkpoint weights and plan atomically; see :func:`autopart.runtime.checkpoint.save_checkpoint`."""
        from autopart.runtime.checkpoint import save_checkpoint

        return save_checkpoint(self, directory)

    # ---- tied-parameter replicas -----------------------------------------------------
    def _sync_replicas(self, force: bool = False) -> None:
        """Refresh replicas from their owner when the owner changed since the last sync."""
        with torch.no_grad():
            for fqn, stages in self._placement.replicas.items():
                owner = self._tensor(fqn)
                if not force and self._replica_versions.get(fqn) == owner._version:
                    continue
                for s in stages:
                    replica = self._placement.tensors[(s, fqn)]
                    if replica is not owner:
                        replica.copy_(owner)
                self._replica_versions[fqn] = owner._version

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
    def _microbatches(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[list[Any]]:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        if spec != self._in_spec:
            raise PlanError(f"inputs have structure {spec}, but the pipeline was compiled for "
                            f"{self._in_spec}; pass the same positional and keyword inputs")
        batch = None
        for i, (leaf, shape) in enumerate(zip(leaves, self._input_shapes, strict=True)):
            if shape is None or not isinstance(leaf, torch.Tensor):
                continue
            if tuple(leaf.shape[1:]) != shape[1:]:
                raise PlanError(f"input leaf {i} has shape {tuple(leaf.shape)}; the pipeline was "
                                f"compiled for (k*{self._microbatch_size}, "
                                f"{', '.join(map(str, shape[1:]))}); recompile for new shapes")
            if leaf.shape[0] % self._microbatch_size:
                raise PlanError(f"batch of {leaf.shape[0]} is not a multiple of the microbatch "
                                f"size {self._microbatch_size} this pipeline was compiled for; "
                                "pass such a batch or recompile")
            batch = int(leaf.shape[0])
        if batch is None:
            raise PlanError("no tensor input with a batch dimension")
        return split_leaves(leaves, batch // self._microbatch_size)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Pipelined inference: microbatches flow forward only, nothing is kept for backward.

        Returns the same structure as ``model(*args, **kwargs)``; see
        :func:`autopart.runtime.microbatch.merge_leaves` for how microbatch outputs are joined.
        """
        self._sync_replicas()
        mbs = self._microbatches(args, kwargs)
        with torch.no_grad():
            schedule = forward_schedule(self._num_ranks, len(mbs), self.plan.stages_per_rank)
            result = self._executor.run(schedule, mbs)
        return pytree.tree_unflatten(merge_leaves([list(o) for o in result.outputs]), self._out_spec)

    def train_step(self, *args: Any, target: Any = None, **kwargs: Any) -> torch.Tensor:
        """Forward and backward of every microbatch; gradients accumulate in ``.grad``.

        With ``loss_fn`` a mean over the batch, the accumulated gradients equal those of
        ``loss_fn(model(*args, **kwargs), target).backward()`` (each microbatch's loss is
        scaled by 1/m). Call ``opt.zero_grad()`` and ``opt.step()`` around it as usual.

        Args:
            *args, **kwargs: model inputs; tensors ``(batch, ...)``, split along dim 0.
            target: passed to ``loss_fn``, split along dim 0 like the inputs.

        Returns:
            The full-batch loss (mean of the microbatch losses), a detached 0-dim tensor.

        Raises:
            PlanError: compiled without ``loss_fn``, or inputs that do not fit the pipeline.
        """
        if self._loss_fn is None:
            raise PlanError("train_step needs a loss: pass loss_fn=... to autopart.compile "
                            "(a callable (output, target) -> scalar)")
        self._sync_replicas()
        mbs = self._microbatches(args, kwargs)
        m = len(mbs)
        targets = split_tree(target, m) if target is not None else [None] * m
        loss_fn, out_spec = self._loss_fn, self._out_spec

        def loss_closure(i: int, flat_out: tuple[Any, ...]) -> torch.Tensor:
            out = pytree.tree_unflatten(list(flat_out), out_spec)
            return loss_fn(out, targets[i]) / m

        schedule = build_schedule(self.plan.schedule_kind, self._num_ranks, m,
                                  self.plan.stages_per_rank)
        result = self._executor.run(schedule, mbs, loss_closure=loss_closure)
        self._reduce_replica_grads()
        return torch.stack([loss for loss in result.losses if loss is not None]).sum()

    # ---- files ---------------------------------------------------------------------
    def stage_sources(self) -> list[str]:
        """Readable Python source of each stage, with tensor shapes as comments."""
        return [stage.print_readable(print_output=False) for stage in self.stages]

    def save_plan(self, path: str | os.PathLike[str]) -> list[Path]:
        """Write the plan to ``path`` and each stage's source as ``stage_<s>.py`` beside it.

        Every file is written atomically. Returns the paths written.
        """
        target = Path(path)
        self.plan.save(target)
        written = [target]
        for s, source in enumerate(self.stage_sources()):
            out = target.parent / f"stage_{s}.py"
            header = (f'"""Stage {s} of {len(self.stages)} ({self.devices[s]}), generated by autopart '
                      f'from graph {self.plan.graph_fingerprint}."""\n')
            write_text_atomic(out, header + source)
            written.append(out)
        return written
