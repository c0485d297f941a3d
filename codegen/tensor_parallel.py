"""Tensor parallelism inside a stage: shard one stage graph's planned parameters for one tp rank.

The plan names the parameters tensor parallelism splits (``Plan.sharded_parameters``, found by
``solver/tensor_parallel.py``'s Megatron pair rule). :func:`shard_stage` rewrites one stage
``fx.GraphModule`` as :func:`autopart.codegen.build_stages` makes it into the stage of one tp
rank (Megatron-LM, Shoeybi et al. 2019, section 3):

- column-parallel matmuls (``linear`` ``[out, in]`` weights, ``addmm`` / ``mm`` ``[in, out]``
  weights such as GPT-2's ``Conv1D``) keep this rank's output features; a fused projection
  whose output is ``split`` on its features (GPT-2's ``c_attn``: q, k, v blocks side by side)
  keeps its share of every block. Their input goes through Megatron's "f"
  (``autopart::tp_copy``: identity forward, all-reduce of the gradient backward);
- the nodes after them run on the local features: reshape / view / expand targets and split
  sizes over the split dimension are divided by tp (heads per rank, hidden per rank), found
  from the captured shapes; a replicated floating operand they read (rotary tables) also
  goes through "f", so its gradient sums every rank's share;
- row-parallel matmuls keep this rank's input features and are followed by Megatron's "g"
  (``autopart::tp_reduce``: all-reduce forward, identity backward); their bias is added once,
  after it;
- a vocab-parallel embedding keeps rows ``[r V/tp, (r+1) V/tp)``, looks up the ids in that
  range (others read row 0 and are zeroed) and all-reduces ("g");
- a vocab-parallel head (``linear`` of a ``[V, h]`` weight) computes this rank's logits
  after "f" and all-gathers them along the vocabulary (``autopart::tp_gather``, backward:
  this rank's slice), so the user's own ``loss_fn`` sees the whole logits. The collective it
  really runs is an all-gather of ``batch x seq x V`` logits per microbatch, not the parallel
  cross-entropy's per-token scalars.

Every op that reads a split tensor is checked: its output must be split on exactly one
dimension (so reductions over the split dimension, cuts inside a pair and unknown ops that
read a sharded parameter raise :class:`PlanError` naming the op, the parameter and the fix).

Why not torch's own tools (torch 2.13): ``torch.distributed.tensor.experimental.
tensor_parallel_transformation`` takes an ``ExportedProgram`` (our stages are split
``GraphModule``s whose parameters are ``get_attr`` nodes), knows only ``nn.Linear`` layouts
by module FQN (``Shard(0)`` for column: wrong for GPT-2's ``[in, out]`` ``Conv1D`` and for
its interleaved q/k/v), and inserts ``_c10d_functional.all_reduce`` whose autograd is
another all-reduce and no "f" before column inputs, so a training step's gradients would
be wrong; it targets inference. ``torch.distributed.tensor.parallel.parallelize_module``
needs ``nn.Linear``/``nn.Embedding`` submodules, which a captured graph no longer has, and
DTensor ops inside an ``fx`` stage would not print as readable source. The collectives here
are ``torch.library`` custom ops (:mod:`autopart.codegen._tp_ops`) over torch's functional
collectives, so they stay in the graph and in ``torch.compile``.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from autopart.codegen import _tp_ops
from autopart.codegen.tp_layout import ShardLayout, TensorParallelRank
from autopart.core.errors import PlanError

__all__ = ["ShardLayout", "TensorParallelRank", "shard_stage"]

aten = torch.ops.aten
_FIX = ("plan this model with tp=1 (autopart plan --tp 1, or compile(..., tp=1)) or "
        "pipeline-only (--pipeline-only)")
_RESHAPES = {aten.reshape.default, aten.view.default, aten._unsafe_view.default}
_SPLITS = {aten.split.Tensor, aten.split_with_sizes.default}
_KEEP_SHAPE = {aten.transpose.int, aten.permute.default, aten.unsqueeze.default,
               aten.squeeze.dim, aten.squeeze.dims, aten.clone.default, aten.alias.default,
               aten._to_copy.default, aten.contiguous.default, aten.dropout.default,
               aten.native_dropout.default, aten.matmul.default, aten.bmm.default,
               aten.baddbmm.default, aten.detach.default, operator.getitem}
_DIM_NOT_SPLIT = {aten.slice.Tensor: 1, aten.select.int: 1, aten.cat.default: 1,
                  aten.softmax.int: 1, aten._softmax.default: 1, aten.log_softmax.int: 1,
                  aten._log_softmax.default: 1}
_SDPA = {aten.scaled_dot_product_attention.default}


def _meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    if isinstance(value, (list, tuple)):
        return type(value)(_meta(v) for v in value)
    return value


def _copy_meta(new: fx.Node, old: fx.Node) -> None:
    for key in ("nn_module_stack", "stack_trace", "source_fn_stack", "from_node"):
        if key in old.meta:
            new.meta[key] = old.meta[key]


def _error(node: fx.Node, fqn: str, why: str) -> PlanError:
    return PlanError(f"tensor parallelism cannot shard op {node.name} ({node.target}) of "
                     f"this stage, which reads {fqn}: {why}; {_FIX}")


def _classify(user: fx.Node, attr: fx.Node, style: str) -> tuple[str, int]:
    """(kind of the matmul, dimension of ``attr`` it splits) for a node reading a planned
    parameter; kinds: column, row, vocab_embedding, vocab_linear."""
    fqn, t, args = str(attr.target), user.target, user.args
    pos = [i for i, a in enumerate(args) if a is attr]
    if t == aten.linear.default and pos in ([1], [2]):
        if pos == [2]:  # bias
            if style != "column":
                raise _error(user, fqn, f"a {style}-parallel bias is not a Megatron layout "
                             "(a row-parallel bias stays replicated)")
            return "column", 0
        return {"column": ("column", 0), "row": ("row", 1),
                "vocab": ("vocab_linear", 0)}[style]
    if t == aten.addmm.default and pos in ([0], [2]) and style in ("column", "row"):
        if pos == [0]:
            if style != "column":
                raise _error(user, fqn, "a row-parallel bias stays replicated")
            return "column", 0
        return ("column", 1) if style == "column" else ("row", 0)
    if t in (aten.mm.default, aten.matmul.default) and pos == [1] and style in ("column", "row") \
            and len(attr.meta["val"].shape) == 2:
        return ("column", 1) if style == "column" else ("row", 0)
    if t == aten.embedding.default and pos == [0] and style == "vocab":
        if len(args) > 3 and args[3]:
            raise _error(user, fqn, "scale_grad_by_freq counts ids per rank")
        return "vocab_embedding", 0
    raise _error(user, fqn, f"the pass does not know how to split this op for a "
                 f"{style}-parallel parameter")


def _dim_arg(node: fx.Node, pos: int) -> int:
    """An op's ``dim`` argument (positional ``pos`` or keyword; default 0)."""
    dim: Any = node.args[pos] if len(node.args) > pos else node.kwargs.get("dim", 0)
    return int(dim)


