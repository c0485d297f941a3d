"""Attention with learned sinks, as transformers' eager code writes it, fused into one
``scaled_dot_product_attention``.

GPT-OSS (and DeepSeek-V4, Flint, HY-V4, Inkling 2, MiMo-V2-Flash's sliding layers...) give
each head a learned logit ``s_h`` that joins the softmax as an extra column and attends to
nothing::

    scores = q @ k.transpose(-2, -1) * scale (+ mask)          # [B, H, Q, K]
    probs = softmax(cat([scores, s_h expanded to [B, H, Q, 1]], -1))[..., :-1]
    out = probs @ v                                             # [B, H, Q, Dv]

transformers marks such models ``_supports_sdpa = False`` and runs this eagerly, which
materialises every ``[B, H, Q, K]`` score matrix several times a layer (the cat, the max,
the softmax, the slice): at 4096 tokens and 64 heads, 2 GiB each in bf16, most of a GPT-OSS
layer's forward time and memory, where a fused kernel keeps them in on-chip tiles.

:func:`sink_attention_as_sdpa` rewrites the pattern into one attention over one more key, the
sink, whose score is ``s_h`` for every query and whose value is zero: the softmax then has
the same columns, and the sink's column adds nothing to the output. A dot product gives a
key the same score for every query only through a dimension every query shares, so the
head dimension gains one (padded to a multiple of 8, the fused kernels' granularity): the
queries read 1 there, the sink key ``s_h / scale`` and the other keys 0. The sink key goes
first and a dummy query row (discarded after the call) goes first too, so a causal mask
stays causal (square, top-left aligned) and the capture's
:func:`~autopart.core._capture_rewrites.attention_masks_as_flags` still turns it into
``is_causal=True``; a sliding-window mask keeps its window and gains the sink column.

Exact up to rounding: the max subtracted before the softmax (overflow protection in bf16)
changes no value, and the sink logit is divided by the scale and multiplied back. What the
rewrite leaves as captured: an attention whose dropout has ``p > 0`` in training (the
kernel would draw other random numbers), one whose probabilities are read elsewhere
(``output_attentions``), and any shape the pattern does not match exactly.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from autopart.core.capturedgraph import METADATA_CHECKS, SINK_ATTENTION_META, erase_unread

__all__ = ["sink_attention_as_sdpa"]

aten = torch.ops.aten
_SDPA = aten.scaled_dot_product_attention.default
_SHAPE_OPS = frozenset({aten.reshape.default, aten.view.default, aten.expand.default,
                        aten.unsqueeze.default, aten._to_copy.default, aten.to.dtype})
# What may sit between the probabilities' slice and the product with the values, changing
# no value: dropout with p = 0 (exported as a clone) and casts to the same dtype.
_PASS_THROUGH = frozenset({aten.clone.default, aten.dropout.default, aten._to_copy.default,
                           aten.to.dtype, aten.contiguous.default})


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _last_dim(dim: Any, rank: int) -> bool:
    return isinstance(dim, int) and dim in (-1, rank - 1)


def _users(node: fx.Node) -> list[fx.Node]:
    """``node``'s readers, export's metadata checks left out."""
    return [u for u in node.users if u.target not in METADATA_CHECKS]


def _sink_param(node: fx.Node) -> fx.Node | None:
    """The 1-D stored tensor ``node`` expands (through reshapes, casts and expands), or None."""
    while node.op == "call_function" and node.target in _SHAPE_OPS:
        node = node.args[0]  # type: ignore[assignment]
        if not isinstance(node, fx.Node):
            return None
    val = _val(node)
    return node if node.op == "get_attr" and isinstance(val, torch.Tensor) and \
        val.dim() == 1 else None


def _scores(node: fx.Node) -> tuple[fx.Node, fx.Node, float] | None:
    """``(q, k, scale)`` where ``node`` is ``q @ k.transpose(-2, -1)`` times constants."""
    scale = 1.0
    while node.op == "call_function" and node.target in (aten.mul.Tensor, aten.div.Tensor) \
            and isinstance(node.args[1], (int, float)) and len(_users(node)) == 1:
        c = float(node.args[1])
        scale = scale * c if node.target is aten.mul.Tensor else scale / c
        node = node.args[0]  # type: ignore[assignment]
    if node.target is not aten.matmul.default or len(_users(node)) != 1:
        return None
    q, kt = node.args[:2]
    if not isinstance(q, fx.Node) or not isinstance(kt, fx.Node) or \
            kt.target is not aten.transpose.int or len(_users(kt)) != 1:
        return None
    k, d0, d1 = kt.args[:3]
    qv, kv = _val(q), _val(k)
    if not isinstance(qv, torch.Tensor) or not isinstance(kv, torch.Tensor) or qv.dim() != 4 \
            or kv.dim() != 4 or {d0 % 4, d1 % 4} != {2, 3} or qv.shape[:2] != kv.shape[:2] or \
            qv.shape[-1] != kv.shape[-1]:
        return None
    return q, k, scale  # type: ignore[return-value]


def _match(cat: fx.Node) -> dict[str, Any] | None:
    """The parts of one sink attention around ``cat`` (its scores and the sink column), or
    None where the pattern does not match exactly."""
    if len(cat.args) < 1 or not isinstance(cat.args[0], (list, tuple)) or len(cat.args[0]) != 2:
        return None
    scores, sink = cat.args[0]
    dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    sv = _val(scores)
    if not isinstance(scores, fx.Node) or not isinstance(sink, fx.Node) or \
            not isinstance(sv, torch.Tensor) or sv.dim() != 4 or not _last_dim(dim, 4) or \
            len(_users(scores)) != 1 or _val(sink) is None or _val(sink).shape[-1] != 1:
        return None
    param = _sink_param(sink)
    if param is None or _val(param).shape[0] != sv.shape[1]:
        return None
    mask = None
    parts = _scores(scores)
    if parts is None and scores.target is aten.add.Tensor:
        a, b = scores.args[:2]
        for s, m in ((a, b), (b, a)):
            if isinstance(s, fx.Node) and isinstance(m, fx.Node) and \
                    isinstance(_val(m), torch.Tensor) and 2 <= _val(m).dim() <= 4:
                parts = _scores(s)
                if parts is not None:
                    mask = m
                    break
    if parts is None:
        return None
    q, k, scale = parts
    # forward from the cat: [max and sub], softmax over the last dim, slice off the sink
    node, chain = cat, [cat]
    readers = _users(node)
    if len(readers) == 2:
        mx = next((u for u in readers if u.target is aten.max.dim), None)
        sub = next((u for u in readers if u.target is aten.sub.Tensor), None)
        if mx is None or sub is None or sub.args[0] is not cat or len(_users(mx)) != 1:
            return None
        item = _users(mx)[0]
        if item.target is not operator.getitem or item.args[1] != 0 or sub.args[1] is not item:
            return None
        chain += [mx, item, sub]
        node = sub
        readers = _users(node)
    if len(readers) != 1 or readers[0].target not in (aten.softmax.int, aten._softmax.default) \
            or not _last_dim(readers[0].args[1], 4):
        return None
    node = readers[0]
    chain.append(node)
    readers = _users(node)
    keys = sv.shape[-1]
    if len(readers) != 1 or readers[0].target is not aten.slice.Tensor:
        return None
    cut = readers[0]
    start = cut.args[2] if len(cut.args) > 2 else 0
    end = cut.args[3] if len(cut.args) > 3 else None
    step = cut.args[4] if len(cut.args) > 4 else 1
    if not _last_dim(cut.args[1], 4) or start not in (0, None) or end not in (-1, keys) or \
            step != 1:
        return None
    node = cut
    chain.append(node)
    while True:
        readers = _users(node)
        if len(readers) != 1:
            return None
        nxt = readers[0]
        if nxt.target is aten.dropout.default:
            p, train = (list(nxt.args[1:3]) + [nxt.kwargs.get("p"), nxt.kwargs.get("train")])[:2]
            if p and train:
                return None  # the kernel would draw other random numbers
        elif nxt.target in _PASS_THROUGH:
            if _val(nxt).dtype != _val(node).dtype:
                return None
        else:
            break
        chain.append(nxt)
        node = nxt
    if nxt.target is not aten.matmul.default or nxt.args[0] is not node:
        return None
    v = nxt.args[1]
    vv = _val(v)
    if not isinstance(vv, torch.Tensor) or vv.dim() != 4 or vv.shape[-2] != keys:
        return None
    chain.append(nxt)
    return {"q": q, "k": k, "v": v, "mask": mask, "scale": scale, "param": param,
            "scores": scores, "sink": sink, "chain": chain, "out": nxt}


class _Builder:
    """New nodes before ``at`` with their fake values and ``at``'s module path."""

    def __init__(self, graph: fx.Graph, at: fx.Node) -> None:
        self.graph, self.at = graph, at
        self.mode = getattr(_val(at), "fake_mode", None)

    def __call__(self, op: Any, *args: Any, **kwargs: Any) -> fx.Node:
        with self.graph.inserting_before(self.at):
            node = self.graph.call_function(op, args, kwargs)
        for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
            if key in self.at.meta:
                node.meta[key] = self.at.meta[key]
        if self.mode is not None:
            fake_args, fake_kwargs = fx.node.map_arg((args, kwargs), _val)
            with self.mode:
                node.meta["val"] = op(*fake_args, **fake_kwargs)
        return node


