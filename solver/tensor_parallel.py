"""Tensor parallelism on a CostGraph: column/row-parallel pairs found in the graph, costs split by tp.

The rule (Megatron-LM, Shoeybi et al. 2019, section 3; ``core/tensor_parallel/layers.py``):
a matmul node that reads a trainable weight (a *weight matmul*) ``M`` whose inputs, followed
back through nodes of ``M``'s enclosing module (``M.module_path`` minus its last part) that
read no parameter, reach other weight matmuls ``C1..Ck`` of that module, forms a pair:
``C1..Ck`` are column-parallel (their weights split by output feature), the nodes between
(attention, activations, views) run on ``1/tp`` of the features, and ``M`` is row-parallel
(weight split by input feature) with one all-reduce of its output in forward and one of
``C``'s input gradient in backward. Values from outside the module that the nodes between
read (masks, rotary tables) are broadcast operands, replicated. Nothing between may be read
from outside the pair. Attention's q/k/v -> output projection and the MLP's up/gate -> down
are such pairs; where they sit in sibling modules (BERT), the module above is searched. The
embedding and the head that share the token-embedding weight (or a head whose output
reaches the graph's outputs with no weight matmul after it) are vocab-parallel (Megatron's
``VocabParallelEmbedding``): the embedding all-reduces its output; the head computes its
share of the logits and all-gathers them, so the user's loss runs on the whole logits on
every GPU (not Megatron's parallel cross-entropy).
Every other node (layer norms, residual adds, position embeddings) is replicated: each of the
tp GPUs runs it whole and holds its parameters whole.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from autopart.core.costgraph import CostGraph, NodeCost
from autopart.core.errors import PlanError
from autopart.solver.collectives import all_gather_us, all_reduce_us, reduce_scatter_us

__all__ = ["TensorParallelSplit", "SHARD_STYLES", "find_tensor_parallel", "inside_pairs",
           "sequence_parallel_nodes", "shard_costs"]

#: How a parameter is split over tp: by output feature, by input feature, or by vocabulary row.
SHARD_STYLES = ("column", "row", "vocab")

_MATMUL_OPS = frozenset({
    "aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.baddbmm.default",
    "aten.linear.default", "aten.matmul.default", "aten.einsum.default"})
_EMBEDDING_OPS = frozenset({"aten.embedding.default"})
_RESIDUAL_OPS = frozenset({"aten.add.Tensor", "aten.sub.Tensor"})
#: Ops that sequence parallelism runs on 1/tp of the tokens when they read a token-split
#: tensor: what ``autopart/codegen/sequence_parallel.py`` splits (pointwise ops, norms over
#: the features, dropouts, casts, views, reductions over the features).
_TOKEN_WISE_OPS = frozenset(
    {f"aten.{op}.{v}" for op in ("add", "sub", "mul", "div") for v in ("Tensor", "Scalar")}
    | {f"aten.{op}.default" for op in (
        "rsqrt", "sqrt", "neg", "gelu", "silu", "tanh", "sigmoid", "relu", "erf", "exp",
        "layer_norm", "native_layer_norm", "dropout", "native_dropout", "clone",
        "contiguous", "alias", "detach", "_to_copy", "reshape", "view", "_unsafe_view")}
    | {"aten.pow.Tensor_Scalar", "aten.mean.dim", "aten.sum.dim_IntList"})


@dataclass(frozen=True, slots=True)
class TensorParallelSplit:
    """Which nodes and parameters tensor parallelism splits (positions index ``costs.nodes``).

    Attributes:
        pairs: per column/row pair, ``(column nodes, row node)``.
        between: nodes between a pair's column and row nodes (split by features).
        vocab: the vocab-parallel embedding and head nodes.
        params: parameter FQN -> style (:data:`SHARD_STYLES`); absent = replicated.
    """

    pairs: tuple[tuple[tuple[int, ...], int], ...]
    between: frozenset[int]
    vocab: frozenset[int]
    params: dict[str, str]

    @property
    def sharded_nodes(self) -> frozenset[int]:
        """Every node whose work is divided by tp."""
        cols = {c for cs, _ in self.pairs for c in cs}
        return frozenset(cols | {r for _, r in self.pairs} | self.between | self.vocab)


def _users(costs: CostGraph) -> tuple[dict[str, int], list[list[int]]]:
    """Node name -> position, and per node the positions of the nodes reading it."""
    index = {nd.name: i for i, nd in enumerate(costs.nodes)}
    users: list[list[int]] = [[] for _ in costs.nodes]
    for i, nd in enumerate(costs.nodes):
        for inp in nd.inputs:
            if inp in index:
                users[index[inp]].append(i)
    return index, users


def _parent(path: str) -> str:
    return path.rsplit(".", 1)[0] if "." in path else ""


def _inside(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent + ".")


def _weight(costs: CostGraph, nd: NodeCost) -> str | None:
    """The trainable parameter with the most elements a node reads (its weight), if any."""
    own = [p for p in nd.params if p in costs.trainable]
    return max(own, key=lambda p: (costs.param_numel[p], p)) if own else None


def _walk(costs: CostGraph, index: dict[str, int], weight_mm: set[int], r: int, scope: str,
          sibling: bool) -> tuple[set[int], set[int]] | None:
    """Follow row candidate ``r``'s inputs back through parameter-free nodes of module
    ``scope``: ``(column nodes, nodes between)``, or None when a node between reads a
    parameter or, for ``sibling`` scopes, adds a value from outside as large as its own
    output (a residual add: the pair would mix split and whole features)."""
    nodes = costs.nodes
    cols: set[int] = set()
    inner: set[int] = set()
    stack = [index[x] for x in nodes[r].inputs if x in index]
    seen: set[int] = set()
    while stack:
        j = stack.pop()
        nd = nodes[j]
        if not _inside(nd.module_path, scope):
            continue  # a broadcast operand from outside the module (masks, rotary tables)
        if j in seen:
            continue
        seen.add(j)
        if j in weight_mm:
            cols.add(j)
            continue
        if nd.params:
            return None
        if sibling and nd.op in _RESIDUAL_OPS and any(
                _outside_bytes(costs, index, x, scope) >= nd.output_bytes for x in nd.inputs):
            return None
        inner.add(j)
        stack.extend(index[x] for x in nd.inputs if x in index)
    return cols, inner


def _outside_bytes(costs: CostGraph, index: dict[str, int], name: str, scope: str) -> int:
    """Bytes of value ``name`` when it comes from outside module ``scope`` (a graph input or
    a node of another module), else -1."""
    if name not in index:
        return costs.graph_inputs.get(name, -1)
    nd = costs.nodes[index[name]]
    return -1 if _inside(nd.module_path, scope) else nd.output_bytes


def find_tensor_parallel(costs: CostGraph) -> TensorParallelSplit:
    """Find the column/row-parallel pairs and vocab-parallel nodes of ``costs`` (module rule).

    A weight matmul ``M`` is first paired inside its enclosing module; when nothing there
    reaches a weight matmul (and no parameter is in the way), inside the module above it:
    sibling modules such as BERT's ``attention.self`` (q/k/v) and ``attention.output``
    (dense), or ``intermediate.dense`` and ``output.dense``. A sibling pair may not cross a
    residual add (an add of a value from outside as large as its output) nor a layer norm
    (it reads a parameter).

    Returns:
        The split; empty when the graph has no such pair (tp then only divides the vocab
        nodes, if any).
    """
    nodes = costs.nodes
    index, users = _users(costs)
    weight_mm = {i for i, nd in enumerate(nodes)
                 if nd.op in _MATMUL_OPS and _weight(costs, nd) is not None}
    pairs: list[tuple[tuple[int, ...], int]] = []
    between: set[int] = set()
    used: set[int] = set()
    for r in sorted(weight_mm):
        parent = _parent(nodes[r].module_path)
        if not parent or r in used:
            continue
        found = _walk(costs, index, weight_mm, r, parent, sibling=False)
        if found is not None and not found[0] and _parent(parent):
            found = _walk(costs, index, weight_mm, r, _parent(parent), sibling=True)
        if found is None:
            continue
        cols, inner = found
        region = cols | inner | {r}
        if not cols or cols & used:
            continue
        # the columns' and the between nodes' outputs are split: nobody outside may read them
        if any(u not in region for j in cols | inner for u in users[j]):
            continue
        if any(name in costs.graph_outputs for name in (nodes[j].name for j in cols | inner)):
            continue
        pairs.append((tuple(sorted(cols)), r))
        between |= inner
        used |= region
    params: dict[str, str] = {}
    for cols_, r in pairs:
        for c in cols_:
            for p in nodes[c].params:
                if p in costs.trainable:
                    params[p] = "column"
        w = _weight(costs, nodes[r])
        assert w is not None
        params[w] = "row"
    vocab = _vocab_nodes(costs, weight_mm - used, params)
    for i in vocab:
        w = _weight(costs, nodes[i])
        if w is not None:
            params[w] = "vocab"
    return TensorParallelSplit(tuple(pairs), frozenset(between), frozenset(vocab), params)


def _vocab_nodes(costs: CostGraph, free_mm: set[int], taken: dict[str, str]) -> set[int]:
    """Embeddings whose weight a free weight matmul also reads (tied), and a free weight
    matmul that is the last weight matmul before the graph's outputs, with its embedding."""
    nodes = costs.nodes
    out: set[int] = set()
    emb = {i: _weight(costs, nd) for i, nd in enumerate(nodes) if nd.op in _EMBEDDING_OPS}
    last = max(free_mm) if free_mm else None
    for i in sorted(free_mm):
        w = _weight(costs, nodes[i])
        tied = [e for e, ew in emb.items() if ew == w]
        if w in taken:
            continue
        if tied or i == last and i >= max(_weight_positions(costs)):
            out.add(i)
            out.update(tied)
    return out