def _blocks(node: fx.Node, width: int, size: int, fqn: str) -> tuple[tuple[int, ...], set[fx.Node]]:
    """The blocks of a column matmul's output features (one, or the pieces of a ``split``
    on them after reshapes) and those split nodes."""
    found: dict[fx.Node, tuple[int, ...]] = {}
    stack = [node]
    while stack:
        n = stack.pop()
        ndim = len(n.meta["val"].shape)
        for u in n.users:
            if u.target in _RESHAPES and u.meta["val"].shape[-1] == width:
                stack.append(u)
            elif u.target in _SPLITS and _dim_arg(u, 2) % ndim == ndim - 1:
                found[u] = tuple(int(v.shape[-1]) for v in u.meta["val"])
    kinds = set(found.values())
    if len(kinds) > 1:
        raise _error(node, fqn, f"its output is split into different blocks {sorted(kinds)}")
    blocks = kinds.pop() if kinds else (width,)
    if any(b % size for b in blocks):
        raise _error(node, fqn, f"tp={size} does not divide its output blocks {list(blocks)} "
                     "(e.g. the heads or the hidden size)")
    return blocks, set(found)


class _Pass:
    """State of one :func:`shard_stage` run."""

    def __init__(self, gm: fx.GraphModule, tp: TensorParallelRank) -> None:
        self.gm, self.graph, self.tp = gm, gm.graph, tp
        self.split: dict[fx.Node, int] = {}  # nodes whose output is split: -> its split dim
        self.local: dict[fx.Node, Any] = {}  # their local (meta) values
        self.copies: dict[fx.Node, fx.Node] = {}  # replicated node -> its "f"
        self.origin: dict[fx.Node, str] = {}  # split node -> the parameter it comes from
        self.splits_ok: set[fx.Node] = set()
        self.attrs: set[fx.Node] = set()  # get_attr nodes of the sharded parameters

    def call(self, target: Any, args: tuple[Any, ...], like: fx.Node, before: fx.Node,
             val: Any = None) -> fx.Node:
        with self.graph.inserting_before(before):
            new = self.graph.call_function(target, args)
        _copy_meta(new, like)
        if val is not None:
            new.meta["val"] = val
        return new

    def copy_of(self, x: fx.Node, before: fx.Node) -> fx.Node:
        if x not in self.copies:
            self.copies[x] = self.call(torch.ops.autopart.tp_copy.default,
                                       (x, self.tp.group_name), x, before, x.meta.get("val"))
        return self.copies[x]

    def mark(self, node: fx.Node, fqn: str, local: Any) -> None:
        orig = node.meta["val"]
        outs = local if isinstance(local, (list, tuple)) else [local]
        origs = orig if isinstance(orig, (list, tuple)) else [orig]
        dims = set()
        for lo, og in zip(outs, origs, strict=True):
            ok = isinstance(lo, torch.Tensor) and lo.dim() == og.dim()
            diff = [i for i, (a, b) in enumerate(zip(lo.shape, og.shape, strict=True))
                    if a != b] if ok else []
            if len(diff) != 1 or lo.shape[diff[0]] * self.tp.size != og.shape[diff[0]]:
                raise _error(node, fqn, "its output is not split along one dimension (it "
                             "reduces over or mixes the split features)")
            dims.add(diff[0])
        if len(dims) != 1:
            raise _error(node, fqn, "its outputs are split along different dimensions")
        self.split[node], self.local[node], self.origin[node] = dims.pop(), local, fqn
        node.meta["val"] = local

    def value(self, a: fx.Node) -> Any:
        return self.local[a] if a in self.local else _meta(a.meta.get("val"))


