"""What context parallelism's attention computes on a rank, against the model's own attention,
measured on the profiled device.

A graph captured at a cp rank's S / cp tokens was profiled with the model's own attention over
those tokens. The runtime replaces it (:mod:`autopart.codegen.context_parallel`): with the
all-gather form, two calls per causal attention, each of one query chunk over the keys of its
own and earlier chunks with a boolean block mask, after the gathered keys are put in sequence
order and grouped-query attention's heads repeated; with Ulysses, the model's attention over
the whole sequence for heads / cp of the heads, between reorders. The solver's analytical
ratio for the all-gather form, (2 cp + 1) / 4 chunk-by-chunk blocks against the 4 of the
masked local attention, leaves out what the blocks cost beyond their count: on this project's
2-core CPU (torch 2.13.0+cpu, one thread; Llama shape, 2 x 512 tokens per rank, 4 / 2 heads of
64, cp 2) the runtime's attention took 6.2 / 13.6 ms forward / backward where the model's own
took 4.1 / 9.1: 1.5x, not the 1.25x of the block count.

:func:`measure_context_attention` times both, alternated, on tensors of the captured shapes
(:func:`autopart.codegen.attention_graph.attention_calls`), the runtime's module with its
exchanges stood in for by local copies (:func:`autopart.codegen.context_parallel.
stand_in_attention`; the exchanges are priced as collectives). Its ratio replaces the solver's
block count for that cp (``LayoutOptions.cp_attention_factors``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from autopart.codegen.attention_graph import AttentionCall, attention_calls
from autopart.codegen.context_parallel import stand_in_attention
from autopart.core.capture import CapturedGraph
from autopart.profiler.timer import check_device

__all__ = ["measure_context_attention"]


def _own(call: AttentionCall, device: torch.device) -> Callable[..., torch.Tensor]:
    """The model's own attention of ``call`` (its mask rebuilt: causal or all ones)."""
    mask = None
    if call.mask is not None:
        shape, dtype = call.mask
        rows, cols = shape[-2:]
        allowed = torch.ones(rows, cols, dtype=torch.bool, device=device)
        if call.causal:
            allowed = allowed.tril()
        if dtype != torch.bool:
            allowed = torch.zeros(rows, cols, dtype=dtype, device=device).masked_fill(
                ~allowed, torch.finfo(dtype).min)
        mask = allowed.expand(*shape).contiguous()

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0,
                                              is_causal=call.causal and mask is None,
                                              scale=call.scale, enable_gqa=call.enable_gqa)
    return run


def _timed(fn: Callable[..., torch.Tensor], shapes: tuple[tuple[int, ...], ...],
           device: torch.device, dtype: torch.dtype) -> tuple[float, float]:
    """One forward and backward of ``fn`` on fresh random operands of ``shapes``, µs each."""
    ops = [torch.randn(s, device=device, dtype=dtype, requires_grad=True) for s in shapes]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    out = fn(*ops)
    sync()
    t1 = time.perf_counter()
    out.backward(torch.ones_like(out))
    sync()
    return (t1 - t0) * 1e6, (time.perf_counter() - t1) * 1e6


def measure_context_attention(captured: CapturedGraph, cp: int, attention: str = "all_gather",
                              *, device: str = "cpu", dtype: torch.dtype = torch.float32,
                              pairs: int = 9, budget_s: float = 3.0) -> tuple[float, float]:
    """``(forward, backward)`` time of the runtime's attention at ``cp`` over the model's own,
    on ``captured`` (a graph of one cp rank's S / cp tokens), measured on ``device``.

    Each distinct attention (:func:`autopart.codegen.attention_graph.attention_calls`) runs,
    per pair, once as the model computes it and once as each of the cp ranks' modules would
    (the slowest rank's time: the ranks wait for each other at the next exchange), the order
    alternating; the first pair is a warm-up; pairs until ``pairs`` or ``budget_s`` seconds
    (at least 3). Each ratio is the sum over the distinct attentions of the medians, runtime
    over model.

    Args:
        captured: the captured graph, at one cp rank's tokens.
        cp: the context-parallel degree (>= 2).
        attention: ``"all_gather"`` (default) or ``"ulysses"`` (``Plan.cp_attention``).
        device: ``"cpu"`` (default) or ``"cuda:N"``.
        dtype: the operands' dtype (default float32; the model's).
        pairs: timed pairs at most (default 9).
        budget_s: seconds after which no pair beyond the third starts (default 3).

    Returns:
        ``(forward ratio, backward ratio)``, each > 0.

    Raises:
        PlanError: the graph's attention cannot run context-parallel
            (:func:`autopart.codegen.attention_graph.attention_calls`).
        ValueError: ``cp`` below 2 or another ``attention``.
        ProfileError: a bad ``device``.
    """
    if cp < 2:
        raise ValueError(f"cp={cp}: the runtime's attention differs from the model's only at "
                         "cp >= 2")
    dev = check_device(device)
    own_f = own_b = cp_f = cp_b = 0.0
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        for call in attention_calls(captured):
            own = _own(call, dev)
            ranks = [stand_in_attention(call, cp, r, attention).to(dev) for r in range(cp)]
            arms: dict[str, list[tuple[float, float]]] = {"own": [], "cp": []}
            start = time.perf_counter()
            for pair in range(pairs + 1):
                if pair > 3 and time.perf_counter() - start > budget_s:
                    break
                for arm in (("own", "cp") if pair % 2 else ("cp", "own")):
                    if arm == "own":
                        got = _timed(own, (call.query, call.key, call.key), dev, dtype)
                    else:
                        each = [_timed(m, (call.query, call.moved_key, call.moved_key), dev,
                                       dtype) for m in ranks]
                        got = (max(f for f, _ in each), max(b for _, b in each))
                    if pair:
                        arms[arm].append(got)
            own_f += statistics.median(f for f, _ in arms["own"])
            own_b += statistics.median(b for _, b in arms["own"])
            cp_f += statistics.median(f for f, _ in arms["cp"])
            cp_b += statistics.median(b for _, b in arms["cp"])
    return cp_f / max(own_f, 1e-9), cp_b / max(own_b, 1e-9)
