"""Split a captured graph at cut positions into one fx.GraphModule per stage."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from autopart.core.capture import CapturedGraph, op_nodes
from autopart.core.capturedgraph import buffer_update_cuts
from autopart.core.errors import PlanError

__all__ = ["StageGraph", "split_graph", "stage_of_nodes", "crossing_names"]


@dataclass(frozen=True)
class StageGraph:
    """One stage's graph, before parameters are placed.

    Attributes:
        stage_index: 0..S-1.
        graph: takes ``input_names`` positionally, returns a tuple of ``output_names``
            (the last stage returns the model's flattened outputs instead).
        input_names: values received from the previous stage (stage 0: the graph inputs).
        output_names: values sent to the next stage; for the last stage, the names of the
            flattened model outputs (``""`` for a constant output such as ``None``).
        attr_targets: ``get_attr`` targets (in the captured module) this stage reads.
        node_names: names of its op nodes, in order.
    """

    stage_index: int
    graph: fx.Graph
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    attr_targets: tuple[str, ...]
    node_names: tuple[str, ...]


def stage_of_nodes(num_nodes: int, positions: list[int] | tuple[int, ...]) -> list[int]:
    """Stage index of each op node, for cuts at ``positions`` (cut k splits node k-1 | node k).

    Raises:
        PlanError: positions are not ascending within 1..num_nodes-1.
    """
    pos = list(positions)
    ascending = all(a < b for a, b in zip(pos, pos[1:], strict=False))
    if any(not 1 <= p <= num_nodes - 1 for p in pos) or not ascending:
        raise PlanError(f"cut positions {pos} must be strictly ascending within 1..{num_nodes - 1} "
                        f"(the graph has {num_nodes} op nodes); re-plan for this model")
    stage, out = 0, []
    for i in range(num_nodes):
        while stage < len(pos) and i >= pos[stage]:
            stage += 1
        out.append(stage)
    return out


def _value_nodes(arg: Any) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg(arg, lambda n: found.append(n) or n)
    return found


def crossing_names(captured: CapturedGraph, positions: list[int] | tuple[int, ...]) -> list[list[str]]:
    """For each cut, the names of the values crossing it (produced before, used after).

    Graph inputs count as produced before every cut; ``get_attr`` values never cross
    (each stage reads its own parameters). A value used after several cuts crosses each
    of them, so stages in between pass it through. Order: graph inputs in call order,
    then nodes in topological order.
    """
    graph = captured.graph_module.graph
    ops = op_nodes(graph)
    index = {n: i for i, n in enumerate(ops)}
    n = len(ops)
    produced: dict[fx.Node, int] = {}
    order: list[fx.Node] = []
    for node in graph.nodes:
        if node.op == "placeholder":
            produced[node] = -1
            order.append(node)
        elif node in index:
            produced[node] = index[node]
            order.append(node)
    last_use: dict[fx.Node, int] = {}
    for node in graph.nodes:
        use_at = n if node.op == "output" else index.get(node)
        if use_at is None:
            continue
        for arg in _value_nodes((node.args, node.kwargs)):
            if arg in produced:
                last_use[arg] = max(last_use.get(arg, -1), use_at)
    return [[v.name for v in order if produced[v] < k <= last_use.get(v, -2)] for k in positions]


def split_graph(captured: CapturedGraph, positions: list[int] | tuple[int, ...]) -> list[StageGraph]:
    """Split the captured graph at ``positions`` into ``len(positions) + 1`` stage graphs.

    Raises:
        PlanError: bad positions, a cut separates a multi-output op (tuple) from its
            ``getitem`` users, or a buffer's in-place update from an op reading it before
            (:func:`autopart.core.capturedgraph.buffer_update_cuts`); the message names the
            value and the fix.
    """
    graph = captured.graph_module.graph
    ops = op_nodes(graph)
    if bad := sorted(set(positions) & buffer_update_cuts(graph)):
        raise PlanError(
            f"cut at position {bad[0]} separates a buffer's in-place update from an op that "
            "reads the buffer before it (a stage ahead would read it before the previous "
            "microbatch's update); move the cut before the first op reading the buffer or "
            "after its update, or profile again (profiles rule these positions out)")
    stage_of = stage_of_nodes(len(ops), positions)
    crossings = crossing_names(captured, positions)
    by_name = {node.name: node for node in graph.nodes}
    for k, names in zip(positions, crossings, strict=True):
        for name in names:
            val = by_name[name].meta.get("val")
            if by_name[name].op != "placeholder" and not isinstance(val, torch.Tensor):
                raise PlanError(
                    f"cut at position {k} would send {name!r}, a {type(val).__name__} (not a "
                    "tensor), between stages; move the cut so the op producing it and its users "
                    "stay in one stage")
    placeholders = [n.name for n in graph.nodes if n.op == "placeholder"]
    output_node = next(n for n in graph.nodes if n.op == "output")
    num_stages = len(positions) + 1
    stages: list[StageGraph] = []
    for s in range(num_stages):
        inputs = placeholders if s == 0 else crossings[s - 1]
        g = fx.Graph()
        env: dict[str, fx.Node] = {name: g.placeholder(name) for name in inputs}
        for name in inputs:
            env[name].meta = dict(by_name[name].meta)
        attrs: dict[str, fx.Node] = {}

        def lookup(node: fx.Node, g: fx.Graph = g, env: dict[str, fx.Node] = env,
                   attrs: dict[str, fx.Node] = attrs, s: int = s) -> fx.Node:
            if node.op == "get_attr":
                target = str(node.target)
                if target not in attrs:
                    attrs[target] = g.get_attr(captured.attr_fqns.get(target, target))
                    attrs[target].meta = dict(node.meta)
                return attrs[target]
            if node.name not in env:
                raise PlanError(f"stage {s} needs {node.name!r} but does not receive it")
            return env[node.name]

        mine = [node for node, st in zip(ops, stage_of, strict=True) if st == s]
        for node in mine:
            env[node.name] = g.node_copy(node, lookup)
        if s == num_stages - 1:
            flat = output_node.args[0]
            outs = tuple(lookup(a) if isinstance(a, fx.Node) else a for a in flat)
            out_names = tuple(a.name if isinstance(a, fx.Node) else "" for a in flat)
        else:
            out_names = tuple(crossings[s])
            outs = tuple(env[name] for name in out_names)
        g.output(outs)
        g.lint()
        stages.append(StageGraph(stage_index=s, graph=g, input_names=tuple(inputs),
                                 output_names=out_names, attr_targets=tuple(attrs),
                                 node_names=tuple(n.name for n in mine)))
    return stages

