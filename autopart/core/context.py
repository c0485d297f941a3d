"""Context parallelism's token layout: which tokens of each sequence a cp rank holds.

With cp > 1 a sequence of S tokens is cut into 2 cp chunks of S / (2 cp) and cp rank r holds
chunks r and 2 cp - 1 - r, in that order (the load balancing of Megatron-LM's context
parallelism and torchtitan's: under causal attention the early chunk attends to few keys,
the late one to many, so every rank does the same work). Attention all-gathers the keys and
values over the cp group (:mod:`autopart.codegen.context_parallel`); every other op is
token-wise and runs on the rank's tokens alone.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.utils._pytree as pytree

from autopart.core.errors import PlanError

__all__ = ["context_chunks", "context_inputs", "context_positions", "context_share",
           "sequence_length"]


def context_chunks(cp: int, cp_rank: int) -> tuple[int, int]:
    """The two chunks (of 2 cp, in sequence order) cp rank ``cp_rank`` holds, in the order it
    holds them: ``(cp_rank, 2 cp - 1 - cp_rank)``."""
    return cp_rank, 2 * cp - 1 - cp_rank


def context_positions(seq_len: int, cp: int, cp_rank: int,
                      device: torch.device | str | None = None) -> torch.Tensor:
    """Positions (int64, ``[seq_len / cp]``) of the tokens cp rank ``cp_rank`` holds.

    Raises:
        PlanError: ``seq_len`` is not a multiple of ``2 cp``.
    """
    if seq_len % (2 * cp):
        raise PlanError(f"context parallelism with cp={cp} cuts each sequence into {2 * cp} "
                        f"equal chunks, but the sequence has {seq_len} tokens; pad it to a "
                        f"multiple of {2 * cp} or re-plan with another cp")
    chunk = seq_len // (2 * cp)
    return torch.cat([torch.arange(g * chunk, (g + 1) * chunk, device=device)
                      for g in context_chunks(cp, cp_rank)])


def sequence_length(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """S: dimension 1 of the first tensor input (``[batch, seq, ...]``, as transformers' models
    take ``input_ids``).

    Raises:
        PlanError: no tensor input of two or more dimensions.
    """
    for leaf in pytree.tree_leaves((args, kwargs)):
        if isinstance(leaf, torch.Tensor):
            if leaf.dim() < 2:
                break
            return int(leaf.shape[1])
    raise PlanError("context parallelism splits the sequence, dimension 1 of the inputs "
                    "([batch, seq, ...]), but the first tensor input has fewer than two "
                    "dimensions; pass inputs shaped [batch, seq, ...] or re-plan with cp=1")


def context_share(cp: int, cp_rank: int, args: tuple[Any, ...], kwargs: dict[str, Any],
                  target: Any = None) -> tuple[tuple[Any, ...], dict[str, Any], Any]:
    """cp rank ``cp_rank``'s tokens of whole sequences, and their positions.

    Every input and target tensor of two or more dimensions whose dimension 1 is the
    sequence length S (:func:`sequence_length`) keeps the rank's tokens
    (:func:`context_positions`) along it; ``position_ids`` (``[batch, S / cp]``, the tokens'
    places in the whole sequence) is added to ``kwargs``, so rotary tables and position
    embeddings see global positions. With cp = 1 everything is returned as it is.

    Raises:
        PlanError: ``position_ids`` passed by the caller (packed sequences are not split
            yet: pass none, autopart passes each rank's), or S not a multiple of 2 cp.
    """
    if cp == 1:
        return args, kwargs, target
    if "position_ids" in kwargs:
        raise PlanError("position_ids passed with cp > 1: autopart passes each context-parallel "
                        "rank the positions of its own tokens, and packed sequences are not "
                        "split yet; drop position_ids (positions 0..S-1), or re-plan with cp=1")
    seq = sequence_length(args, kwargs)
    batch = next(t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
    positions = context_positions(seq, cp, cp_rank, batch.device)

    def cut(t: torch.Tensor) -> torch.Tensor:
        return t.index_select(1, positions.to(t.device)) if t.dim() >= 2 and t.shape[1] == seq \
            else t

    out = pytree.tree_map_only(torch.Tensor, cut, (args, kwargs, target))
    shared = dict(out[1])
    shared["position_ids"] = positions.unsqueeze(0).expand(batch.shape[0], -1)
    return tuple(out[0]), shared, out[2]


def context_inputs(model: Any, cp: int, args: tuple[Any, ...], kwargs: dict[str, Any],
                   target: Any = None) -> tuple[tuple[Any, ...], dict[str, Any], Any]:
    """The example inputs a cp > 1 plan captures ``model`` at: cp rank 0's tokens and positions
    (:func:`context_share`; every cp rank's graph is the same, only the positions' values
    differ), and its share of ``target``. With cp = 1 the inputs as given.

    Raises:
        PlanError: ``model.forward`` takes no ``position_ids`` (the positions of a rank's
            tokens could not reach it), or as :func:`context_share`.
    """
    if cp == 1:
        return args, kwargs, target
    params = inspect.signature(model.forward).parameters
    if "position_ids" not in params and not any(
            p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        raise PlanError(f"{type(model).__name__}.forward takes no position_ids: context "
                        "parallelism passes each rank the positions of its tokens in the whole "
                        "sequence; give the model a position_ids argument (transformers' models "
                        "have one), or re-plan with cp=1")
    return context_share(cp, 0, args, kwargs, target)
