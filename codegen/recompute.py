"""Recomputation that leaves a stage's buffers as the forward left them."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["written_by", "written_buffers", "recompute_context", "run_recomputed"]


def written_by(node: fx.Node) -> list[fx.Node]:
    """The nodes whose values ``node`` writes in place: the arguments its op's schema marks
    mutable (``copy_``'s ``self``, BatchNorm's running statistics); ``[]`` for a node that is
    no ``call_function`` of a schema'd op."""
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None:
        return []
    out = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        src = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
        if isinstance(src, fx.Node):
            out.append(src)
    return out


def written_buffers(stage: nn.Module) -> list[torch.Tensor]:
    """The ``get_attr`` tensors that the stage's ops write in place (their schema says so).

    ``stage`` is a stage's ``fx.GraphModule`` or ``torch.compile`` of one; any other module
    has none found.

    After capture these are the buffers a model updates while it runs: BatchNorm's running
    statistics (``_native_batch_norm_legit``) and ``num_batches_tracked`` (``add_``), or a
    ``copy_`` into any other buffer (see ``autopart.core.capture``).
    """
    stage = getattr(stage, "_orig_mod", stage)
    if not isinstance(stage, fx.GraphModule):
        return []
    found: dict[int, torch.Tensor] = {}
    for node in stage.graph.nodes:
        for src in written_by(node):
            if src.op == "get_attr":
                value: Any = stage
                for part in str(src.target).split("."):
                    value = getattr(value, part)
                if isinstance(value, torch.Tensor):
                    found[id(value)] = value
    return list(found.values())


def recompute_context(stage: nn.Module,
                      ) -> Callable[[], tuple[contextlib.AbstractContextManager[Any],
                                              contextlib.AbstractContextManager[Any]]]:
    """``context_fn`` for ``torch.utils.checkpoint`` (non-reentrant) around ``stage``.

    A recomputed stage runs its forward twice. Left alone, the second run would update
    BatchNorm's running statistics (and any other buffer the stage writes) a second time,
    and would read the buffers as later microbatches left them. Each call of the returned
    function (checkpoint makes one per forward) gives a forward context that copies the
    written buffers as this microbatch's forward finds them, and a recomputation context
    that sets the buffers to that copy, runs, and puts back the values they had. So the
    recomputed forward sees what the first one saw (its outputs and saved tensors are the
    same), and the buffers end as they would without recompute. A stage that writes no
    buffer gets two no-op contexts. Memory: one copy of the written buffers per
    microbatch in flight.
    """
    buffers = written_buffers(stage)

    def context_fn() -> tuple[contextlib.AbstractContextManager[Any],
                              contextlib.AbstractContextManager[Any]]:
        if not buffers:
            return contextlib.nullcontext(), contextlib.nullcontext()
        seen: list[torch.Tensor] = []

        @contextlib.contextmanager
        def forward() -> Iterator[None]:
            seen[:] = [b.detach().clone() for b in buffers]
            yield

        @contextlib.contextmanager
        def recompute() -> Iterator[None]:
            now = [b.detach().clone() for b in buffers]
            with torch.no_grad():
                for b, v in zip(buffers, seen, strict=True):
                    b.copy_(v)
            try:
                yield
            finally:
                with torch.no_grad():
                    for b, v in zip(buffers, now, strict=True):
                        b.copy_(v)

        return forward(), recompute()

    return context_fn


def run_recomputed(stage: nn.Module, *args: Any, runner: Callable[..., Any] | None = None) -> Any:
    """``runner(*args)`` (default ``stage(*args)``) under non-reentrant
    ``torch.utils.checkpoint`` with :func:`recompute_context` of ``stage``: only the inputs are
    kept for backward, which runs the forward again. Both runtimes run a stage the plan marks
    ``recompute`` this way when gradients are on.

    Args:
        stage: the stage's module (its written buffers are found on it).
        *args: the stage's inputs.
        runner: what computes the stage: ``stage`` itself or ``torch.compile`` of it.
    """
    return checkpoint(stage if runner is None else runner, *args, use_reentrant=False,
                      context_fn=recompute_context(stage))
