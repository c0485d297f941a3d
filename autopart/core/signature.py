"""InputSignature: what a pipeline accepts, and how a batch becomes microbatches (both runtimes)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from autopart.core.capture import CapturedGraph
from autopart.core.errors import PlanError
from autopart.core.microbatch import merge_leaves, split_leaves, split_tree
from autopart.core.plan import Plan

__all__ = ["InputSignature", "batch_size", "replica_share", "microbatch_inputs", "require_loss",
           "call_loss"]


def batch_size(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """Dim 0 of the first tensor input with at least one dimension.

    Raises:
        PlanError: no input is a tensor with a batch dimension.
    """
    for leaf in pytree.tree_leaves((args, kwargs)):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    raise PlanError("no tensor input with a batch dimension; pass at least one tensor whose "
                    "dim 0 is the batch")


def replica_share(plan: Plan, dp_rank: int, args: tuple[Any, ...], kwargs: dict[str, Any],
                  target: Any = None) -> tuple[tuple[Any, ...], dict[str, Any], Any]:
    """This replica's rows of a global batch.

    With a plan made for dp > 1 replicas and inputs whose batch (dim 0 of the first batched
    input) is the plan's global ``batch_size`` B, replica ``dp_rank`` keeps rows
    ``[dp_rank * B / dp, (dp_rank + 1) * B / dp)`` of every input and target tensor of
    leading size B. Anything else (the replica's own share already, a pp-only plan) is
    returned as it is.

    Args:
        plan: the plan.
        dp_rank: this rank's replica index, 0 .. plan.dp - 1.
        args, kwargs: the inputs.
        target: the target, or None.

    Returns:
        ``(args, kwargs, target)`` of this replica.
    """
    if plan.dp == 1 or batch_size(args, kwargs) != plan.batch_size:
        return args, kwargs, target
    per = plan.batch_size // plan.dp
    rows = slice(dp_rank * per, (dp_rank + 1) * per)

    def cut(t: torch.Tensor) -> torch.Tensor:
        return t[rows] if t.dim() > 0 and t.shape[0] == plan.batch_size else t

    out = pytree.tree_map_only(torch.Tensor, cut, (args, kwargs, target))
    return tuple(out[0]), dict(out[1]), out[2]


def microbatch_inputs(args: tuple[Any, ...], kwargs: dict[str, Any], num_microbatches: int,
                      ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The first of ``num_microbatches`` microbatches of ``(args, kwargs)``: what the model is
    captured with, since stages run at the microbatch size.

    Raises:
        PlanError: a tensor's dim 0 is not divisible by ``num_microbatches``.
    """
    leaves, spec = pytree.tree_flatten((args, kwargs))
    first = split_leaves(leaves, num_microbatches)[0]
    mb_args, mb_kwargs = pytree.tree_unflatten(first, spec)
    return tuple(mb_args), dict(mb_kwargs)


def require_loss(loss_fn: Callable[..., Any] | None) -> Callable[..., Any]:
    """``loss_fn``, or the error ``train_step`` raises on a pipeline compiled without one.

    Raises:
        PlanError: ``loss_fn`` is None.
    """
    if loss_fn is None:
        raise PlanError("train_step needs a loss: pass loss_fn=... to autopart.compile "
                        "(a callable (output, target) -> scalar)")
    return loss_fn


def call_loss(loss_fn: Callable[[Any, Any], Any], output: Any, target: Any) -> torch.Tensor:
    """``loss_fn(output, target)`` for one microbatch, checked: both runtimes call it so.

    Raises:
        PlanError: the loss function failed while ``target`` is None (``train_step`` was
            called without ``target=``), or it returned something other than a one-element
            floating-point tensor (the message gives what it returned).
    """
    try:
        loss = loss_fn(output, target)
    except Exception as exc:
        if target is None:
            raise PlanError(f"loss_fn failed with target=None ({type(exc).__name__}: {exc}); "
                            "pass the target to train_step(..., target=y)") from exc
        raise
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
        what = (f"a tensor of shape {tuple(loss.shape)} and dtype {loss.dtype}"
                if isinstance(loss, torch.Tensor) else f"{type(loss).__name__} {loss!r:.60}")
        raise PlanError(f"loss_fn returned {what}; it must return a scalar floating-point tensor "
                        "(reduce it, e.g. loss.mean())")
    # returned as it is: torch's split backward (I/W) walks the loss's own autograd graph,
    # and an extra view node in front of it breaks that walk
    return loss


@dataclass(frozen=True)
class InputSignature:
    """The inputs and outputs a pipeline was compiled for.

    Attributes:
        in_spec: pytree structure of ``(args, kwargs)``.
        out_spec: pytree structure of the model's output.
        input_shapes: per flat input leaf, its captured shape ``(microbatch_size, ...)``, or
            ``None`` for leaves that are not batched tensors.
        microbatch_size: rows per microbatch; any batch that is a multiple of it runs.
        output_meta: per flat output, ``(shape, dtype)`` of one microbatch's value (what a
            rank that does not hold the last stage allocates to receive it); ``None`` for an
            output that is not a tensor.
    """

    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec
    input_shapes: tuple[tuple[int, ...] | None, ...]
    microbatch_size: int
    output_meta: tuple[tuple[tuple[int, ...], torch.dtype] | None, ...] = ()

    @classmethod
    def of(cls, captured: CapturedGraph) -> InputSignature:
        """The signature of a model captured at the microbatch size."""
        examples = [n.meta.get("val") for n in captured.graph_module.graph.nodes
                    if n.op == "placeholder"]  # one per flattened input, in call order
        shapes = tuple(tuple(t.shape) if isinstance(t, torch.Tensor) and t.dim() > 0 else None
                       for t in examples)
        output = next(n for n in captured.graph_module.graph.nodes if n.op == "output")
        vals = [node.meta.get("val") if isinstance(node, torch.fx.Node) else node
                for node in output.args[0]]
        outs = tuple((tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else None
                     for v in vals)
        return cls(captured.in_spec, captured.out_spec, shapes, captured.batch_size, outs)

    def flatten(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        """The flat input leaves, in the order stage 0 takes them.

        Raises:
            PlanError: the inputs' structure differs from the compiled one.
        """
        leaves, spec = pytree.tree_flatten((args, kwargs))
        if spec != self.in_spec:
            raise PlanError(f"inputs have structure {spec}, but the pipeline was compiled for "
                            f"{self.in_spec}; pass the same positional and keyword inputs")
        return leaves

    def num_microbatches(self, leaves: list[Any]) -> int:
        """How many microbatches the flat inputs ``leaves`` make.

        Raises:
            PlanError: a batched input's trailing shape differs from the compiled one, its
                batch is not a multiple of the microbatch size, or no input is batched.
        """
        batch = None
        for i, (leaf, shape) in enumerate(zip(leaves, self.input_shapes, strict=True)):
            if shape is None or not isinstance(leaf, torch.Tensor):
                continue
            if tuple(leaf.shape[1:]) != shape[1:]:
                raise PlanError(f"input leaf {i} has shape {tuple(leaf.shape)}; the pipeline was "
                                f"compiled for (k*{self.microbatch_size}, "
                                f"{', '.join(map(str, shape[1:]))}); recompile for new shapes")
            if leaf.shape[0] % self.microbatch_size:
                raise PlanError(f"batch of {leaf.shape[0]} is not a multiple of the microbatch "
                                f"size {self.microbatch_size} this pipeline was compiled for; "
                                "pass such a batch or recompile")
            batch = int(leaf.shape[0])
        if batch is None:
            raise PlanError("no tensor input with a batch dimension; pass the inputs the "
                            "pipeline was compiled with")
        return batch // self.microbatch_size

    def split(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[list[Any]]:
        """Per microbatch, the flat inputs of stage 0 (tensors ``(microbatch_size, ...)``)."""
        leaves = self.flatten(args, kwargs)
        return split_leaves(leaves, self.num_microbatches(leaves))

    @staticmethod
    def split_target(target: Any, num_microbatches: int) -> list[Any]:
        """Per microbatch, its slice of ``target`` (any pytree; ``None`` stays ``None``)."""
        if target is None:
            return [None] * num_microbatches
        return split_tree(target, num_microbatches)

    def output(self, flat: list[Any] | tuple[Any, ...]) -> Any:
        """The model's output structure from the last stage's flat outputs."""
        return pytree.tree_unflatten(list(flat), self.out_spec)

    def merge(self, per_mb: list[list[Any]]) -> Any:
        """Join per-microbatch flat outputs into the full-batch output
        (:func:`autopart.core.microbatch.merge_leaves`)."""
        return self.output(merge_leaves(per_mb))
