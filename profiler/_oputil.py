"""Helpers shared by the profilers: extra FLOP formulas, ops that write to their arguments."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.utils.flop_counter import sdpa_flop_count

__all__ = ["EXTRA_FLOP_FORMULAS", "MeasureReport"]


def _cpu_sdpa_flop(query_shape: Any, key_shape: Any, value_shape: Any, *args: Any,
                   out_shape: Any = None, **kwargs: Any) -> int:
    """FLOPs of CPU's fused attention: the same count torch gives the CUDA kernels."""
    return int(sdpa_flop_count(query_shape, key_shape, value_shape))  # type: ignore[no-untyped-call]


# FLOP formulas torch's counter lacks (keyed by op packet, as FlopCounterMode looks them up).
EXTRA_FLOP_FORMULAS: dict[Any, Any] = {}
if hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
    EXTRA_FLOP_FORMULAS[torch.ops.aten._scaled_dot_product_flash_attention_for_cpu] = (
        _cpu_sdpa_flop)


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
