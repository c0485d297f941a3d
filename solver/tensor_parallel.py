"""Tensor parallelism on a CostGraph: the column/row-parallel pairs found in the graph.

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
tp GPUs runs it whole and holds its parameters whole, but with sequence parallelism the
token-wise ones after an all-reduced node (:func:`sequence_parallel_nodes`). One GPU's share
of the costs: :mod:`autopart.solver.tensor_parallel_costs`.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopart.core.costgraph import CostGraph, NodeCost

__all__ = ["TensorParallelSplit", "SHARD_STYLES", "all_reduced_nodes", "find_tensor_parallel",
           "inside_pairs", "sequence_parallel_nodes", "vocab_heads"]

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


def inside_pairs(split: TensorParallelSplit) -> frozenset[int]:
    """Cut positions inside a column/row pair (from after its first column node up to its
    row node): a stage boundary there would send a tensor that only exists sharded, which the
    runtime's tensor-parallel pass refuses (``codegen.shard_stage``)."""
    return frozenset(k for cols, row in split.pairs for k in range(min(cols) + 1, row + 1))


def all_reduced_nodes(costs: CostGraph, split: TensorParallelSplit) -> frozenset[int]:
    """The nodes whose output tp all-reduces (Megatron's "g"): the row nodes and the
    vocab-parallel embeddings (positions in ``costs.nodes``)."""
    return frozenset({r for _, r in split.pairs}
                     | {i for i in split.vocab if costs.nodes[i].op in _EMBEDDING_OPS})


def vocab_heads(costs: CostGraph, split: TensorParallelSplit) -> frozenset[int]:
    """The vocab-parallel heads (a ``linear`` of the vocabulary's weight), whose logits tp
    all-gathers (positions in ``costs.nodes``)."""
    return frozenset(i for i in split.vocab if costs.nodes[i].op not in _EMBEDDING_OPS)


def sequence_parallel_nodes(costs: CostGraph, split: TensorParallelSplit) -> frozenset[int]:
    """The nodes sequence parallelism runs on 1/tp of the tokens (positions in
    ``costs.nodes``): from each all-reduced node (row nodes, vocab-parallel embeddings),
    every replicated token-wise op (:data:`_TOKEN_WISE_OPS`) reached through token-wise ops.
    The codegen pass also checks the operands' shapes and falls back to whole work where they
    do not fit; this reading of the graph assumes they do."""
    nodes = costs.nodes
    _, users = _users(costs)
    sharded = split.sharded_nodes
    todo = list(all_reduced_nodes(costs, split))
    out: set[int] = set()
    while todo:
        i = todo.pop()
        for u in users[i]:
            if u not in out and u not in sharded and nodes[u].op in _TOKEN_WISE_OPS:
                out.add(u)
                todo.append(u)
    return frozenset(out)
