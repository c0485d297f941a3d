"""Megatron's sequence parallelism in a tp stage: the token-wise work between tp pairs split by token.

:func:`sequence_parallel` rewrites a stage that :func:`autopart.codegen.tensor_parallel.
shard_stage` already split over tp (Korthikanti et al., 2022, "Reducing Activation
Recomputation in Large Transformer Models", section 4.2.2; Megatron-LM's
``--sequence-parallel``):

- each all-reduce after a row-parallel matmul or a vocab-parallel embedding
  (``autopart::tp_reduce``) becomes a reduce-scatter (``autopart::tp_reduce_scatter``) that
  leaves each tp rank the sum for 1/tp of the tokens;
- the token-wise ops reading such a tensor (layer norms, RMS norms, dropouts, residual adds,
  bias adds, casts, views) run on the rank's tokens only: their activations, and what
  autograd saves of them, are divided by tp. A whole operand with the token dimension (a
  stage's input on the residual path, a position embedding) is sliced to the rank's tokens
  (``autopart::tp_seq_scatter``: all-gather of the gradient backward); a whole floating
  operand broadcast over the tokens (a norm's weight, a bias) goes through Megatron's "f"
  (``autopart::tp_copy``), so its gradient sums every rank's tokens;
- Megatron's "f" before a column-parallel matmul (or a vocab-parallel head) of a
  token-split input becomes an all-gather of the tokens whose backward reduce-scatters the
  gradient (``autopart::tp_seq_gather_split``);
- any other op reading a token-split tensor, and the stage's output, get the whole tensor
  back first (``autopart::tp_seq_gather``: all-gather forward, the rank's tokens of the
  gradient backward).

Which dimension holds the tokens: the second of a row output of three or more dimensions
(``[batch, seq, ...]``, as transformers' models lay activations out); for the ``[batch *
seq, h]`` rows of a 2-D matmul (GPT-2's ``Conv1D``), the rows viewed as ``[batch, seq]``,
``batch`` found from the 3-D tensor the matmul's input was viewed from. A reduce whose
tokens tp does not divide, or whose batch cannot be found, stays an all-reduce.

How it differs from Megatron-LM: stage boundaries carry whole activations (the stage's
output is gathered, and the next stage slices its input where token-split work first reads
it), where Megatron sends 1/tp of them; a norm's weight and a bias after a row matmul have
their gradients all-reduced in each microbatch's backward ("f"), where Megatron all-reduces
them once per step; linear layers outside the tp pairs (BERT's prediction-head transform)
run on the whole tokens after a gather.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from autopart.codegen import _tp_ops
from autopart.codegen.tensor_parallel import _copy_meta, _meta
from autopart.codegen.tp_layout import TensorParallelRank

__all__ = ["sequence_parallel"]

aten = torch.ops.aten
_VIEWS = {aten.reshape.default, aten.view.default, aten._unsafe_view.default}
_NORMS = {aten.native_layer_norm.default: 1, aten.layer_norm.default: 1}
_SAME = {aten._to_copy.default, aten.clone.default, aten.contiguous.default,
         aten.alias.default, aten.detach.default, aten.dropout.default,
         aten.native_dropout.default, operator.getitem}
_REDUCTIONS = {aten.mean.dim, aten.sum.dim_IntList, aten.amax.default}


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (list, tuple)):
        return next((v for v in value if isinstance(v, torch.Tensor)), None)
    return None


class _Pass:
    def __init__(self, gm: fx.GraphModule, tp: TensorParallelRank) -> None:
        self.graph, self.tp = gm.graph, tp
        self.tokens: dict[fx.Node, tuple[int, int]] = {}  # token-split node -> (dim, outer)
        self.whole: dict[fx.Node, Any] = {}  # its whole (captured) value
        self.cache: dict[tuple[Any, ...], fx.Node] = {}

    def call(self, target: Any, args: tuple[Any, ...], before: fx.Node, val: Any) -> fx.Node:
        with self.graph.inserting_before(before):
            new = self.graph.call_function(target, args)
        _copy_meta(new, before)
        new.meta["val"] = val
        return new

    def once(self, key: tuple[Any, ...], make: Any) -> fx.Node:
        if key not in self.cache:
            self.cache[key] = make()
        return self.cache[key]

    def gather(self, a: fx.Node, before: fx.Node) -> fx.Node:
        """The whole value of token-split ``a`` for replicated work."""
        d, outer = self.tokens[a]
        tp = self.tp
        return self.once(("gather", a), lambda: self.call(
            torch.ops.autopart.tp_seq_gather.default,
            (a, d, outer, tp.rank, tp.size, tp.group_name), before, _meta(self.whole[a])))

    def mark(self, node: fx.Node, dim: int, outer: int, local: Any) -> None:
        """``node`` now runs on this rank's tokens (split at ``dim`` as ``outer`` rows)."""
        self.whole[node], self.tokens[node] = node.meta["val"], (dim, outer)
        node.meta["val"] = local


