"""The captured graph: a model as one flat fx.GraphModule, its node helpers and fingerprint."""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from autopart.core.errors import TraceError
from autopart.core.op_names import GROUPED_MM_OPS

__all__ = ["GROUPED_MM_OPS", "METADATA_CHECKS", "SDPA_ARGS", "SINK_ATTENTION_META",
           "CapturedGraph", "buffer_update_cuts", "erase_unread", "graph_fingerprint",
           "op_nodes", "node_module_path", "node_source", "sdpa_arguments", "weight_source"]

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


def _writes(node: fx.Node, buffer: fx.Node) -> bool:
    """Whether op ``node`` writes ``buffer`` in place (an argument its schema marks written)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return False
    given = dict(zip((a.name for a in schema.arguments), node.args, strict=False), **node.kwargs)
    return any(given.get(a.name) is buffer for a in schema.arguments
               if a.alias_info is not None and a.alias_info.is_write)


def buffer_update_cuts(graph: fx.Graph) -> frozenset[int]:
    """Cut positions (``k`` cuts before op ``k`` of :func:`op_nodes`) that would separate a
    buffer's in-place update from an earlier op reading that buffer.

    Such a buffer (an EMA that a ``copy_`` writes after the ops computing its new value read
    its old one) lives in the stage that writes it; a stage before it would read it for
    microbatch ``i + 1`` before microbatch ``i``'s update ran, or read a copy never updated.
    Running the microbatches one after another reads each update, so every op from the first
    reader to the last writer must share a stage. BatchNorm's statistics and
    ``num_batches_tracked`` are read and written by one op each (the capture makes them in
    place, :func:`autopart.core._capture_rewrites.update_buffers_where_read`) and rule out
    nothing.
    """
    index = {n: i for i, n in enumerate(op_nodes(graph))}
    out: set[int] = set()
    for buffer in graph.nodes:
        if buffer.op != "get_attr":
            continue
        users = [u for u in buffer.users if u in index]
        writers = [index[u] for u in users if _writes(u, buffer)]
        if writers:
            out.update(range(min(index[u] for u in users) + 1, max(writers) + 1))
    return frozenset(out)


def node_module_path(node: fx.Node) -> str:
    """Innermost ``nn_module_stack`` FQN of a node, ``""`` at the model's top level."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    fqn = list(stack.values())[-1][0]
    return str(fqn)


def node_source(node: fx.Node) -> str:
    """Where the model made ``node``: ``"file.py:123 (code)"`` of the innermost frame that
    torch.export recorded, or ``"unknown source line"`` when it recorded none (nodes that
    autopart or export inserted)."""
    trace = node.meta.get("stack_trace") or ""
    frames = re.findall(r'File "([^"]+)", line (\d+), in [^\n]*\n\s*([^\n]*)', trace)
    if not frames:
        return "unknown source line"
    path, line, code = frames[-1]
    return f"{os.path.basename(path)}:{line} ({code.strip()})"


_PASS_THROUGH_OPS = frozenset({
    "aten.t.default", "aten.transpose.int", "aten.permute.default", "aten.view.default",
    "aten.reshape.default", "aten._unsafe_view.default", "aten.expand.default",
    "aten.alias.default", "aten.unsqueeze.default", "aten._to_copy.default",
    "aten.to.dtype", "aten.to.dtype_layout", "aten.contiguous.default", "aten.clone.default"})
"""Single-tensor ops through which an operand stays 'the weight': a matmul's operand made by
these from a parameter has its gradient computed in the weight-gradient (W) pass."""


def weight_source(node: fx.Node) -> fx.Node | None:
    """The ``get_attr`` node that ``node`` is (possibly through transposes, views and casts),
    else None. transformers 5 stores MoE experts as stacked 3-D parameters and hands
    ``weight.transpose(1, 2)`` to the grouped GEMM: that operand is the weight all the same."""
    while node.op == "call_function" and str(node.target) in _PASS_THROUGH_OPS and node.args \
            and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node if node.op == "get_attr" else None


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


#: ``aten.scaled_dot_product_attention``'s arguments, in order.
#: Export's checks of a value's metadata (``aten._assert_tensor_metadata``): they read the
#: value and nothing reads them, so they go where the value goes.
METADATA_CHECKS = frozenset({torch.ops.aten._assert_tensor_metadata.default})


def erase_unread(nodes: Iterable[Any]) -> None:
    """Erase each of ``nodes`` (fx nodes; anything else is skipped) that nothing but export's
    metadata checks reads any more, with those checks, then what only it read, up to the
    graph's inputs, stored tensors and impure ops (a value received from another stage
    stays an input)."""
    todo = [n for n in nodes if isinstance(n, fx.Node)]
    while todo:
        node = todo.pop()
        if getattr(node, "_erased", False) or node.op != "call_function" or \
                node.is_impure() or any(u.target not in METADATA_CHECKS for u in node.users):
            continue
        for check in list(node.users):
            node.graph.erase_node(check)
        inputs = node.all_input_nodes
        node.graph.erase_node(node)
        todo.extend(inputs)


#: ``node.meta`` key of the attention nodes the capture made from eager attention with learned
#: sinks (``autopart.core.capture``): their queries, keys and values carry a sink row and
#: column, so a pass that splits the sequence or the head dimension must refuse them.
SINK_ATTENTION_META = "autopart_sink_attention"

SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
             "enable_gqa")


def sdpa_arguments(node: fx.Node) -> dict[str, Any]:
    """An attention node's arguments by name (positional and keyword; those not given are
    left out)."""
    given = dict(zip(SDPA_ARGS, node.args, strict=False))
    given.update(node.kwargs)
    return given

