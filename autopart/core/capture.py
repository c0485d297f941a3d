"""Capture: torch.export (non-strict) to a flat fx.GraphModule that keeps each node's module path."""

from __future__ import annotations

import hashlib
import linecache
import operator
import os
import traceback
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from autopart.core.errors import TraceError

__all__ = ["CapturedGraph", "capture", "graph_fingerprint", "op_nodes", "node_module_path"]

_OP_KINDS = ("call_function", "call_method", "call_module")


@dataclass(frozen=True)
class CapturedGraph:
    """A model captured as one flat FX graph.

    Attributes:
        graph_module: takes the flattened inputs positionally (one placeholder per pytree
            leaf of ``(args, kwargs)``) and returns the flattened outputs as a tuple.
            Parameters and buffers are ``get_attr`` nodes; they are the model's own tensors.
        in_spec: pytree spec of ``(args, kwargs)``; ``out_spec``: of the model's output.
        attr_fqns: ``get_attr`` target -> the model's canonical FQN (the first name
            ``model.named_parameters()`` / ``named_buffers()`` gives a tied tensor), or the
            target itself for constants that belong to no module.
        trainable: canonical FQNs of parameters with ``requires_grad``.
        buffers: canonical FQNs of buffers.
        batch_size: leading dimension of the first tensor input.
        fingerprint: :func:`graph_fingerprint` of the graph.
    """

    graph_module: fx.GraphModule
    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec
    attr_fqns: dict[str, str]
    trainable: frozenset[str]
    buffers: frozenset[str]
    batch_size: int
    fingerprint: str

    def flatten_inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        """Flatten ``(args, kwargs)`` to the graph's placeholder order.

        Raises:
            TraceError: the inputs' structure differs from the captured one.
        """
        leaves, spec = pytree.tree_flatten((args, kwargs))
        if spec != self.in_spec:
            raise TraceError(
                f"inputs have structure {spec} but the model was captured with {self.in_spec}; "
                "pass the same positional and keyword inputs as the example inputs")
        return leaves

    def attr_value(self, target: str) -> torch.Tensor:
        """The tensor behind a ``get_attr`` target."""
        value = _get_attr(self.graph_module, target)
        assert isinstance(value, torch.Tensor), target
        return value

    def attr_object(self, target: str) -> Any:
        """What a ``get_attr`` target names: a tensor, or the submodule of a higher-order op."""
        return _get_attr(self.graph_module, target)


def op_nodes(graph: fx.Graph) -> list[fx.Node]:
    """The graph's op nodes (calls) in topological order: what cuts split between."""
    return [n for n in graph.nodes if n.op in _OP_KINDS]


def node_module_path(node: fx.Node) -> str:
    """Innermost ``nn_module_stack`` FQN of a node, ``""`` at the model's top level."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    fqn = list(stack.values())[-1][0]
    return str(fqn)


def _get_attr(root: nn.Module, target: str) -> Any:
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _abstract(arg: Any, index: dict[fx.Node, int]) -> Any:
    if isinstance(arg, fx.Node):
        return f"%{index[arg]}"
    if isinstance(arg, (list, tuple)):
        return [_abstract(a, index) for a in arg]
    if isinstance(arg, dict):
        return {str(k): _abstract(v, index) for k, v in sorted(arg.items(), key=lambda kv: str(kv[0]))}
    if isinstance(arg, bool) or arg is None:
        return arg
    if isinstance(arg, torch.device):
        return "device"  # where it was captured (cpu, cuda:N, meta) is not the structure
    if isinstance(arg, int):
        return "int"  # shape literals change with the batch; the structure does not
    return repr(arg)


def graph_fingerprint(gm: fx.GraphModule, attr_fqns: dict[str, str]) -> str:
    """Hash of a graph's structure: ops, wiring, module paths and parameter shapes.

    Integer literals and devices are abstracted, so the same model captured at batch 8 and
    at microbatch 2, or on cpu, a GPU or ``meta``, has the same fingerprint; a different
    model, layer count or hidden size does not. Returns 16 hex digits of SHA-256.
    """
    index: dict[fx.Node, int] = {}
    h = hashlib.sha256()
    for i, node in enumerate(gm.graph.nodes):
        index[node] = i
        if node.op == "get_attr":
            value = _get_attr(gm, str(node.target))
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else ()
            item: Any = ["get_attr", attr_fqns.get(str(node.target), str(node.target)), shape]
        else:
            item = [node.op, str(node.target), _abstract(node.args, index),
                    _abstract(node.kwargs, index), node_module_path(node)]
        h.update(repr(item).encode())
    return h.hexdigest()[:16]


def _user_frame(exc: BaseException) -> traceback.FrameSummary | None:
    """The innermost traceback frame outside torch, transformers' export glue and autopart."""
    torch_dir = os.path.dirname(torch.__file__)
    here = os.path.dirname(__file__)
    frames = traceback.extract_tb(exc.__traceback__)
    # Errors raised while tracing carry the user frame in the message's stack too; the
    # traceback of the exception is enough for Python-level failures.
    user = [f for f in frames if not f.filename.startswith((torch_dir, here))
            and "site-packages/torch" not in f.filename]
    return user[-1] if user else None


