"""Helpers shared by the profilers: extra FLOP formulas, ops that write to their arguments."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.utils.flop_counter import sdpa_flop_count

from autopart.core.capturedgraph import GROUPED_MM_OPS, sdpa_arguments, weight_source

__all__ = ["EXTRA_FLOP_FORMULAS", "GROUPED_MM_OPS", "MeasureReport", "attention_work",
           "causal_attention", "causal_fraction", "flop_formulas", "grouped_mm_flop",
           "weight_source"]


def _cpu_sdpa_flop(query_shape: Any, key_shape: Any, value_shape: Any, *args: Any,
                   out_shape: Any = None, **kwargs: Any) -> int:
    """FLOPs of CPU's fused attention: the same count torch gives the CUDA kernels."""
    return int(sdpa_flop_count(query_shape, key_shape, value_shape))  # type: ignore[no-untyped-call]


_SDPA = torch.ops.aten.scaled_dot_product_attention.default


def causal_fraction(queries: int, keys: int) -> float:
    """The share of (query, key) pairs a causal mask keeps, top-left aligned as ``is_causal``
    masks (query ``i`` sees keys ``0 .. i``): ``(S + 1) / 2 S`` for ``S`` of each. A kernel
    that skips the masked blocks (FlashAttention, torch's CPU flash kernel) does about this
    share of the unmasked work; it still computes the blocks the diagonal crosses, which
    this leaves out (under 1 % at 8192 tokens in 128-wide tiles)."""
    if queries <= 0 or keys <= 0:
        return 1.0
    kept = sum(min(i + 1, keys) for i in range(queries)) if queries < keys else \
        keys * (keys + 1) // 2 + (queries - keys) * keys
    return kept / (queries * keys)


def _causal_shapes(node: fx.Node) -> tuple[int, int] | None:
    """``(queries, keys)`` of an attention node run with ``is_causal`` and no mask, else None."""
    if node.op != "call_function" or node.target is not _SDPA:
        return None
    given = sdpa_arguments(node)
    if not given.get("is_causal") or given.get("attn_mask") is not None:
        return None
    q, k = (x.meta.get("val") if isinstance(x, fx.Node) else None
            for x in (given.get("query"), given.get("key")))
    if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor):
        return None
    return int(q.shape[-2]), int(k.shape[-2])


def attention_work(node: fx.Node) -> float:
    """The share of the unmasked attention's FLOPs ``node`` does: :func:`causal_fraction` for
    ``scaled_dot_product_attention`` run with ``is_causal`` (torch's FLOP formulas count every
    pair), 1 for any other node."""
    shapes = _causal_shapes(node)
    return 1.0 if shapes is None else causal_fraction(*shapes)


def causal_attention(graph: fx.Graph) -> frozenset[str]:
    """Names of the attention nodes of ``graph`` run with ``is_causal`` and no mask
    (``CostGraph.causal_attention``)."""
    return frozenset(n.name for n in graph.nodes if _causal_shapes(n) is not None)


def grouped_mm_flop(a_shape: Any, b_shape: Any, *args: Any, out_shape: Any = None,
                    **kwargs: Any) -> int:
    """FLOPs of a grouped GEMM (``aten._grouped_mm``, transformers' ``grouped_mm_fallback``):
    twice its multiply-adds, however the rows are split among the groups.

    Shapes (``torch._grouped_mm``'s four forms): ``a [M, K]`` x ``b [G, K, N]`` (tokens sorted
    by expert, one weight per expert: mixture-of-experts layers), ``a [G, M, K]`` x
    ``b [G, K, N]`` (batched), ``a [G, M, K]`` x ``b [K, N]``: each output element is one
    ``K``-long dot product, so ``2 * out.numel() * K``. ``a [M, K]`` x ``b [K, N]`` with the
    groups along ``K`` (the weight gradient of the first form; out ``[G, M, N]``):
    ``2 * M * K * N``. The routing (``offs``) moves rows between groups but not the total.
    """
    if len(a_shape) == 2 and len(b_shape) == 2:
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    numel = 1
    for d in out_shape:
        numel *= d
    return 2 * numel * a_shape[-1]


# FLOP formulas torch's counter lacks (keyed by op packet, as FlopCounterMode looks them up).
EXTRA_FLOP_FORMULAS: dict[Any, Any] = {torch.ops.aten._grouped_mm: grouped_mm_flop}
if hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
    EXTRA_FLOP_FORMULAS[torch.ops.aten._scaled_dot_product_flash_attention_for_cpu] = (
        _cpu_sdpa_flop)


def flop_formulas() -> dict[Any, Any]:
    """:data:`EXTRA_FLOP_FORMULAS` plus those of ops registered after import: transformers'
    ``transformers::grouped_mm_fallback`` (its MoE experts on CPU and in float32 capture)
    exists once ``transformers.integrations.moe`` is imported, which a capture of a MoE model
    does. Pass the result as ``FlopCounterMode(custom_mapping=...)``."""
    try:
        fallback = torch.ops.transformers.grouped_mm_fallback
    except (AttributeError, RuntimeError):
        return EXTRA_FLOP_FORMULAS
    EXTRA_FLOP_FORMULAS.setdefault(fallback, grouped_mm_flop)
    return EXTRA_FLOP_FORMULAS


def _written_args(node: fx.Node) -> list[int | str]:
    """Positions / kwarg names of the arguments an OpOverload's schema says it writes to."""
    schema = getattr(node.target, "_schema", None)
    if not isinstance(node.target, torch._ops.OpOverload) or schema is None:
        return []
    written: list[int | str] = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            written.append(i if i < len(node.args) else arg.name)
    return written


def _clone_written(args: tuple[Any, ...], kwargs: dict[str, Any], written: list[int | str],
                   ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Copies of ``args``/``kwargs`` with every written tensor argument cloned."""
    if not written:
        return args, kwargs
    a, k = list(args), dict(kwargs)
    for w in written:
        if isinstance(w, int) and isinstance(a[w], torch.Tensor):
            a[w] = a[w].clone()
        elif isinstance(w, str) and isinstance(k.get(w), torch.Tensor):
            k[w] = k[w].clone()
    return tuple(a), k


@dataclass
class _Run:
    """What one instrumented forward of a node gave."""

    us: float = 0.0
    value: Any = None  # the output, detached: what the rest of the graph reads
    flops: int = 0
    saved_bytes: int = 0
    saved_keys: set[tuple[str, int]] = field(default_factory=set)
    saved_from: tuple[tuple[int, int], ...] = ()  # see NodeCost.saved_from
    samples: list[float] = field(default_factory=list)
    outs: list[torch.Tensor] = field(default_factory=list)  # outputs that need a gradient
    input_leaves: list[torch.Tensor] = field(default_factory=list)
    weight_leaves: list[torch.Tensor] = field(default_factory=list)


@dataclass
class MeasureReport:
    """What :func:`profile_graph_report` saw besides the costs.

    Attributes:
        fwd_spread: node name -> relative spread of its forward samples,
            ``(max - min) / median`` (0 with one sample or when the node was reused).
        reused: node name -> name of the node of the first identical layer whose costs it
            took (see :func:`autopart.profiler.blocks.repeated_blocks`).
        reuse_saved_s: estimated seconds saved by reuse: the representatives' measurement
            time minus the time spent running the reused nodes once.
    """

    fwd_spread: dict[str, float] = field(default_factory=dict)
    reused: dict[str, str] = field(default_factory=dict)
    reuse_saved_s: float = 0.0