def _weight_positions(costs: CostGraph) -> list[int]:
    return [i for i, nd in enumerate(costs.nodes)
            if nd.op in _MATMUL_OPS and _weight(costs, nd) is not None] or [0]


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
    heads = {i for i in split.vocab if nodes[i].op not in _EMBEDDING_OPS}
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


def inside_pairs(split: TensorParallelSplit) -> frozenset[int]:
    """Cut positions inside a column/row pair (from after its first column node up to its
    row node): a stage boundary there would send a tensor that only exists sharded, which the
    runtime's tensor-parallel pass refuses (``codegen.shard_stage``)."""
    return frozenset(k for cols, row in split.pairs for k in range(min(cols) + 1, row + 1))


def sequence_parallel_nodes(costs: CostGraph, split: TensorParallelSplit) -> frozenset[int]:
    """The nodes sequence parallelism runs on 1/tp of the tokens (positions in
    ``costs.nodes``): from each all-reduced node (row nodes, vocab-parallel embeddings),
    every replicated token-wise op (:data:`_TOKEN_WISE_OPS`) reached through token-wise ops.
    The codegen pass also checks the operands' shapes and falls back to whole work where they
    do not fit; this reading of the graph assumes they do."""
    nodes = costs.nodes
    index, users = _users(costs)
    sharded = split.sharded_nodes
    rows = {r for _, r in split.pairs}
    todo = [i for i in sharded
            if i in rows or (i in split.vocab and nodes[i].op in _EMBEDDING_OPS)]
    out: set[int] = set()
    while todo:
        i = todo.pop()
        for u in users[i]:
            if u not in out and u not in sharded and nodes[u].op in _TOKEN_WISE_OPS:
                out.add(u)
                todo.append(u)
    return frozenset(out)


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
    readers_of_f = {j for sources in f_sources.values() for j in sources}
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
            if j is None or j not in tokens or j in readers_of_f or j in seen_gather:
                continue
            seen_gather.add(j)
            fwd_ops[i].append(("ag", nodes[j].output_bytes))
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
    heads = {i for i in split.vocab if nodes[i].op not in _EMBEDDING_OPS}
    fwd_reduce = {i for i in split.sharded_nodes
                  if i in rows or (i in split.vocab and nodes[i].op in _EMBEDDING_OPS)}
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
                fwd_ops[i].append(("ag", nodes[j].output_bytes))
                bwd_ops[i].append(("rs", nodes[j].output_bytes))
    if sequence_parallel:
        _sequence_parallel_ops(costs, split, tp, sp, tokens, f_sources, fwd_ops, bwd_ops)
    # sequence parallelism's buffers beside a node's own (codegen/_tp_ops.py): a
    # reduce-scatter holds the whole partial sums, their packed copy and this GPU's tokens;
    # an all-gather the gathered parts and their reordered copy
    training = any(nd.transient_bytes for nd in nodes)
    working = [0] * len(nodes)
    for i, ops in enumerate(fwd_ops):
        whole = [nb for what, nb in ops + bwd_ops[i] if what in ("rs", "ag")] if tokens else []
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
    rings = {"ar": all_reduce_us, "ag": all_gather_us,
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
    return replace(costs, nodes=tuple(out), param_sizes=sizes, param_numel=numel,
                   low_times=low_times,
                   source=f"{costs.source}+tp{tp}", no_cut=costs.no_cut | inside_pairs(split))