def _token_layout(node: fx.Node, size: int) -> tuple[int, int] | None:
    """(dim, outer) of the tokens of an all-reduced row / embedding output, or None."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() < 2:
        return None
    if val.dim() >= 3:
        return (1, 1) if val.shape[1] % size == 0 else None
    rows = int(val.shape[0])
    seen: set[fx.Node] = set()
    todo = list(node.all_input_nodes)
    while todo:  # back through the matmul to the 3-D tensor its rows were viewed from
        a = todo.pop()
        if a in seen:
            continue
        seen.add(a)
        v = a.meta.get("val")
        if isinstance(v, torch.Tensor) and v.dim() >= 3 and int(v.shape[0] * v.shape[1]) == rows:
            b, s = int(v.shape[0]), int(v.shape[1])
            return (0, b) if s % size == 0 else None
        if a.op == "call_function" and len(seen) < 16:
            todo.extend(a.all_input_nodes)
    return None


def sequence_parallel(gm: fx.GraphModule, tp: TensorParallelRank) -> frozenset[str]:
    """Rewrite ``gm`` (a stage :func:`~autopart.codegen.tensor_parallel.shard_stage` split
    over tp) in place with sequence parallelism.

    Args:
        gm: the stage, its ``meta["val"]`` holding this rank's shapes after ``shard_stage``.
        tp: this process's tp rank, degree and group name.

    Returns:
        The names of the nodes that now run on this rank's tokens (the reduce-scatters
        among them); empty when nothing changed (no row-parallel matmul or vocab-parallel
        embedding in the stage, or tokens that tp does not divide).
    """
    if tp.size == 1:
        return frozenset()
    st = _Pass(gm, tp)
    for node in list(st.graph.nodes):
        if node.op == "output":
            for a in node.all_input_nodes:
                if a in st.tokens:
                    node.replace_input_with(a, st.gather(a, node))
            continue
        if node.op != "call_function":
            continue
        if node.target == torch.ops.autopart.tp_reduce.default:
            where = _token_layout(node, tp.size)
            if where is not None:
                _reduce_scatter(st, node, *where)
            continue
        inputs = [a for a in node.all_input_nodes if a in st.tokens]
        if not inputs:
            continue
        if node.target == torch.ops.autopart.tp_copy.default:
            x = node.args[0]
            d, outer = st.tokens[x]  # type: ignore[index]
            new = st.call(torch.ops.autopart.tp_seq_gather_split.default,
                          (x, d, outer, tp.size, tp.group_name), node, node.meta["val"])
            node.replace_all_uses_with(new)
            st.graph.erase_node(node)
            continue
        if not _token_wise(st, node, inputs):
            for a in inputs:
                node.replace_input_with(a, st.gather(a, node))
    st.graph.lint()
    gm.recompile()
    return frozenset(n.name for n in st.tokens)


def _reduce_scatter(st: _Pass, node: fx.Node, dim: int, outer: int) -> None:
    tp = st.tp
    whole = node.meta["val"]
    shape = list(whole.shape)
    shape[dim] //= tp.size
    new = st.call(torch.ops.autopart.tp_reduce_scatter.default,
                  (node.args[0], dim, outer, tp.size, tp.group_name), node,
                  whole.new_empty(shape, device="meta"))
    node.replace_all_uses_with(new)
    st.graph.erase_node(node)
    st.whole[new], st.tokens[new] = whole, (dim, outer)


def _token_wise(st: _Pass, node: fx.Node, inputs: list[fx.Node]) -> bool:
    """Rewrite ``node`` to run on this rank's tokens, or return False (nothing changed)."""
    t = node.target
    if t == aten._assert_tensor_metadata.default:  # dtype / device only: nothing to change
        return all(a is None for a in node.args[1:3])
    d, outer = st.tokens[inputs[0]]
    if any(st.tokens[a][1] != outer or st.tokens[a][0] != d for a in inputs[1:]):
        return False
    first = st.whole[inputs[0]]
    first = _first_tensor(first)
    if first is None:
        return False
    ndim = first.dim()
    out_whole = node.meta.get("val")
    out_t = _first_tensor(out_whole)
    if out_t is None:
        return False
    pointwise = isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags
    new_args = list(node.args)
    if t in _VIEWS:
        where = _view_tokens(first.shape, d, outer, out_t.shape, st.tp.size)
        if where is None:
            return False
        od, oouter = where
        target = list(node.args[1])  # type: ignore[arg-type]
        if target[od] != -1:
            target[od] = int(out_t.shape[od]) // st.tp.size
        new_args[1] = target
    elif t in _NORMS:
        if d >= ndim - len(node.args[_NORMS[t]]):  # type: ignore[arg-type]
            return False
        od, oouter = d, outer
    elif t in _REDUCTIONS:
        dims = node.args[1] if len(node.args) > 1 else None
        keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
        if not dims or not keep or d in {x % ndim for x in dims}:  # type: ignore[union-attr]
            return False
        od, oouter = d, outer
    elif pointwise or t in _SAME:
        od, oouter = d + (out_t.dim() - ndim), outer
        if not 0 <= od < out_t.dim() or out_t.shape[od] != first.shape[d]:
            return False
    else:
        return False
    # the other operands: sliced to the tokens, "f" when broadcast over them, else refused
    size_full = int(first.shape[d])
    plan: dict[fx.Node, tuple[str, int, Any]] = {}  # operand -> (how, dim, its local value)
    if t not in _VIEWS and t != operator.getitem:
        for a in node.all_input_nodes:
            val = a.meta.get("val")
            if a in st.tokens or not isinstance(val, torch.Tensor):
                continue
            pos = od - (out_t.dim() - val.dim())
            if pos >= 0 and val.shape[pos] == size_full and size_full != 1:
                local = list(val.shape)
                local[pos] //= st.tp.size
                plan[a] = ("scatter", pos, val.new_empty(local, device="meta"))
            elif pos >= 0 and val.shape[pos] != 1:
                return False
            elif val.is_floating_point():
                plan[a] = ("copy", 0, _meta(val))
    local_val = _local_value(node, new_args, {a: v for a, (_, _, v) in plan.items()})
    if local_val is None:
        return False
    if t in _VIEWS:
        node.args = (node.args[0], new_args[1], *node.args[2:])
    tp = st.tp
    for a, (how, pos, val) in plan.items():
        if how == "scatter":
            b = st.once(("scatter", a, pos, outer), lambda a=a, pos=pos, val=val: st.call(
                torch.ops.autopart.tp_seq_scatter.default,
                (a, pos, outer, tp.rank, tp.size, tp.group_name), node, val))
        else:
            b = st.once(("copy", a), lambda a=a, val=val: st.call(
                torch.ops.autopart.tp_copy.default, (a, tp.group_name), node, val))
        node.replace_input_with(a, b)
    st.mark(node, od, oouter, local_val)
    return True