def shard_stage(gm: fx.GraphModule, styles: Mapping[str, str], tp: TensorParallelRank, *,
                made: dict[int, nn.Parameter] | None = None) -> dict[str, ShardLayout]:
    """Rewrite ``gm`` in place into tp rank ``tp.rank``'s share of the stage.

    Args:
        gm: one stage as :func:`autopart.codegen.params.build_stage_modules` builds it
            (``get_attr`` targets are canonical FQNs; ``meta["val"]`` holds captured shapes).
        styles: parameter FQN -> ``"column"`` / ``"row"`` / ``"vocab"`` (the plan's
            ``sharded_parameters``; FQNs this stage does not read are ignored).
        tp: this process's tp rank, degree and group name.
        made: id of a full tensor -> its shard already made for another stage of this
            process, reused so that stages sharing a tensor keep sharing its shard.

    Returns:
        FQN -> layout of every parameter sharded in this stage.

    Raises:
        PlanError: a planned parameter read by an op the pass cannot split, a tp that does
            not divide a split size, a split tensor that leaves the stage (a cut inside a
            column/row pair) or that an op reduces over; each names the op, the parameter
            and the fix.
    """
    made = {} if made is None else made
    graph = gm.graph
    attrs = {n: styles[str(n.target)] for n in graph.nodes
             if n.op == "get_attr" and str(n.target) in styles}
    if not attrs or tp.size == 1:
        return {}
    kinds: dict[fx.Node, str] = {}
    layouts: dict[str, ShardLayout] = {}
    st = _Pass(gm, tp)
    st.attrs = set(attrs)
    for attr, style in attrs.items():
        fqn = str(attr.target)
        for user in list(attr.users):
            kind, dim = _classify(user, attr, style)
            if kinds.setdefault(user, kind) != kind:
                raise _error(user, fqn, "its parameters are planned with different styles")
            full = attr.meta["val"].shape
            blocks: tuple[int, ...] = (int(full[dim]),)
            if kind == "column":
                width = int(user.meta["val"].shape[-1])
                blocks, ok = _blocks(user, width, tp.size, fqn)
                st.splits_ok |= ok
            elif full[dim] % tp.size:
                raise _error(user, fqn, f"tp={tp.size} does not divide its size {full[dim]} "
                             f"along dimension {dim}")
            layout = ShardLayout(dim, blocks)
            if layouts.setdefault(fqn, layout) != layout:
                raise _error(user, fqn, f"it is split as {layouts[fqn]} elsewhere")
    for attr in attrs:
        hold_shard(gm, attr, layouts[str(attr.target)], tp, made)
    for node in list(graph.nodes):
        _rewrite(st, node, kinds.get(node))
    graph.lint()
    gm.recompile()
    return layouts


