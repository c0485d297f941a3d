"""One GPU's share of a model's costs at context parallelism cp, as
``autopart/codegen/context_parallel.py`` runs it.

A cp rank holds S / cp tokens of each sequence (two chunks of S / (2 cp): chunks r and
2 cp - 1 - r). :func:`split_tokens` turns the costs of whole sequences into one rank's:

- every node's time, FLOPs and bytes (outputs, saved, transient, graph inputs) divided by cp:
  token-wise ops (norms, matmuls, activations, the loss) do 1 / cp of the work on 1 / cp of
  the activations; parameter bytes stay whole, and so does each op's fixed time (the
  device's ``op_overhead_us``: a rank issues every op of the sequence);
- attention (``aten.scaled_dot_product_attention``), quadratic in the tokens: 1 / cp^2, the
  model's own attention over the rank's S / cp tokens.

:func:`context_costs` then prices what the runtime adds to each attention of a graph at
S / cp tokens (the compile path profiles it there; the CLI splits a profile of whole
sequences first):

- compute: the runtime's attention over the gathered keys. Causal: the rank's two query
  chunks attend to chunks 0..g, g = r and 2 cp - 1 - r, (2 cp + 1) chunk-by-chunk blocks
  (the diagonal ones computed whole, under a mask), against the 4 blocks of the local
  attention where the profile timed it with a mask (a masked kernel computes every block):
  time x (2 cp + 1) / 4; against 2 where it ran with ``is_causal`` and skipped the upper
  half (``CostGraph.causal_attention``: capture gives attention the flag where
  transformers' mask is causal and built from the shapes alone): x (2 cp + 1) / 2.
  Attention over the whole sequence (BERT):
  S / cp queries over S keys, x cp. Where the runtime's attention was timed against the
  model's on the graph's shapes (``measured``: the compile path's profile at S / cp tokens),
  the measured ratios instead (on this project's CPU 1.43-1.66 / 1.49-1.63 forward /
  backward at cp 2 where the block count gives 1.25: two calls of half the queries, the
  boolean block masks, the reorder and the heads' repeat);
- communication: in the forward the keys and values all-gathered (two ring all-gathers of
  the whole sequence's keys, :func:`autopart.solver.collectives.all_gather_us` on the cp
  group's link, plus the runtime's fixed cost per collective after one GPU's work between
  two of them, as tp's collectives are priced), in the backward their gradients
  reduce-scattered (two); in line, not overlapped, as the runtime runs them;
- memory: the other ranks' keys and values (``(cp - 1) x`` the rank's, as attention takes
  them: repeated) held from the forward to the backward on top of what the node saved (the
  kernel saves the whole sequence's where the model's own saved the rank's; ``index_select``
  and the gather save none), and their whole sequence's gradients (``cp x``) in the node's
  backward working set. The model's own float mask, which the node saved and the runtime's
  block masks replace, is not taken off. Measured on this project's CPU
  (``benchmarks/context_parallel``, 4-layer Llama shape, 2 x 1024 tokens per microbatch, cp
  2, saved tensors counted with ``saved_tensors_hooks``): autograd keeps 7.3 MiB per layer
  (the rank's queries, the gathered and repeated keys and values, both outputs, the block
  masks' float copies) where this prices 8.0 (the model's own attention at 512 tokens, 6.0,
  plus 2.0).

With ``attention="ulysses"`` (``Plan.cp_attention``; :class:`autopart.codegen.context_parallel.
UlyssesAttention`) each attention instead:

- computes the model's attention over the whole sequence for heads / cp of the heads, in
  sequence order with ``is_causal`` (the kernel skips the blocks above the diagonal): the
  same (2 cp + 1) chunk-by-chunk blocks per rank as the all-gather form, x (2 cp + 1) / 4
  causal against a masked kernel, x cp against one that skips as well, x cp over the whole
  sequence, or the measured ratios (``measured``; 1.55 / 1.47
  on this project's CPU in the case above: the reorders around it);
- exchanges in its forward the queries, keys and values (one all-to-all each of the
  rank's ``[B, H, S / cp, D]``, :func:`autopart.solver.collectives.all_to_all_us`) and
  the output back (one more), and in its backward the same four the other way;
- holds nothing beyond what the node saved: the kernel saves exchanged queries, keys,
  values and output of the bytes of the rank's own (measured as above: 4.1 MiB per layer
  against the model's own 6.0, which saved its float mask as well); in its backward each
  gradient of the output and of the three inputs is made contiguous, received (the
  all-to-all) and reordered (``index_select``'s backward): three copies of each add to the
  node's transient working set.

The exchanges run through :mod:`autopart.codegen._tp_ops`' collectives, which on the CPU
memory meter's steps wait for gloo's thread to let go of their buffers; through torch's
functional collectives those frees fell to gloo's thread, unseen by the meter, and the
measured peaks of these arms moved by 5-15 MiB from run to run (182-193 MiB for one stage at
cp 2, against 176.7 MiB on every run since).

Gradients and ZeRO over the dp x cp ranks are priced by the layout search (the dp line
holds dp x cp GPUs, :mod:`autopart.solver.layout_search`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from autopart.core.costgraph import CostGraph, NodeCost
from autopart.core.op_names import REPEAT_KV_OPS
from autopart.solver.collectives import (
    all_gather_us,
    all_reduce_us,
    all_to_all_us,
    reduce_scatter_us,
)
from autopart.solver.tensor_parallel_costs import _split_time

__all__ = ["ATTENTION_OP", "attention_nodes", "context_costs", "repeated_heads", "split_tokens"]

#: The attention op context parallelism rewrites, as the cost graph names it.
ATTENTION_OP = "aten.scaled_dot_product_attention.default"


def attention_nodes(costs: CostGraph) -> list[int]:
    """Indices of the attention nodes of ``costs``."""
    return [i for i, nd in enumerate(costs.nodes) if nd.op == ATTENTION_OP]


def repeated_heads(by_name: dict[str, NodeCost], name: str) -> tuple[str, int] | None:
    """``(the node of the unrepeated key heads, n)`` when node ``name`` is their repeat n
    times (transformers' ``repeat_kv``, :data:`autopart.core.op_names.REPEAT_KV_OPS`: the
    chain codegen's context parallelism reads), else None."""
    unsqueeze, expand, clone, reshapes = REPEAT_KV_OPS
    nd = by_name.get(name)
    if nd is None or nd.op not in reshapes or not nd.inputs:
        return None
    x = by_name.get(nd.inputs[0])
    if x is not None and x.op == clone and x.inputs:
        x = by_name.get(x.inputs[0])
    if x is None or x.op != expand or not x.inputs:
        return None
    inner = by_name.get(x.inputs[0])
    if inner is None or inner.op != unsqueeze or not inner.inputs:
        return None
    source = by_name.get(inner.inputs[0])
    if source is None or source.output_bytes <= 0 or nd.output_bytes % source.output_bytes:
        return None
    return source.name, nd.output_bytes // source.output_bytes


def _scaled(nd: NodeCost, time: float, size: float) -> NodeCost:
    """``nd`` with its times and FLOPs x ``time`` and its activation bytes x ``size`` (host
    issue times stay: issuing an op costs the host the same at any size)."""
    return replace(
        nd, fwd_us=nd.fwd_us * time, bwd_input_us=nd.bwd_input_us * time,
        bwd_weight_us=nd.bwd_weight_us * time, flops=int(nd.flops * time),
        bytes_accessed=int(nd.bytes_accessed * size), output_bytes=int(nd.output_bytes * size),
        saved_bytes=int(nd.saved_bytes * size), transient_bytes=int(nd.transient_bytes * size),
        backward_peak_bytes=int(nd.backward_peak_bytes * size),
        strided_output_bytes=int(nd.strided_output_bytes * size),
        saved_from=None if nd.saved_from is None else tuple(
            (d, int(b * size)) for d, b in nd.saved_from))


def split_tokens(costs: CostGraph, cp: int, op_overhead_us: float = 0.0) -> CostGraph:
    """One cp rank's costs from those of whole sequences (see the module docstring): every
    node / cp, attention nodes' time and FLOPs / cp^2; of each time, the fixed part of an
    op (``op_overhead_us``, ``DeviceSpec.op_overhead_us``: issuing and launching it) stays
    whole, as tp's split and the cost model's batch scaling keep it (a cp rank runs every op
    of the sequence). ``costs`` itself at cp = 1."""
    if cp == 1:
        return costs
    attention = set(attention_nodes(costs))

    def div(i: int) -> int:
        return cp ** 2 if i in attention else cp

    nodes = tuple(replace(_scaled(nd, 1 / div(i), 1 / cp),
                          **{k: _split_time(getattr(nd, k), div(i), op_overhead_us)
                             for k in ("fwd_us", "bwd_input_us", "bwd_weight_us")})
                  for i, nd in enumerate(costs.nodes))
    low = tuple(tuple(_split_time(t, div(i), op_overhead_us) for t in times)
                for i, times in enumerate(costs.low_times))
    return replace(costs, nodes=nodes, low_times=low,  # type: ignore[arg-type]
                   low_backward_peaks=tuple(b // cp for b in costs.low_backward_peaks),
                   graph_inputs={k: v // cp for k, v in costs.graph_inputs.items()},
                   loss_saved_bytes=costs.loss_saved_bytes // cp)


def _block_work(cp: int, causal: bool, attention: str, skips: bool) -> float:
    """The runtime's attention work on a cp rank over the model's own on the rank's tokens
    (see the module docstring): x cp over every key; causal, (2 cp + 1) blocks (the
    all-gather form computes its diagonal blocks whole, under a mask) against 4 where the
    model's kernel computes every block (a mask) and 2 where it skips the upper half
    (``is_causal``, ``CostGraph.causal_attention``), and Ulysses, whose kernel skips too,
    x cp against a kernel that skips."""
    if not causal:
        return float(cp)
    if skips:
        return float(cp) if attention == "ulysses" else (2 * cp + 1) / 2
    return (2 * cp + 1) / 4


def context_costs(costs: CostGraph, cp: int, *, causal: bool, bandwidth_bytes_per_s: float,
                  latency_us: float,
                  collective_overhead: Callable[[float], float] | None = None,
                  reduce_scatter_as_all_reduce: bool = False,
                  attention: str = "all_gather", heads: int | None = None,
                  measured: tuple[float, float] | None = None) -> CostGraph:
    """One GPU's costs at ``cp`` from ``costs`` of the model at S / cp tokens (see the module
    docstring). ``costs`` itself at cp = 1.

    Args:
        costs: the cost graph at one cp rank's tokens (:func:`split_tokens` of whole
            sequences, or a profile of the model captured at S / cp tokens).
        cp: the context-parallel degree.
        causal: the model's attention is causal (decoders) or over every token (encoders).
        bandwidth_bytes_per_s, latency_us: the cp group's link (bus bandwidth one way, one
            step's latency).
        collective_overhead: what one collective costs beyond its transfer after that much
            work, µs (``RuntimeDescription.collective_overhead_at``), or None.
        reduce_scatter_as_all_reduce: the runtime's reduce-scatter costs an all-reduce of
            the same buffer (``RuntimeDescription.reduce_scatter_as_all_reduce``: gloo).
        attention: ``"all_gather"`` (default) or ``"ulysses"`` (``Plan.cp_attention``).
        heads: the query heads of one GPU's attention before cp (H / tp), or None: Ulysses
            then moves grouped-query keys and values repeated (:func:`repeated_heads`).
        measured: ``(forward, backward)`` time of the runtime's attention over the model's
            own on this graph's shapes, measured (:func:`autopart.profiler.context_attention.
            measure_context_attention`; ``LayoutOptions.cp_attention_factors``), in place of
            the block count; None (default): the block count.

    Raises:
        ValueError: another ``attention``.
    """
    if attention not in ("all_gather", "ulysses"):
        raise ValueError(f"attention={attention!r}: expected 'all_gather' or 'ulysses'")
    if cp == 1:
        return costs
    scatter_us = all_reduce_us if reduce_scatter_as_all_reduce else reduce_scatter_us
    nodes = list(costs.nodes)
    by_name = {nd.name: nd for nd in costs.nodes}
    low = list(costs.low_times)
    attn = attention_nodes(costs)
    # per attention node: FLOPs, and time unless measured
    works = {i: _block_work(cp, causal, attention, costs.nodes[i].name in costs.causal_attention)
             for i in attn}
    factors = {i: measured if measured is not None else (w, w) for i, w in works.items()}
    # each collective's fixed cost after one GPU's work between two of them (its forward and
    # backward over the collectives of one forward and backward), as tp's are priced
    count = (8 if attention == "ulysses" else 4) * len(attn)

    def fixed(times: list[tuple[float, float, float]]) -> float:
        if collective_overhead is None or not count:
            return 0.0
        total = sum(map(sum, times)) + sum((factors[i][0] - 1) * times[i][0]
                                            + (factors[i][1] - 1) * times[i][1] for i in attn)
        return collective_overhead(total / count)

    overhead = fixed([(nd.fwd_us, nd.bwd_input_us, nd.bwd_weight_us) for nd in nodes])
    low_overhead = fixed(low) if low else overhead
    for i in attn:
        nd = nodes[i]
        fwd_work, bwd_work = factors[i]
        # the key and value heads the runtime moves: before grouped-query attention's repeat
        # where it reads it (all-gather: always; Ulysses: where cp divides them)
        shown = [by_name[n].output_bytes if n in by_name else 0 for n in nd.inputs[:3]]
        moved = list(shown)
        for j in (1, 2):
            found = repeated_heads(by_name, nd.inputs[j]) if j < len(nd.inputs) else None
            if found is not None and (attention == "all_gather" or (
                    heads is not None and heads % found[1] == 0
                    and (heads // found[1]) % cp == 0)):
                moved[j] = by_name[found[0]].output_bytes
        if attention == "ulysses":  # q, k, v there and the output back; the reverse after
            gather = scatter = sum(all_to_all_us(b, cp, bandwidth_bytes_per_s, latency_us)
                                   for b in (*moved, nd.output_bytes))
            calls = 4
            # the kernel saves exchanged queries, keys, values and output of the bytes of the
            # rank's own: nothing held beyond the node's; the backward's exchange buffers: each
            # gradient of the output and of the three inputs made contiguous, received (the
            # all-to-all) and reordered (index_select's backward)
            held, transient = 0, 3 * (sum(moved) + nd.output_bytes)
        else:
            kv = [b * cp for b in moved[1:3]]
            gather = sum(all_gather_us(b, cp, bandwidth_bytes_per_s, latency_us) for b in kv)
            scatter = sum(scatter_us(b, cp, bandwidth_bytes_per_s, latency_us) for b in kv)
            calls = 2
            # the other ranks' keys and values as attention takes them (repeated), saved by
            # the kernel beside the rank's own; in the backward their whole sequence's
            # gradients before the reduce-scatter
            held = (cp - 1) * sum(shown[1:3])
            transient = cp * sum(shown[1:3])
        nodes[i] = replace(nd, fwd_us=nd.fwd_us * fwd_work + gather + calls * overhead,
                           bwd_input_us=nd.bwd_input_us * bwd_work + scatter + calls * overhead,
                           flops=int(nd.flops * works[i]), saved_bytes=nd.saved_bytes + held,
                           transient_bytes=nd.transient_bytes + transient)
        if low:
            f, b, w = low[i]
            low[i] = (f * fwd_work + gather + calls * low_overhead,
                      b * bwd_work + scatter + calls * low_overhead, w)
    return replace(costs, nodes=tuple(nodes), low_times=tuple(low))