def _trace_error(exc: BaseException) -> TraceError:
    frame = _user_frame(exc)
    where = ""
    if frame is not None:
        line = (frame.line or linecache.getline(frame.filename, frame.lineno or 0)).strip()
        where = f"\n  at {frame.filename}:{frame.lineno} in {frame.name}:\n    {line}"
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    data_dependent = any(k in str(exc) for k in ("data-dependent", "GuardOnDataDependent",
                                                   "Could not guard", "item()"))
    if data_dependent:
        fix = ("the model branches on a tensor's value; replace the Python `if` on tensor data "
               "with torch.where / torch.cond, or compute that branch outside forward()")
    else:
        fix = ("make forward() traceable by torch.export(strict=False): no Python control flow "
               "on tensor values, no .item()/.tolist(), inputs and outputs made of tensors, "
               "lists, tuples, dicts or dataclasses (for Hugging Face decoders pass "
               "use_cache=False)")
    return TraceError(f"torch.export could not capture the model: {type(exc).__name__}: {text}"
                      f"{where}\n  fix: {fix}")


def _leading_dim(leaves: list[Any]) -> int:
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    raise TraceError("no tensor input with a batch dimension; pass at least one tensor whose "
                     "dim 0 is the batch")


def _snapshot_mutated_buffers(gm: fx.GraphModule) -> None:
    """Buffer write-backs (``copy_`` into a buffer, as unlifting writes BatchNorm's running
    statistics back at the end of the graph) move to right after the value they write is
    computed, and ops that read the buffer before it is overwritten read a clone of it.

    Moving keeps a write-back in the stage that computed it: at the end of the graph it
    would land in the last stage, which would write into its own copy of the buffer while
    the owner's stage kept reading the stale value. The clone keeps autograd working:
    the functional BatchNorm op saves the statistics it read for its backward, and the
    ``copy_`` bumps the buffer's version, after which the backward refuses to run
    ("modified by an inplace operation"; eager BatchNorm updates them inside the op).
    It costs one copy of the buffer (a per-channel vector for BatchNorm).
    """
    graph = gm.graph
    writes = [n for n in graph.nodes
              if n.op == "call_function" and n.target is torch.ops.aten.copy_.default
              and isinstance(n.args[0], fx.Node) and n.args[0].op == "get_attr"]
    for node in writes:
        order = {n: i for i, n in enumerate(graph.nodes)}
        buffer = node.args[0]
        readers = sorted((u for u in buffer.users if u is not node and order[u] < order[node]),
                         key=order.__getitem__)
        if readers:
            with graph.inserting_before(readers[0]):  # in the stage of its first reader
                snapshot = graph.call_function(torch.ops.aten.clone.default, (buffer,))
            snapshot.meta = dict(buffer.meta)
            for user in readers:
                user.replace_input_with(buffer, snapshot)
        value = node.args[1]
        if isinstance(value, fx.Node):
            value.append(node)  # right after the value it writes
    # A write of one output of a multi-output op (BatchNorm's new running mean and
    # variance) goes right after its getitem, and the op's other getitems after all such
    # writes: while any getitem is still to come the op's tuple crosses every position, and
    # a tuple cannot be cut, so no cut separates the op from its write-backs.
    for producer in {w.args[1].args[0] for w in writes if isinstance(w.args[1], fx.Node)
                     and w.args[1].target is operator.getitem}:
        items = sorted((u for u in producer.users if u.target is operator.getitem),
                       key=lambda u: u.args[1])
        cursor = producer
        for item in [g for g in items if any(u in writes for u in g.users)] + \
                [g for g in items if not any(u in writes for u in g.users)]:
            cursor.append(item)
            cursor = item
            for w in [u for u in item.users if u in writes]:
                cursor.append(w)
                cursor = w


