"""Repeated blocks: find structurally identical layers (``model.layers.<i>``) so one is measured for all."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from autopart.core.capture import node_module_path, op_nodes
from autopart.core.costgraph import path_pattern

__all__ = ["BlockInstance", "find_blocks", "repeated_blocks", "path_pattern"]

@dataclass(frozen=True)
class BlockInstance:
    """One layer of a stack: a maximal run of consecutive op nodes under ``<prefix>.<index>``.

    Attributes:
        prefix: module path of the stack, e.g. ``"model.layers"``.
        index: the layer's index in the stack.
        nodes: its op nodes, in topological order.
    """

    prefix: str
    index: int
    nodes: tuple[fx.Node, ...]


def find_blocks(graph: fx.Graph) -> list[BlockInstance]:
    """Every run of consecutive op nodes whose module paths share ``<prefix>.<index>``."""
    blocks: list[BlockInstance] = []
    current: list[fx.Node] = []
    key: tuple[str, int] | None = None
    for node in op_nodes(graph):
        k = path_pattern(node_module_path(node))
        if k != key and current and key is not None:
            blocks.append(BlockInstance(key[0], key[1], tuple(current)))
            current = []
        key = k
        if k is not None:
            current.append(node)
    if current and key is not None:
        blocks.append(BlockInstance(key[0], key[1], tuple(current)))
    return blocks


def _dims(sizes: Any) -> tuple[Any, ...]:
    """Sizes or strides, hashable: a symbolic one (``torch.SymInt``, e.g. the unbacked
    ``u0`` of a data-dependent size) as its expression's text, which torch.SymInt cannot
    be hashed as."""
    return tuple(d if isinstance(d, int) else f"sym:{d}" for d in sizes)


def _meta_sig(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (_dims(value.shape), _dims(value.stride()), str(value.dtype))
    if isinstance(value, (list, tuple)):
        return tuple(_meta_sig(v) for v in value)
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return f"{type(value).__name__}:{value}"
    return type(value).__name__


def _signature(block: BlockInstance, param_shape: dict[str, Any]) -> Any:
    """Ops, abstracted module paths, shapes, dtypes and wiring of a block, index-free."""
    local = {n: i for i, n in enumerate(block.nodes)}
    marker = f"{block.prefix}.{block.index}"

    def arg(a: Any) -> Any:
        if isinstance(a, fx.Node):
            if a in local:
                return ("local", local[a])
            if a.op == "get_attr":
                return ("param", param_shape.get(str(a.target)))
            return ("external", _meta_sig(a.meta.get("val")))
        if isinstance(a, (list, tuple)):
            return tuple(arg(x) for x in a)
        if isinstance(a, dict):
            return tuple(sorted((str(k), arg(v)) for k, v in a.items()))
        return repr(a)

    items = []
    for node in block.nodes:
        path = node_module_path(node)
        items.append((str(node.target), path.replace(marker, "<i>", 1), arg(node.args),
                      arg(node.kwargs), _meta_sig(node.meta.get("val"))))
    return tuple(items)


def repeated_blocks(gm: fx.GraphModule) -> dict[fx.Node, fx.Node]:
    """Map every node of a repeated layer to the same node of the first identical layer.

    Two layers are identical when their op sequences, module paths with the layer index
    abstracted (``model.layers.<i>.mlp``), output shapes, strides and dtypes, parameter
    shapes and internal wiring match, and their inputs from outside the layer have the
    same shapes. The first layer of each kind maps to nothing (it is measured).

    Returns:
        ``{node: representative}`` for the nodes of the second and later identical layers.
    """
    param_shape: dict[str, Any] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            obj: Any = gm
            for part in str(node.target).split("."):
                obj = getattr(obj, part)
            param_shape[str(node.target)] = _meta_sig(obj)
    first: dict[Any, BlockInstance] = {}
    mapping: dict[fx.Node, fx.Node] = {}
    for block in find_blocks(gm.graph):
        sig = (block.prefix, _signature(block, param_shape))
        rep = first.setdefault(sig, block)
        if rep is not block:
            mapping.update(zip(block.nodes, rep.nodes, strict=True))
    return mapping
