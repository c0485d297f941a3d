"""The layers of a model on its CostGraph: repeated blocks and the runs of nodes between them.

DeepSpeed and torchgpipe partition a list of layers, torchtitan counts transformer
blocks. Here a *block* is a module whose path ends in an index of a repeated container
(``transformer.h.3``, ``model.layers.7``, ``bert.encoder.layer.2``; ResNet bottlenecks
``resnet.encoder.stages.1.layers.2``, found by descending while every node of a block sits
in one indexed child). Containers are grouped by their path with digits replaced by ``*``; the
group with the most nodes, and any other holding at least a quarter of the nodes, supply the
blocks. The graph's layers are then its blocks plus each maximal run of nodes between them (the
embeddings before the first block, the final norm and head after the last); without blocks, the
runs of each top-level module are the layers. Per-layer quantities are sums over its nodes
(parameters: each distinct parameter once per layer, as ``layer.parameters()`` counts them).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from autopart.core.costgraph import CostGraph

__all__ = ["Layer", "model_layers"]

_MAJOR_SHARE = 0.25  # a second block pattern counts when it holds this share of the nodes


@dataclass(frozen=True, slots=True)
class Layer:
    """Op nodes ``start .. stop - 1`` forming one layer of the model.

    Attributes:
        name: the block's module path (``"transformer.h.3"``), or for other runs the module
            path of their first node (``"(top level)"`` when it is empty).
        start: index of its first op node.
        stop: one past the index of its last op node.
        is_block: True for a repeated block (a transformer layer, a ResNet bottleneck).
    """

    name: str
    start: int
    stop: int
    is_block: bool


def _first_index_key(path: str) -> str | None:
    """``"transformer.h.3.attn"`` -> ``"transformer.h.3"``; None without a numeric component."""
    parts = path.split(".") if path else []
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return None


def _indexed_child(path: str, key: str) -> str | None:
    """``key.c.<int>`` when ``path`` lies under it (``key.c.<int>[.rest]``), else None."""
    rest = path[len(key) + 1:].split(".") if path.startswith(key + ".") else []
    if len(rest) >= 2 and rest[1].isdigit():
        return f"{key}.{rest[0]}.{rest[1]}"
    return None


def _block_keys(costs: CostGraph) -> list[str | None]:
    """Per node, the repeated block it belongs to (None outside every block)."""
    paths = [nd.module_path for nd in costs.nodes]
    keys = [_first_index_key(p) for p in paths]
    changed = True
    while changed:  # descend while all of a block's nodes sit in one indexed child container
        changed = False
        members: dict[str, list[int]] = {}
        for i, k in enumerate(keys):
            if k is not None:
                members.setdefault(k, []).append(i)
        for k, idxs in members.items():
            subs = [_indexed_child(paths[i], k) for i in idxs]
            if None not in subs and len({s.rsplit(".", 1)[0] for s in subs if s}) == 1:
                for i, s in zip(idxs, subs, strict=True):
                    keys[i] = s
                changed = True
    nodes_per: dict[str, int] = {}
    blocks_per: dict[str, set[str]] = {}
    for k in keys:
        if k is not None:
            pattern = re.sub(r"\d+", "*", k.rsplit(".", 1)[0] if "." in k else "")
            nodes_per[pattern] = nodes_per.get(pattern, 0) + 1
            blocks_per.setdefault(pattern, set()).add(k)
    ranked = sorted(nodes_per, key=lambda p: -nodes_per[p])  # stable: first seen wins ties
    if not ranked or len(blocks_per[ranked[0]]) < 2:
        return [None] * len(keys)
    n = len(keys)
    kept = {p for p in ranked
            if len(blocks_per[p]) >= 2 and (p == ranked[0] or nodes_per[p] >= _MAJOR_SHARE * n)}
    return [k if k is not None and re.sub(r"\d+", "*", k.rsplit(".", 1)[0] if "." in k else "")
            in kept else None for k in keys]


def model_layers(costs: CostGraph) -> tuple[Layer, ...]:
    """The graph's layers in order, covering every op node (see the module docstring).

    Args:
        costs: the cost graph.

    Returns:
        Contiguous layers; a block whose nodes are not contiguous gives one layer per run.
    """
    keys = _block_keys(costs)
    blocks = any(k is not None for k in keys)
    layers: list[Layer] = []
    start = 0
    for i in range(1, len(keys) + 1):
        if i < len(keys) and _run_key(costs, keys, i, blocks) == _run_key(costs, keys, start, blocks):
            continue
        key = keys[start]
        name = key if key is not None else (costs.nodes[start].module_path or "(top level)")
        layers.append(Layer(name, start, i, key is not None))
        start = i
    return tuple(layers)


def _run_key(costs: CostGraph, keys: list[str | None], i: int, blocks: bool) -> str | None:
    if blocks:
        return keys[i]
    return costs.nodes[i].module_path.split(".")[0]  # no blocks: runs of top-level modules
