"""What context parallelism reads of a captured graph's attention: each
``aten.scaled_dot_product_attention`` node's kind (causal or over the whole sequence, from
the model's own mask), the heads every attention divides, and the distinct attention calls
with their shapes, which :mod:`autopart.codegen.context_parallel` rewrites and
:mod:`autopart.profiler.context_attention` times.

A mask is evaluated on contiguous positions and must be causal (lower-triangular) or all
ones; a mask that reads an ``attention_mask`` input (padding), a sliding window, attention
with learned sinks (its fused form carries a sink key and a dummy query), or attention not
computed by ``scaled_dot_product_attention`` (transformers' ``attn_implementation="eager"``)
is refused with a ``PlanError`` naming the node and the fix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from autopart.core.capturedgraph import SINK_ATTENTION_META, CapturedGraph
from autopart.core.errors import PlanError
from autopart.core.op_names import REPEAT_KV_OPS

__all__ = ["SDPA", "AttentionCall", "attention_calls", "attention_heads", "attention_kinds",
           "repeated_heads", "sdpa_args"]

SDPA = torch.ops.aten.scaled_dot_product_attention.default
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
              "enable_gqa")
_FIX = "re-plan with cp=1"


def sdpa_args(node: fx.Node) -> dict[str, Any]:
    given = dict(zip(_SDPA_ARGS, node.args, strict=False))
    given.update(node.kwargs)
    return {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None,
            "enable_gqa": False, **given}


def attention_kinds(captured: CapturedGraph) -> dict[str, bool]:
    """Each attention node of the captured graph (by name) -> whether it is causal.

    Raises:
        PlanError: no ``scaled_dot_product_attention`` in the graph, another attention
            kernel, a mask read from an ``attention_mask`` input, or a mask that is neither
            causal nor all ones (:func:`_mask_is_causal`); each names the node and the fix.
    """
    gm = captured.graph_module
    kinds: dict[str, bool] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is SDPA:
            if node.meta.get(SINK_ATTENTION_META):
                raise PlanError(f"attention node {node.name} has learned sinks (GPT-OSS and "
                                "its kind), captured as one attention over an extra sink key "
                                "and a dummy query; context parallelism does not split it "
                                f"yet; {_FIX}")
            args = sdpa_args(node)
            mask = args["attn_mask"]
            kinds[node.name] = (bool(args["is_causal"]) if mask is None
                                else _mask_is_causal(gm, node, mask))
        elif "scaled_dot_product" in str(node.target) or "flash_attention" in str(node.target):
            raise PlanError(f"attention node {node.name} ({node.target}) is not "
                            "aten.scaled_dot_product_attention, which context parallelism "
                            f"rewrites; capture the model with attn_implementation='sdpa' or {_FIX}")
    if not kinds:
        raise PlanError("context parallelism splits attention's keys and values over the cp "
                        "ranks, but this model has no aten.scaled_dot_product_attention (a "
                        "model with attn_implementation='eager' computes it from matmuls); "
                        f"load it with attn_implementation='sdpa' or {_FIX}")
    return kinds


def attention_heads(captured: CapturedGraph) -> int | None:
    """The head count every attention of the captured graph divides among its queries, keys
    and values (the greatest common divisor of their dimension 1, ``[B, H, S, D]``), or None
    when a recorded shape is missing: Ulysses splits them over tp x cp GPUs."""
    out = 0
    for node in captured.graph_module.graph.nodes:
        if node.op != "call_function" or node.target is not SDPA:
            continue
        args = sdpa_args(node)
        for operand in (args["query"], args["key"], args["value"]):
            val = operand.meta.get("val") if isinstance(operand, fx.Node) else None
            if not isinstance(val, torch.Tensor) or val.dim() != 4:
                return None
            out = math.gcd(out, int(val.shape[1]))
    return out or None


def _mask_is_causal(gm: fx.GraphModule, attn: fx.Node, mask: fx.Node) -> bool:
    """Whether ``attn``'s mask (computed in the graph) is causal (True) or all ones (False),
    evaluated on contiguous positions 0..S-1 and zeros for any other input it reads.

    Raises:
        PlanError: the mask reads an ``attention_mask`` input, cannot be evaluated (a meta
            model), or is neither.
    """
    ancestors: set[fx.Node] = set()
    todo = [mask]
    while todo:
        n = todo.pop()
        if n not in ancestors:
            ancestors.add(n)
            todo.extend(n.all_input_nodes)
    if any(n.op == "placeholder" and "attention_mask" in n.name for n in ancestors):
        raise PlanError(f"attention node {attn.name} reads an attention_mask input (padding): "
                        "context parallelism runs causal or full attention only; drop "
                        f"attention_mask (unpadded sequences) or {_FIX}")
    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs: list[torch.Tensor] = []
    for n in gm.graph.nodes:
        if n not in ancestors:
            continue
        env[n] = sub.node_copy(n, env.__getitem__)
        if n.op == "placeholder":
            inputs.append(_stand_in(n))
    sub.output(env[mask])
    try:
        with torch.no_grad():
            value = fx.GraphModule(gm, sub)(*inputs)
    except Exception as exc:  # noqa: BLE001 - any failure means the mask cannot be read here
        raise PlanError(f"the attention mask of node {attn.name} could not be evaluated to check "
                        f"it is causal ({type(exc).__name__}: {exc}); context parallelism needs "
                        f"a materialised model to read it, or {_FIX}") from None
    allowed = value if value.dtype == torch.bool else value == 0
    rows, cols = allowed.shape[-2:]
    allowed = allowed.expand(*allowed.shape[:-2], rows, cols).reshape(-1, rows, cols)
    causal = torch.ones(rows, cols, dtype=torch.bool).tril()
    if bool((allowed == causal).all()):
        return True
    if bool(allowed.all()):
        return False
    raise PlanError(f"attention node {attn.name}'s mask is neither causal nor all ones (a "
                    "sliding window or packed sequences?): context parallelism runs causal or "
                    f"full attention only; {_FIX}")


def _stand_in(placeholder: fx.Node) -> torch.Tensor:
    val = placeholder.meta.get("val")
    if not isinstance(val, torch.Tensor):
        raise PlanError(f"input {placeholder.name} of attention's mask has no recorded shape, so "
                        "the mask cannot be checked causal; capture the model with "
                        f"autopart's capture (torch.export records it), or {_FIX}")
    if "position_ids" in placeholder.name:
        return torch.arange(val.shape[-1]).expand(tuple(val.shape)).to(val.dtype)
    return torch.zeros(tuple(val.shape), dtype=val.dtype)


@dataclass(frozen=True)
class AttentionCall:
    """One attention of a captured graph as context parallelism rewrites it (shapes of one
    cp rank's tokens when the graph was captured at S / cp tokens).

    Attributes:
        query, key: the model's attention operands' shapes, ``[B, H, L, D]`` and
            ``[B, H or Hk, L, D]`` (the value has the key's).
        moved_key: the key heads the runtime receives, ``[B, Hk, L, D]`` (before
            grouped-query attention's repeat where :func:`context_parallel` reads it).
        kv_repeat: ``key[1] // moved_key[1]``.
        mask: the model's mask ``(shape, dtype)``, or None (no mask).
        causal, dropout_p, scale, enable_gqa: as the model's attention computes it.
    """

    query: tuple[int, ...]
    key: tuple[int, ...]
    moved_key: tuple[int, ...]
    kv_repeat: int
    mask: tuple[tuple[int, ...], torch.dtype] | None
    causal: bool
    dropout_p: float
    scale: float | None
    enable_gqa: bool


def attention_calls(captured: CapturedGraph) -> list[AttentionCall]:
    """The distinct attentions of ``captured`` (:class:`AttentionCall`; a transformer's layers
    share one), in graph order.

    Raises:
        PlanError: as :func:`attention_kinds`, or an operand without a recorded shape
            (capture with autopart's capture: ``torch.export`` records them).
    """
    kinds = attention_kinds(captured)
    seen: list[AttentionCall] = []
    for node in captured.graph_module.graph.nodes:
        if node.op != "call_function" or node.name not in kinds:
            continue
        args = sdpa_args(node)
        key = args["key"]
        heads = repeated_heads(key), repeated_heads(args["value"])
        moved = (heads[0][0] if heads[0] is not None and heads[1] is not None
                 and heads[0][1] == heads[1][1] else key)  # as context_parallel reads them
        shapes = []
        for operand in (args["query"], key, moved):
            val = operand.meta.get("val") if isinstance(operand, fx.Node) else None
            if not isinstance(val, torch.Tensor):
                raise PlanError(f"attention node {node.name} has an operand without a recorded "
                                f"shape; capture the model with autopart's capture, or {_FIX}")
            shapes.append(tuple(int(x) for x in val.shape))
        mask = args["attn_mask"]
        mval = mask.meta.get("val") if isinstance(mask, fx.Node) else None
        call = AttentionCall(shapes[0], shapes[1], shapes[2], shapes[1][1] // shapes[2][1],
                             None if not isinstance(mval, torch.Tensor)
                             else (tuple(int(x) for x in mval.shape), mval.dtype),
                             kinds[node.name], float(args["dropout_p"] or 0.0), args["scale"],
                             bool(args["enable_gqa"]))
        if call not in seen:
            seen.append(call)
    return seen


def repeated_heads(node: Any) -> tuple[fx.Node, int] | None:
    """``(the key heads [B, Hk, S, D], n)`` when ``node`` is their repeat to ``[B, Hk n, S, D]``
    (transformers' ``repeat_kv``, :data:`autopart.core.op_names.REPEAT_KV_OPS`), else None."""
    unsqueeze, expand, clone, reshapes = REPEAT_KV_OPS
    if not (isinstance(node, fx.Node) and node.op == "call_function"
            and str(node.target) in reshapes):
        return None
    x = node.args[0]
    if isinstance(x, fx.Node) and str(x.target) == clone:
        x = x.args[0]
    if not (isinstance(x, fx.Node) and str(x.target) == expand):
        return None
    sizes, inner = x.args[1], x.args[0]
    if not (isinstance(inner, fx.Node) and str(inner.target) == unsqueeze
            and inner.args[1] == 2 and isinstance(sizes, (list, tuple)) and len(sizes) == 5
            and isinstance(sizes[2], int) and isinstance(inner.args[0], fx.Node)):
        return None
    return inner.args[0], sizes[2]