def hold_shard(gm: fx.GraphModule, attr: fx.Node, layout: ShardLayout,
               rank: TensorParallelRank, made: dict[int, nn.Parameter]) -> None:
    """Put ``rank``'s piece (``layout.local``) of the parameter ``attr`` reads into ``gm`` at
    its FQN, and its shape into ``attr``'s metadata. ``made`` (id of a whole tensor -> its
    piece) is read and filled, so stages of one process sharing a tensor share its piece.
    Used for tp shards and ep's experts alike."""
    fqn = str(attr.target)
    old = gm.get_parameter(fqn)
    new = made.get(id(old))
    if new is None:
        new = nn.Parameter(layout.local(old.detach(), rank.rank, rank.size),
                           requires_grad=old.requires_grad)
        made[id(old)] = new
    owner, _, leaf = fqn.rpartition(".")
    setattr(gm.get_submodule(owner) if owner else gm, leaf, new)
    attr.meta["val"] = _meta(new)


def _rewrite(st: _Pass, node: fx.Node, kind: str | None) -> None:
    tp = st.tp
    if node.op == "output":
        for a in node.all_input_nodes:
            if a in st.split:
                raise _error(a, st.origin[a], "its split output leaves the stage (a cut "
                             "inside a column/row pair); cut the model elsewhere")
        return
    if node.op != "call_function":
        return
    args: list[Any] = list(node.args)
    if kind in ("column", "vocab_linear"):
        x = args[1] if node.target == aten.addmm.default else args[0]
        weight = args[2] if node.target == aten.addmm.default else args[1]
        fqn = str(weight.target)
        if x in st.split:
            raise _error(node, fqn, "its input is already split")
        whole = [a for a in node.all_input_nodes
                 if a.op == "get_attr" and a is not weight and a not in st.attrs]
        if kind == "column" and whole:
            raise _error(node, fqn, f"its other parameter {whole[0].target} is not planned "
                         "column-parallel with it")
        xf = st.copy_of(x, node)
        if kind == "column":
            node.replace_input_with(x, xf)
            val = _meta(node.meta["val"])
            shape = list(val.shape)
            shape[-1] //= tp.size
            st.mark(node, fqn, torch.empty(shape, dtype=val.dtype, device="meta"))
            return
        y = st.call(aten.linear.default, (xf, weight), node, node)
        dim = len(node.meta["val"].shape) - 1
        out = st.call(torch.ops.autopart.tp_gather.default,
                      (y, dim, tp.rank, tp.size, tp.group_name), node, node, node.meta["val"])
        if len(args) > 2 and args[2] is not None:
            out = st.call(aten.add.Tensor, (out, args[2]), node, node, node.meta["val"])
        node.replace_all_uses_with(out)
        st.graph.erase_node(node)
        return
    if kind == "row":
        x = args[1] if node.target == aten.addmm.default else args[0]
        weight = args[2] if node.target == aten.addmm.default else args[1]
        bias = args[0] if node.target == aten.addmm.default else (
            args[2] if len(args) > 2 else None)
        fqn = str(weight.target)
        if x not in st.split or st.split[x] != len(st.local[x].shape) - 1:
            raise _error(node, fqn, "its input is not split along its features (no "
                         "column-parallel op before it in this stage)")
        target = aten.mm.default if node.target == aten.addmm.default else node.target
        partial = st.call(target, (x, weight), node, node, node.meta["val"])
        out = st.call(torch.ops.autopart.tp_reduce.default, (partial, tp.group_name), node,
                      node, node.meta["val"])
        if bias is not None:
            out = st.call(aten.add.Tensor, (out, bias), node, node, node.meta["val"])
        node.replace_all_uses_with(out)
        st.graph.erase_node(node)
        return
    if kind == "vocab_embedding":
        _vocab_embedding(st, node)
        return
    inputs = [a for a in node.all_input_nodes if a in st.split]
    if not inputs:
        return
    fqn = st.origin[inputs[0]]
    if node.target == aten._assert_tensor_metadata.default:  # dtype / device only
        if any(a is not None for a in node.args[1:3]):
            raise _error(node, fqn, "it asserts the whole sizes")
        return
    _check_and_retarget(st, node, inputs[0], fqn)
    for a in node.all_input_nodes:
        val = a.meta.get("val")
        if a not in st.split and isinstance(val, torch.Tensor) and val.is_floating_point():
            node.replace_input_with(a, st.copy_of(a, node))
    args_m = fx.node.map_arg(node.args, st.value)
    kwargs_m = {k: (torch.device("meta") if isinstance(v, torch.device) else v)
                for k, v in fx.node.map_arg(node.kwargs, st.value).items()}
    try:
        local = node.target(*args_m, **kwargs_m)  # type: ignore[operator]
    except Exception as exc:  # shape errors: the op mixes split and whole tensors
        raise _error(node, fqn, f"it fails on the split shapes ({str(exc).splitlines()[0]})") \
            from exc
    st.mark(node, fqn, local)


