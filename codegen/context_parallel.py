"""Context parallelism in a stage: attention over the whole sequence from a cp rank's tokens.

A stage built for cp > 1 runs on the rank's tokens only (two chunks of the sequence,
:mod:`autopart.core.context`): every op but attention is token-wise, so the graph captured
at S / cp tokens computes the rank's share as it is. :func:`context_parallel` replaces each
attention (``aten.scaled_dot_product_attention``) with :class:`ContextParallelAttention`:

- the keys and values are all-gathered over the cp group (``autopart::tp_seq_gather_split``,
  :mod:`autopart.codegen._tp_ops`: its backward reduce-scatters their gradients, so each rank
  gets the sum of every rank's queries' gradients for its tokens' keys and values);
- causal attention: each of the rank's two query chunks attends to the keys of its own and
  earlier chunks only, with the diagonal block masked (two ``scaled_dot_product_attention``
  calls over (g + 1) / (2 cp) of the keys for chunk g). With the load-balanced chunks every
  rank computes 2 cp + 1 chunk-by-chunk blocks;
- attention over the whole sequence (a mask of all ones, or none; BERT): one call over all
  the gathered keys;
- grouped-query attention's keys and values are taken before transformers' ``repeat_kv``
  (:data:`autopart.core.op_names.REPEAT_KV_OPS`) and repeated after the exchange, so a
  rank moves its key heads, not their copies.

This is the all-gather form of context parallelism (``Plan.cp_attention="all_gather"``;
Llama 3's, "The Llama 3 Herd of Models", 2024, section 3.3.2; torchtitan's
``cp_rotate_method="allgather"``), not a ring: the whole keys and values of the layer are
held during its attention, and the exchange is not overlapped with the attention's compute.

With ``Plan.cp_attention="ulysses"`` each attention becomes :class:`UlyssesAttention`
(DeepSpeed-Ulysses, Jacobs et al., 2023, "System Optimizations for Enabling Training of
Extreme Long Sequence Transformer Models"): the queries, keys and values are exchanged by one
all-to-all each (``autopart::all_to_all``, whose backward is the reverse all-to-all),
so that each rank holds heads / cp of the heads for the whole sequence; the model's own
attention runs on them (``is_causal`` over the whole sequence in order, or unmasked), and one
more all-to-all brings each rank its tokens' outputs for every head. The heads a rank holds
(after tp) and the key / value heads must divide by cp.

What the pass reads is the model's own mask, on the whole captured graph
(:func:`autopart.codegen.attention_graph.attention_kinds`, which refuses what it cannot run).
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch import nn

from autopart.codegen import _tp_ops
from autopart.codegen.attention_graph import SDPA, AttentionCall, repeated_heads, sdpa_args
from autopart.codegen.tp_layout import TensorParallelRank
from autopart.core.capturedgraph import erase_unread, node_module_path
from autopart.core.context import context_chunks
from autopart.core.errors import PlanError

__all__ = ["ContextParallelAttention", "UlyssesAttention", "context_parallel", "sequence_order",
           "stand_in_attention"]



class _ContextAttention(nn.Module):
    """What both forms of cp attention hold: the model's attention arguments and this rank's
    place in its cp group (see :class:`ContextParallelAttention`)."""

    def __init__(self, causal: bool, cp: TensorParallelRank, dropout_p: float,
                 scale: float | None, enable_gqa: bool, kv_repeat: int = 1) -> None:
        super().__init__()
        self.causal, self.dropout_p, self.scale, self.enable_gqa = (causal, dropout_p, scale,
                                                                     enable_gqa)
        self.cp_rank, self.cp_size, self.group_name = cp.rank, cp.size, cp.group_name
        self.kv_repeat = kv_repeat


class ContextParallelAttention(_ContextAttention):
    """Attention of a cp rank's queries over the whole sequence's keys and values.

    Args:
        causal: causal attention (True) or over every key (False).
        cp: this rank's place in its cp group.
        dropout_p, scale, enable_gqa: the model's ``scaled_dot_product_attention`` arguments.
        kv_repeat: the model repeats each key / value head this many times before its
            attention (transformers' ``repeat_kv``, :data:`autopart.core.op_names.
            REPEAT_KV_OPS`); the keys and values given are then the unrepeated heads, gathered
            as they are and repeated after (1: given as the attention takes them).

    Forward: ``query [B, H, L, D]``, ``key`` / ``value [B, Hk, L, D]`` of the rank's
    ``L = S / cp`` tokens (its two chunks) -> ``[B, H, L, D]``.
    """

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                ) -> torch.Tensor:
        keys, values = self._gather(key), self._gather(value)
        local = key.shape[2]
        if self.causal:
            order = sequence_order(self.cp_size, local, key.device)
            keys, values = keys.index_select(2, order), values.index_select(2, order)
        if self.kv_repeat > 1:
            keys = keys.repeat_interleave(self.kv_repeat, dim=1)
            values = values.repeat_interleave(self.kv_repeat, dim=1)
        if not self.causal:
            return self._attend(query, keys, values, None)
        chunk = local // 2
        outs = []
        for i, g in enumerate(context_chunks(self.cp_size, self.cp_rank)):
            seen = (g + 1) * chunk  # keys of chunks 0..g
            mask = torch.ones(chunk, seen, dtype=torch.bool, device=query.device).tril(g * chunk)
            outs.append(self._attend(query[:, :, i * chunk:(i + 1) * chunk],
                                     keys[:, :, :seen], values[:, :, :seen], mask))
        return torch.cat(outs, dim=2)

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        """``t [B, Hk, L, D]`` of every cp rank, concatenated along the sequence in rank order
        (``[B, Hk, cp L, D]``); its gradient is reduce-scattered back."""
        return _tp_ops.tp_seq_gather_split(t, 2, 1, self.cp_size, self.group_name)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout_p if self.training else 0.0,
            scale=self.scale, enable_gqa=self.enable_gqa)


def sequence_order(cp: int, local: int, device: torch.device | str | None = None
                   ) -> torch.Tensor:
    """Indices (int64, ``[cp x local]``) that put the tokens of a cp group, gathered rank by
    rank (``local`` each: its two chunks, :func:`autopart.core.context.context_chunks`), in
    sequence order: ``gathered.index_select(dim, order)``."""
    chunk = local // 2
    starts = []
    for g in range(2 * cp):
        owner = g if g < cp else 2 * cp - 1 - g
        starts.append(owner * local + (0 if g < cp else chunk))
    return torch.cat([torch.arange(s, s + chunk, device=device) for s in starts])


class UlyssesAttention(_ContextAttention):
    """Attention over the whole sequence with heads / cp of the heads per cp rank
    (DeepSpeed-Ulysses): all-to-alls swap the rank's tokens of every head for every token
    of its heads, and back.

    Args:
        causal: causal attention (True) or over every key (False).
        cp: this rank's place in its cp group.
        dropout_p, scale, enable_gqa: the model's ``scaled_dot_product_attention`` arguments.
        kv_repeat: as :class:`ContextParallelAttention`'s: the unrepeated key / value heads
            are exchanged where cp divides them (and repeated after), else repeated first.

    Forward: ``query [B, H, L, D]``, ``key`` / ``value [B, Hk, L, D]`` of the rank's
    ``L = S / cp`` tokens (its two chunks) -> ``[B, H, L, D]``.

    Raises:
        PlanError: H or Hk is not a multiple of cp (plan with ``cp_attention="all_gather"``).
    """

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                ) -> torch.Tensor:
        cp, repeat = self.cp_size, self.kv_repeat
        if repeat > 1 and key.shape[1] % cp:  # too few key heads to split: repeat them first
            key, value = (t.repeat_interleave(repeat, dim=1) for t in (key, value))
            repeat = 1
        if query.shape[1] % cp or key.shape[1] % cp:
            raise PlanError(f"Ulysses attention splits the heads over cp={cp} ranks, but this "
                            f"attention has {query.shape[1]} query and {key.shape[1]} key heads "
                            "on each rank; re-plan with cp_attention='all_gather' or a cp "
                            "that divides them")
        order = sequence_order(cp, query.shape[2], query.device)
        q, k, v = (self._to_heads(t, order) for t in (query, key, value))
        if repeat > 1:
            k, v = (t.repeat_interleave(repeat, dim=1) for t in (k, v))
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout_p if self.training else 0.0,
            is_causal=self.causal, scale=self.scale, enable_gqa=self.enable_gqa)
        return self._to_tokens(out, torch.argsort(order))  # back to rank by rank

    def _to_heads(self, t: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        """``[B, H, L, D]`` (this rank's tokens, every head) -> ``[B, H / cp, S, D]`` (every
        token of this rank's heads, in sequence order)."""
        cp, (b, h, local, d) = self.cp_size, t.shape
        parts = t.reshape(b, cp, h // cp, local, d).transpose(0, 1).contiguous()
        got = self._exchange(parts)  # [source rank, ...]
        return got.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * local, d).index_select(
            2, order)

    def _to_tokens(self, out: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        """``[B, H / cp, S, D]`` in sequence order -> ``[B, H, L, D]`` of this rank's
        tokens."""
        cp, (b, h, seq, d) = self.cp_size, out.shape
        by_rank = out.index_select(2, inverse)  # rank by rank, each its two chunks
        parts = by_rank.reshape(b, h, cp, seq // cp, d).permute(2, 0, 1, 3, 4).contiguous()
        got = self._exchange(parts)  # [source's heads, ...]
        return got.transpose(0, 1).reshape(b, cp * h, seq // cp, d)

    def _exchange(self, parts: torch.Tensor) -> torch.Tensor:
        """``parts [cp, ...]``: part ``i`` sent to cp rank ``i``; returns what each rank sent
        this one, in rank order (an all-to-all; its backward is the reverse one)."""
        return _tp_ops.all_to_all(parts, self.group_name)


class _LocalContextAttention(ContextParallelAttention):
    """:class:`ContextParallelAttention` whose all-gather is stood in for by this rank's keys
    repeated cp times (one copy, as the gather's reorder makes one)."""

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t] * self.cp_size, dim=2)


class _LocalUlyssesAttention(UlyssesAttention):
    """:class:`UlyssesAttention` whose all-to-alls are stood in for by a copy."""

    def _exchange(self, parts: torch.Tensor) -> torch.Tensor:
        return parts.clone()


def stand_in_attention(call: AttentionCall, cp: int, rank: int,
                       attention: str = "all_gather") -> nn.Module:
    """The module :func:`context_parallel` puts in place of ``call`` on cp rank ``rank`` of
    ``cp``, with its exchanges stood in for by local copies of this rank's tensors: it runs
    the same kernels on the same shapes with no process group (the profiler times it,
    :mod:`autopart.profiler.context_attention`). Forward as :class:`ContextParallelAttention`:
    ``query`` of ``call.query``'s shape, ``key`` / ``value`` of ``call.moved_key``'s.

    Raises:
        ValueError: another ``attention``, or ``rank`` outside ``0 .. cp - 1``.
    """
    kinds = {"all_gather": _LocalContextAttention, "ulysses": _LocalUlyssesAttention}
    if attention not in kinds or not 0 <= rank < cp:
        raise ValueError(f"attention={attention!r}, rank={rank} of cp={cp}: expected "
                         "'all_gather' or 'ulysses' and 0 <= rank < cp")
    place = TensorParallelRank(rank, cp, "")
    return kinds[attention](call.causal, place, call.dropout_p, call.scale, call.enable_gqa,
                            call.kv_repeat)


def context_parallel(gm: fx.GraphModule, kinds: dict[str, bool], cp: TensorParallelRank,
                     attention: str = "all_gather") -> int:
    """Rewrite ``gm`` (one stage) in place: each attention node named in ``kinds``
    (:func:`attention_kinds` of the whole graph) becomes a :class:`ContextParallelAttention`
    (``attention="all_gather"``) or :class:`UlyssesAttention` (``"ulysses"``) submodule
    under the attention's module path (so per-layer FSDP units take it along).

    Returns:
        The number of attention nodes rewritten.
    """
    kind = {"all_gather": ContextParallelAttention, "ulysses": UlyssesAttention}[attention]
    done = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not SDPA or node.name not in kinds:
            continue
        args = sdpa_args(node)
        path = node_module_path(node)
        name = f"{path}.context_parallel" if path else "context_parallel"
        suffix = 0
        while _has_submodule(gm, name if not suffix else f"{name}_{suffix}"):
            suffix += 1
        name = name if not suffix else f"{name}_{suffix}"
        key, value, repeat = args["key"], args["value"], 1
        heads = repeated_heads(key), repeated_heads(value)
        if heads[0] is not None and heads[1] is not None and heads[0][1] == heads[1][1]:
            (key, repeat), (value, _) = heads  # type: ignore[misc]
        gm.add_submodule(name, kind(kinds[node.name], cp, float(args["dropout_p"]),
                                    args["scale"], bool(args["enable_gqa"]), repeat))
        with gm.graph.inserting_before(node):
            call = gm.graph.call_module(name, (args["query"], key, value))
        call.meta.update({k: node.meta[k] for k in ("val", "nn_module_stack", "stack_trace")
                          if k in node.meta})
        node.replace_all_uses_with(call)
        mask = args["attn_mask"]
        gm.graph.erase_node(node)
        erase_unread([mask, args["key"], args["value"]])
        done += 1
    if done:
        gm.graph.lint()
        gm.recompile()
    return done


def _has_submodule(gm: nn.Module, name: str) -> bool:
    try:
        gm.get_submodule(name)
    except AttributeError:
        return False
    return True