def _local_value(node: fx.Node, args: list[Any], local: dict[fx.Node, Any]) -> Any:
    """The node's value on this rank's tokens (meta), or None where it fails to run."""

    def value(a: fx.Node) -> Any:
        return local[a] if a in local else _meta(a.meta.get("val"))

    args_m = fx.node.map_arg(tuple(args), value)
    kwargs_m = {k: (torch.device("meta") if isinstance(v, torch.device) else v)
                for k, v in fx.node.map_arg(node.kwargs, value).items()}
    try:
        return node.target(*args_m, **kwargs_m)  # type: ignore[operator]
    except Exception:  # noqa: BLE001 - an op the local shapes do not fit: gather instead
        return None


def _view_tokens(shape: torch.Size, d: int, outer: int, out: torch.Size,
                 size: int) -> tuple[int, int] | None:
    """Where the tokens of a ``shape`` tensor split at ``(d, outer)`` land in its view as
    ``out``: ``(dim, outer)``, or None where the view mixes them with other dimensions."""
    after = 1
    for x in shape[d + 1:]:
        after *= int(x)
    inner = int(shape[d]) // outer  # the whole tokens split, per outer row
    for k in range(len(out)):
        rest = 1
        for x in out[k + 1:]:
            rest *= int(x)
        if rest == after and int(out[k]) % inner == 0 and inner % size == 0:
            lead = 1
            for x in out[:k]:
                lead *= int(x)
            before = 1
            for x in shape[:d]:
                before *= int(x)
            if lead * (int(out[k]) // inner) == before * outer:
                return k, int(out[k]) // inner
    return None


assert _tp_ops.tp_seq_gather is not None  # registers the autopart:: ops the graphs call