def _check_and_retarget(st: _Pass, node: fx.Node, first: fx.Node, fqn: str) -> None:
    """Allow only ops known to keep a split dimension; divide shape arguments over it."""
    t, size = node.target, st.tp.size
    if t == operator.getitem:
        return
    d = st.split[first]
    in_shape = list(_orig_shape(st, first))
    ndim = len(in_shape)
    if t in _RESHAPES:
        out = list(node.meta["val"].shape)
        period = math.prod(in_shape[d:])
        ks = [k for k in range(len(out)) if math.prod(out[k:]) == period and out[k] % size == 0
              and out[k] >= size]
        if not ks:
            raise _error(node, fqn, f"its target shape {out} does not keep the split "
                         f"dimension {d} of {in_shape} whole")
        target = list(node.args[1])  # type: ignore[arg-type]
        if target[ks[0]] != -1:
            target[ks[0]] = out[ks[0]] // size
        node.args = (node.args[0], target, *node.args[2:])
        return
    if t == aten.expand.default:
        target = list(node.args[1])  # type: ignore[arg-type]
        target[d + len(target) - ndim] = -1
        node.args = (node.args[0], target, *node.args[2:])
        return
    if t in _SPLITS:
        if _dim_arg(node, 2) % ndim != d:
            return
        if node not in st.splits_ok:
            raise _error(node, fqn, "it splits the split features, and they do not come "
                         "straight from a fused column-parallel projection")
        sizes = node.args[1]
        new = [s // size for s in sizes] if isinstance(sizes, (list, tuple)) else sizes // size
        node.args = (node.args[0], new, *node.args[2:])
        return
    if t in _DIM_NOT_SPLIT:
        if _dim_arg(node, _DIM_NOT_SPLIT[t]) % ndim == d:
            raise _error(node, fqn, f"it works along the split dimension {d}")
        return
    if t in _SDPA:
        for a in node.args[:3]:
            if not isinstance(a, fx.Node) or a not in st.split \
                    or st.split[a] != len(_orig_shape(st, a)) - 3:
                raise _error(node, fqn, "attention needs q, k and v split by heads")
        return
    if t in _KEEP_SHAPE or (isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags):
        return
    raise _error(node, fqn, "the pass does not know whether this op keeps the split features "
                 "apart")


def _orig_shape(st: _Pass, a: fx.Node) -> torch.Size:
    """A split node's full (captured) shape: its local shape with the split dim times tp."""
    shape = list(st.local[a].shape)
    shape[st.split[a]] *= st.tp.size
    return torch.Size(shape)


def _vocab_embedding(st: _Pass, node: fx.Node) -> None:
    """``embedding(w, ids)`` -> ids outside this rank's rows read row 0 and are zeroed, then
    "g" sums the ranks' lookups (Megatron's ``VocabParallelEmbedding``)."""
    tp = st.tp
    weight, ids, *rest = node.args
    rows = int(weight.meta["val"].shape[0])  # type: ignore[union-attr]
    lo, hi = tp.rank * rows, (tp.rank + 1) * rows
    pad = rest[0] if rest else -1
    local_pad = pad - lo if isinstance(pad, int) and lo <= pad < hi else -1
    c = st.call
    below = c(aten.lt.Scalar, (ids, lo), node, node)
    above = c(aten.ge.Scalar, (ids, hi), node, node)
    outside = c(aten.bitwise_or.Tensor, (below, above), node, node)
    shifted = c(aten.sub.Tensor, (ids, lo), node, node)
    local_ids = c(aten.masked_fill.Scalar, (shifted, outside, 0), node, node)
    looked = c(aten.embedding.default, (weight, local_ids, local_pad), node, node)
    mask = c(aten.unsqueeze.default, (outside, -1), node, node)
    zeroed = c(aten.masked_fill.Scalar, (looked, mask, 0.0), node, node)
    out = c(torch.ops.autopart.tp_reduce.default, (zeroed, tp.group_name), node, node,
            node.meta["val"])
    node.replace_all_uses_with(out)
    st.graph.erase_node(node)


assert _tp_ops.tp_copy is not None  # registers the autopart:: ops the rewritten graphs call