def capture(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None,
            ) -> CapturedGraph:
    """Capture ``model(*args, **kwargs)`` as a flat FX graph with ``torch.export`` (non-strict).

    The graph is functionalised (``run_decompositions({})``: in-place ops become
    out-of-place, nothing is decomposed). Shapes are specialised to the example inputs;
    a dimension of size 1 may capture differently from larger sizes. The model keeps its
    train/eval mode; dropout and batch-norm behave as in that mode.

    Args:
        model: the module to capture; its parameters are shared, not copied.
        args: positional example inputs; tensors have the batch in dim 0.
        kwargs: keyword example inputs.

    Returns:
        The captured graph (see :class:`CapturedGraph`).

    Raises:
        TraceError: export failed; the message quotes the model line that failed and the fix.
    """
    kwargs = dict(kwargs or {})
    if not isinstance(args, tuple):
        raise TraceError(f"example_inputs must be a tuple, got {type(args).__name__}; "
                         "wrap a single tensor as (x,)")
    try:
        ep = torch.export.export(model, args, kwargs, strict=False)
        # Functionalise (no decompositions): in-place ops such as ``add_`` or ``relu_``
        # become out-of-place, so no stage ever writes into a tensor another stage sent it.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # pytree deprecation inside torch
            ep = ep.run_decompositions({})
    except Exception as exc:  # export raises many unrelated types; all become one clear error
        raise _trace_error(exc) from exc
    gm = ep.module()
    # Drop the input-guard module export inserts: microbatches are checked by the runtime.
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and str(node.target).startswith("_guards_fn"):
            gm.graph.erase_node(node)
            if hasattr(gm, str(node.target)):
                delattr(gm, str(node.target))
    _snapshot_mutated_buffers(gm)
    # Flat calling convention: forward(*leaves) -> tuple(leaves).
    gm.graph._codegen = fx.graph.CodeGen()
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    flat_out = out_node.args[0]
    out_node.args = (tuple(flat_out) if isinstance(flat_out, (list, tuple)) else (flat_out,),)
    gm.graph.lint()
    gm.recompile()

    canon: dict[int, str] = {}
    for name, p in model.named_parameters():
        canon.setdefault(id(p), name)
    for name, b in model.named_buffers():
        canon.setdefault(id(b), name)
    attr_fqns: dict[str, str] = {}
    trainable: set[str] = set()
    buffers: set[str] = set()
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        target = str(node.target)
        value = _get_attr(gm, target)
        fqn = canon.get(id(value), target)
        attr_fqns[target] = fqn
        if isinstance(value, nn.Parameter) and fqn in canon.values():
            if value.requires_grad:
                trainable.add(fqn)
        elif fqn in canon.values():
            buffers.add(fqn)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    if not any(isinstance(v, fx.Node) and isinstance(v.meta.get("val"), torch.Tensor)
               for v in pytree.tree_leaves(output.args[0])):
        raise TraceError(f"{type(model).__name__}.forward returns no tensor (its output is "
                         f"{ep.call_spec.out_spec}); return the model's output (e.g. the logits "
                         "or the loss) from forward")
    leaves = pytree.tree_leaves((args, kwargs))
    return CapturedGraph(
        graph_module=gm, in_spec=ep.call_spec.in_spec, out_spec=ep.call_spec.out_spec,
        attr_fqns=attr_fqns, trainable=frozenset(trainable), buffers=frozenset(buffers),
        batch_size=_leading_dim(leaves), fingerprint=graph_fingerprint(gm, attr_fqns))