def _rewrite(graph: fx.Graph, m: dict[str, Any]) -> None:
    q, k, v, mask, scale = m["q"], m["k"], m["v"], m["mask"], m["scale"]
    qv, kv = _val(q), _val(k)
    batch, heads, queries, dim = qv.shape
    keys = kv.shape[-2]
    pad = -(dim + 1) % 8
    new = _Builder(graph, m["out"])
    # queries: a 1 in the new dimension, zeros to the multiple of 8, a dummy row first
    q1 = new(aten.constant_pad_nd.default, q, [0, 1], 1.0)
    q1 = new(aten.constant_pad_nd.default, q1, [0, pad, 1, 0], 0.0)
    # keys: 0 in the new dimension; the sink key s_h / scale there, first
    k1 = new(aten.constant_pad_nd.default, k, [0, 1 + pad], 0.0)
    sink = new(aten.div.Tensor, m["param"], scale)
    sink = new(aten._to_copy.default, sink, dtype=kv.dtype)
    sink = new(aten.reshape.default, sink, [1, heads, 1, 1])
    sink = new(aten.expand.default, sink, [batch, heads, 1, 1])
    sink = new(aten.constant_pad_nd.default, sink, [dim, pad], 0.0)
    k1 = new(aten.cat.default, [sink, k1], 2)
    # values: the sink's is zero
    v1 = new(aten.constant_pad_nd.default, v, [0, 0, 1, 0], 0.0)
    attn_mask = None
    if mask is not None:
        mv = _val(mask)
        if mv.dim() < 4:  # a [Q, K] or [B, Q, K] mask broadcast over the heads
            shape = [1] * (4 - mv.dim()) + list(mv.shape)
            mask = new(aten.reshape.default, mask, shape)
            mv = _val(mask) if _val(mask) is not None else mv.reshape(shape)
        keep, drop = (True, False) if mv.dtype == torch.bool else \
            (0.0, torch.finfo(mv.dtype).min)
        # every query sees the sink; the dummy query sees the sink only
        col = new(aten.constant_pad_nd.default, mask, [1, 0], keep)
        top = new(aten.full.default, [mv.shape[0], mv.shape[1], 1, keys], drop,
                  dtype=mv.dtype, device=mv.device)
        top = new(aten.constant_pad_nd.default, top, [1, 0], keep)
        attn_mask = new(aten.cat.default, [top, col], 2)
    out = new(_SDPA, q1, k1, v1, attn_mask, 0.0, False, scale=scale)
    out.meta[SINK_ATTENTION_META] = True
    out = new(aten.slice.Tensor, out, 2, 1, queries + 1)
    m["out"].replace_all_uses_with(out)
    erase_unread([*m["chain"], m["scores"], m["sink"]])


def sink_attention_as_sdpa(graph: fx.Graph) -> int:
    """Rewrite every eager attention with learned sinks in ``graph`` into one
    ``aten.scaled_dot_product_attention`` over an extra sink key (module docstring).

    The pattern: ``cat([scores, sinks expanded], -1)`` (the sinks a 1-D parameter of one
    logit per head, the scores ``q @ k.transpose`` times constants plus an optional 4-D
    mask), an optional max subtracted, a softmax over the last dimension, the last column
    sliced off, optional dropout with ``p = 0`` and same-dtype casts, and a product with
    the values ``[B, H, K, Dv]``. Shapes: queries and keys ``[B, H, Q|K, D]`` (keys
    already repeated for grouped-query attention, as eager attention does); the mask
    ``[Q, K]``, ``[B|1, Q, K]`` or ``[B|1, H|1, Q, K]``, additive or boolean.

    Returns:
        The number of attentions rewritten; others are left as captured.
    """
    count = 0
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is aten.cat.default and \
                not getattr(node, "_erased", False):
            found = _match(node)
            if found is not None:
                _rewrite(graph, found)
                count += 1
    if count:
        graph.lint()
    return count
