"""One tp GPU's share of a CostGraph: times, activations and parameters split by tp, and the
collectives the runtime runs for them priced where it runs them (the pairs themselves:
:mod:`autopart.solver.tensor_parallel`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from autopart.core.costgraph import CostGraph, NodeCost
from autopart.core.errors import PlanError
from autopart.solver.collectives import all_gather_us, all_reduce_us, reduce_scatter_us
from autopart.solver.tensor_parallel import (
    TensorParallelSplit,
    all_reduced_nodes,
    find_tensor_parallel,
    inside_pairs,
    sequence_parallel_nodes,
    vocab_heads,
)

__all__ = ["shard_costs"]


def _needs_grad(costs: CostGraph) -> list[bool]:
    """Per node, whether its output needs a gradient (it depends on a trainable parameter;
    the graph's inputs need none)."""
    index = {nd.name: i for i, nd in enumerate(costs.nodes)}
    out: list[bool] = []
    for nd in costs.nodes:
        out.append(any(p in costs.trainable for p in nd.params)
                   or any(x in index and out[index[x]] for x in nd.inputs))
    return out


def _copy_all_reduces(costs: CostGraph, split: TensorParallelSplit) -> dict[int, list[int]]:
    """Node position -> positions of the values all-reduced in its input-gradient backward:
    Megatron's "f" (``autopart::tp_copy``), once per distinct replicated value that enters
    split work and needs a gradient: the inputs of the column nodes (q/k/v share one, as do
    Llama's gate/up), of a vocab-parallel head, and the floating operands from outside a
    pair that the nodes between read (rotary tables). Charged to the first node reading it."""
    nodes = costs.nodes
    index = {nd.name: i for i, nd in enumerate(nodes)}
    grad = _needs_grad(costs)
    cols = {c for cs, _ in split.pairs for c in cs}
    heads = vocab_heads(costs, split)
    inside = cols | split.between
    readers: dict[int, int] = {}
    for i in sorted(cols | heads | split.between):
        for x in nodes[i].inputs:
            j = index.get(x)
            if j is None or j in inside or not grad[j]:
                continue  # a graph input (no gradient), or a split value of the pair
            readers.setdefault(j, i)
    out: dict[int, list[int]] = {}
    for j, i in readers.items():
        out.setdefault(i, []).append(j)
    return out


def _split_time(t: float, tp: int, overhead_us: float) -> float:
    """A roofline time ``overhead + max(flops / F, bytes / B)`` with its FLOPs and bytes
    divided by tp: the overhead stays, the rest divides."""
    return t if t <= overhead_us else overhead_us + (t - overhead_us) / tp


def _gather_working_set(nd: NodeCost, tp: int) -> int:
    """A vocab-parallel head's working set beside its (whole, gathered) logits, bytes, as
    ``autopart::tp_gather`` runs (``codegen/_tp_ops.py``): forward, this GPU's slice of the
    logits (``V / tp``) and the all-gather's parts (``V``) until the concatenation returns;
    backward, the gradients (``transient_bytes``: the whole logits' and the input's) and
    the contiguous copy of this GPU's slice of the logits' gradient (``V / tp``). The
    larger is charged as the node's working set (``transient_bytes``, which
    :meth:`autopart.solver._memory_model.MemoryModel.transient_bytes` reads)."""
    part = -(-nd.output_bytes // tp)
    return max(nd.transient_bytes + part, nd.output_bytes + part)


def _sequence_parallel_ops(costs: CostGraph, split: TensorParallelSplit, tp: int,
                           sp: frozenset[int],
                           tokens: frozenset[int], f_sources: dict[int, list[int]],
                           fwd_ops: list[list[tuple[str, float]]],
                           bwd_ops: list[list[tuple[str, float]]]) -> None:
    """Sequence parallelism's other collectives, as ``codegen/sequence_parallel.py`` inserts
    them (added to ``fwd_ops`` / ``bwd_ops`` in place): a token-wise node's replicated
    parameters (a norm's weight, a bias) through "f" (their gradient all-reduced in the
    backward, once per parameter); a whole value it reads that needs a gradient (a position
    embedding, the residual stream from before the first reduce-scatter) sliced to the
    tokens (its gradient all-gathered); a token-split value read by other work than tp's
    own (BERT's prediction-head transform) gathered whole (an all-gather forward, a copy of
    the tokens' gradient backward). Not priced: the gather of a token-split stage output and
    the slicing of the next stage's input (the cuts are not known here)."""
    nodes = costs.nodes
    index = {nd.name: i for i, nd in enumerate(nodes)}
    grad = _needs_grad(costs)
    f_values = {j for sources in f_sources.values() for j in sources}
    seen_params: set[str] = set()
    seen_whole: set[int] = set()
    seen_gather: set[int] = set()
    for i in sorted(sp):
        nd = nodes[i]
        own = [p for p in nd.params if p in costs.trainable and p not in split.params
               and p not in seen_params]
        seen_params.update(own)
        if own:
            nb = sum(costs.param_sizes.get(p, 0) for p in own)
            fwd_ops[i].append(("copy", nb))
            bwd_ops[i].append(("ar", nb))
        for x in nd.inputs:
            j = index.get(x)
            if j is None or j in tokens or j in seen_whole or not grad[j]:
                continue
            seen_whole.add(j)
            bwd_ops[i].append(("ag", nodes[j].output_bytes))
    for i, nd in enumerate(nodes):
        if i in sp or i in split.sharded_nodes:
            continue
        for x in nd.inputs:
            j = index.get(x)
            if j is None or j not in tokens or j in f_values or j in seen_gather:
                continue
            seen_gather.add(j)
            fwd_ops[i].append(("sag", nodes[j].output_bytes))
            bwd_ops[i].append(("copy", nodes[j].output_bytes / tp))


def shard_costs(costs: CostGraph, tp: int, *, bandwidth_bytes_per_s: float, latency_us: float,
                op_overhead_us: float, split: TensorParallelSplit | None = None,
                collective_overhead: Callable[[float], float] | None = None,
                copy_bytes_per_s: float = 0.0, sequence_parallel: bool = False,
                reduce_scatter_as_all_reduce: bool = False) -> CostGraph:
    """One tp GPU's share of ``costs``: the cost graph each GPU of a tp group runs.

    Split nodes (:attr:`TensorParallelSplit.sharded_nodes`): FLOPs, bytes accessed and the
    roofline part of each time (above ``op_overhead_us``) divided by tp; the outputs of column
    and between nodes, and the saved activations and backward working sets of between and
    row nodes, divided by tp (a column node saves its input, which is replicated: kept; a
    vocab-parallel head's output is the gathered, whole logits, and its backward starts from
    their whole gradient: both kept; training, its working set gains the gather's buffers,
    :func:`_gather_working_set`). The loss's saved
    bytes (``loss_saved_bytes``, on the last node) are never divided: every tp GPU runs the
    user's loss on the whole logits. Split parameters (column: every parameter of a column
    node; row: the weight only, its bias stays replicated; vocab: the weight) hold
    ``ceil(bytes / tp)``.

    Collectives are priced as the runtime (``autopart/codegen/tensor_parallel.py``) runs
    them, as ring collectives (:mod:`autopart.solver.collectives`), added as time on the
    nodes that wait for them. Forward: each row node all-reduces its output (tokens x h); a
    vocab-parallel embedding all-reduces its output (tokens x h); a vocab-parallel head
    all-gathers its logits (tokens x V). Backward (input gradient): one all-reduce per
    distinct replicated value entering split work that needs a gradient (Megatron's "f":
    the column nodes' input, shared by q/k/v or by gate/up; a vocab-parallel head's input;
    a floating operand from outside a pair that its nodes between read, such as a learned
    table), charged to the first node reading it. Each collective also pays
    ``collective_overhead(work)``, its fixed cost beyond the ring's steps
    (``RuntimeDescription.collective_overhead_at``), where ``work`` is one GPU's split
    forward and backward time per collective (the graph's time after splitting over the
    collectives of one forward and backward). A second profiled batch's times
    (``low_times``) are split the same way and get the same collectives, their bytes scaled
    to that batch and their fixed cost at that batch's work, so that the line between the
    two batches keeps each collective's fixed cost fixed. The tp ops' own copies are charged
    at ``copy_bytes_per_s`` where given. The loss's own time, folded into
    the last node's times by the profiler, is divided with a split last node (the cost
    graph does not keep it apart).
    tp = 1 returns ``costs`` itself.

    Args:
        costs: the whole model's costs.
        tp: tensor-parallel degree.
        bandwidth_bytes_per_s: the tp group's link (bus bandwidth), bytes/s.
        latency_us: one ring step, µs.
        op_overhead_us: the fixed part of each op's time that splitting does not shrink, µs
            (``DeviceSpec.op_overhead_us`` for analytical profiles).
        split: the split to apply (default: :func:`find_tensor_parallel`).
        collective_overhead: µs one collective costs beyond its ring steps after a GPU has
            computed the given µs since the previous one (default: nothing).
        copy_bytes_per_s: the rate of the tp ops' own copies, bytes/s (default 0.0: not
            charged; ``RuntimeDescription.copy_bytes_per_s``): each all-reduce clones its
            tensor, Megatron's "f" clones its input in forward, and the head's gather
            concatenates the whole logits and, in backward, copies out this GPU's slice of
            their gradient (``autopart/codegen/_tp_ops.py``).
        sequence_parallel: price Megatron's sequence parallelism as
            ``autopart/codegen/sequence_parallel.py`` runs it (default False).
        reduce_scatter_as_all_reduce: the runtime's reduce-scatter costs an all-reduce
            (``RuntimeDescription.reduce_scatter_as_all_reduce``: gloo; default False).

    Raises:
        PlanError: tp < 1.
    """
    if tp < 1:
        raise PlanError(f"tp={tp} must be >= 1")
    if tp == 1:
        return costs
    split = split if split is not None else find_tensor_parallel(costs)
    nodes = list(costs.nodes)
    cols = {c for cs, _ in split.pairs for c in cs}
    rows = {r for _, r in split.pairs}
    sizes = dict(costs.param_sizes)
    numel = dict(costs.param_numel)
    for p in split.params:
        sizes[p] = math.ceil(sizes[p] / tp)
        numel[p] = math.ceil(numel[p] / tp)
    first: dict[str, int] = {}
    for i, nd in enumerate(nodes):
        for p in nd.params:
            first.setdefault(p, i)
    shrink = [0] * len(nodes)
    for p in split.params:
        shrink[first[p]] += costs.param_sizes[p] - sizes[p]

    f_sources = _copy_all_reduces(costs, split)
    heads = vocab_heads(costs, split)
    fwd_reduce = all_reduced_nodes(costs, split)
    sp = sequence_parallel_nodes(costs, split) if sequence_parallel else frozenset()
    tokens = sp | (fwd_reduce if sequence_parallel else frozenset())  # token-split values
    divided = split.sharded_nodes | sp

    # the collectives (and the tp ops' copies) each node waits for: (what, bytes)
    fwd_ops: list[list[tuple[str, float]]] = [[] for _ in nodes]
    bwd_ops: list[list[tuple[str, float]]] = [[] for _ in nodes]
    for i in fwd_reduce:
        if sequence_parallel:  # reduce-scatter over the tokens; backward all-gathers
            fwd_ops[i].append(("rs", nodes[i].output_bytes))
            bwd_ops[i].append(("ag", nodes[i].output_bytes))
        else:
            fwd_ops[i].append(("ar", nodes[i].output_bytes))
    for i in heads & split.sharded_nodes:
        # every GPU gathers the whole logits (its output stays whole) for the loss; its
        # backward copies out this GPU's slice of their gradient
        fwd_ops[i].append(("ag", nodes[i].output_bytes))
        bwd_ops[i].append(("copy", nodes[i].output_bytes / tp))
    for i, sources in f_sources.items():
        # "f": a clone forward, an all-reduce backward (one per reading node, as priced since
        # tp landed); of a token-split value: an all-gather forward, a reduce-scatter back
        whole = sum(nodes[j].output_bytes for j in sources if j not in tokens)
        if whole:
            fwd_ops[i].append(("copy", whole))
            bwd_ops[i].append(("ar", whole))
        for j in sources:
            if j in tokens:
                fwd_ops[i].append(("sag", nodes[j].output_bytes))
                bwd_ops[i].append(("rs", nodes[j].output_bytes))
    if sequence_parallel:
        _sequence_parallel_ops(costs, split, tp, sp, tokens, f_sources, fwd_ops, bwd_ops)
    # sequence parallelism's buffers beside a node's own (codegen/_tp_ops.py): a
    # reduce-scatter holds the whole partial sums, their packed copy and this GPU's tokens;
    # an all-gather the gathered parts and their reordered copy
    training = any(nd.transient_bytes for nd in nodes)
    working = [0] * len(nodes)
    for i, ops in enumerate(fwd_ops):
        whole = ([nb for what, nb in ops + bwd_ops[i] if what in ("rs", "ag", "sag")]
                 if tokens else [])
        if whole:
            working[i] = 2 * max(whole) + max(whole) // tp

    def split_times(i: int, trip: tuple[float, float, float]) -> tuple[float, float, float]:
        if i not in divided:
            return trip
        return (_split_time(trip[0], tp, op_overhead_us), _split_time(trip[1], tp, op_overhead_us),
                _split_time(trip[2], tp, op_overhead_us))

    times = [split_times(i, (nd.fwd_us, nd.bwd_input_us, nd.bwd_weight_us))
             for i, nd in enumerate(nodes)]
    low_times = tuple(split_times(i, trip) for i, trip in enumerate(costs.low_times))
    # one GPU's work between two collectives, at the profiled batch and at the low one
    count = sum(1 for ops in fwd_ops + bwd_ops for what, _ in ops if what != "copy")
    work = sum(map(sum, times)) / max(count, 1)
    low_work = sum(map(sum, low_times)) / max(count, 1)
    fixed = collective_overhead(work) if collective_overhead else 0.0
    low_fixed = collective_overhead(low_work) if collective_overhead else 0.0
    low_ratio = costs.low_batch_size / costs.batch_size
    rings = {"ar": all_reduce_us, "ag": all_gather_us, "sag": all_gather_us,
             "rs": all_reduce_us if reduce_scatter_as_all_reduce else reduce_scatter_us}

    def price(ops: list[tuple[str, float]], low: bool = False) -> float:
        """µs of ``ops``; each collective also clones (all-reduce), packs (reduce-scatter)
        or concatenates (all-gather) its tensor: a copy of its bytes."""
        ratio, extra = (low_ratio, low_fixed) if low else (1.0, fixed)
        total = 0.0
        for what, nbytes in ops:
            nb = nbytes * ratio
            copied = nb / copy_bytes_per_s * 1e6 if copy_bytes_per_s > 0 else 0.0
            if what != "copy":
                total += rings[what](nb, tp, bandwidth_bytes_per_s, latency_us) + extra
            total += copied
        return total

    out: list[NodeCost] = []
    low_out = list(low_times)
    for i, nd in enumerate(nodes):
        changes: dict[str, Any] = {"param_bytes": nd.param_bytes - shrink[i]}
        if i in divided:
            fwd, bwd_in, bwd_w = times[i]
            changes.update(fwd_us=fwd, bwd_input_us=bwd_in, bwd_weight_us=bwd_w,
                           flops=nd.flops // tp, bytes_accessed=nd.bytes_accessed // tp)
            if i not in heads:  # a head's backward starts from the whole logits' gradient
                changes["backward_peak_bytes"] = nd.backward_peak_bytes // tp
            if i in cols or i in split.between or i in tokens:
                changes.update(output_bytes=nd.output_bytes // tp,
                               strided_output_bytes=nd.strided_output_bytes // tp)
            if i in split.between or i in rows or i in sp:
                # the loss (on the last node) runs whole on every tp GPU: its saved set stays
                loss = costs.loss_saved_bytes if i == len(nodes) - 1 else 0
                changes.update(saved_bytes=(nd.saved_bytes - loss) // tp + loss,
                               transient_bytes=nd.transient_bytes // tp)
                if nd.saved_from is not None:
                    changes["saved_from"] = tuple((d, b // tp) for d, b in nd.saved_from)
            if i in heads and costs.nodes[i].transient_bytes:  # training
                changes["transient_bytes"] = _gather_working_set(nd, tp)
        if working[i] and training:
            changes["transient_bytes"] = max(changes.get("transient_bytes", nd.transient_bytes),
                                             working[i])
        if fwd_ops[i] or bwd_ops[i]:
            fwd, bwd_in = changes.get("fwd_us", nd.fwd_us), changes.get("bwd_input_us",
                                                                         nd.bwd_input_us)
            low_fwd = low_bwd = 0.0
            for op in fwd_ops[i]:  # one at a time: the same sums as before sequence parallelism
                fwd, low_fwd = fwd + price([op]), low_fwd + price([op], True)
            for op in bwd_ops[i]:
                bwd_in, low_bwd = bwd_in + price([op]), low_bwd + price([op], True)
            changes.update(fwd_us=fwd, bwd_input_us=bwd_in)
            if low_out:
                f, b_in, b_w = low_out[i]
                low_out[i] = (f + low_fwd, b_in + low_bwd, b_w)
        out.append(replace(nd, **changes))
    low_times = tuple(low_out)
    # what each node's forward collectives return (an all-reduce and an all-gather the whole
    # value, a reduce-scatter its 1/tp share), kept by the selective recompute policy; a
    # reduce-scatter's node lists its output at 1/tp although the matmul's partial sum
    # before it is whole: the rest of that is counted here
    collective_outputs = tuple((i, kept) for i, ops in enumerate(fwd_ops) if (kept := sum(
        int(nb) for what, nb in ops if what in ("ar", "ag", "rs"))))
    # sequence parallelism's all-gathers of token-split values ("sag": Megatron's "f" before
    # a column matmul, and the whole value back before other ops) are not kept: a stage
    # recomputing under "selective" or "op" gathers them again in its backward, as
    # Megatron-LM's sequence-parallel linear keeps its input split and re-gathers it
    recomputed_gathers = tuple(
        (i, sum(price([op]) for op in sags), sum(price([op], True) for op in sags)
         if low_out else 0.0)
        for i, ops in enumerate(fwd_ops) if (sags := [op for op in ops if op[0] == "sag"]))
    return replace(costs, nodes=tuple(out), param_sizes=sizes, param_numel=numel,
                   low_times=low_times, collective_outputs=collective_outputs,
                   recomputed_gathers=recomputed_gathers,
                   source=f"{costs.source}+tp{tp}", no_cut=costs.no_cut | inside_pairs(split))
