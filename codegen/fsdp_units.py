"""A stage's layers as submodules of their own: the units ZeRO-2/3 shards and gathers one by one.

A stage module from :func:`autopart.codegen.build_stages` is one flat ``fx.GraphModule``: a
layer's parameters are attributes at their FQNs (``transformer.h.3.attn.c_attn.weight``), read
by ``get_attr`` nodes, and the layer's ops are nodes of the stage's graph. FSDP2 gathers and
frees parameters around a module's ``forward`` (and its backward), so one ``fully_shard`` per
stage gathers the whole stage for every microbatch. :func:`group_layers` gives each layer of
a stack (the ops whose module path is under ``<stack>.<i>``, e.g. ``transformer.h.3``; the
same reading as the profiler's repeated blocks) a ``forward`` of its own: its nodes move into
an ``fx.GraphModule`` put at the layer's path, which holds the layer's tensors under their
relative names, and the stage's graph calls it. Every tensor keeps its FQN in the stage
module, so state dicts, checkpoints and the plan's placement are unchanged.

torchtitan applies ``fully_shard`` the same way, per transformer block and then to the whole
model (``torchtitan/models/llama3/infra/parallelize.py``, ``apply_fsdp``); there the blocks are
the model's own modules, here they are rebuilt from the captured graph.
"""

from __future__ import annotations

import operator

import torch.fx as fx

from autopart.codegen.recompute import written_by
from autopart.core.capturedgraph import node_module_path
from autopart.core.costgraph import layer_of_path

__all__ = ["group_layers", "layer_of"]

_OPS = ("call_function", "call_method", "call_module")


def layer_of(node: fx.Node) -> str | None:
    """The layer a node belongs to: ``"<stack>.<i>"`` of its module path (``"model.layers.3"``
    for an op under ``model.layers.3.mlp``), or None for an op outside every stack."""
    return layer_of_path(node_module_path(node))


def _runs(graph: fx.Graph) -> list[tuple[str, list[fx.Node]]]:
    """Maximal runs of consecutive op nodes of one layer (other node kinds between them do
    not break a run), in graph order."""
    runs: list[tuple[str, list[fx.Node]]] = []
    for node in graph.nodes:
        if node.op not in _OPS:
            continue
        key = layer_of(node)
        if key is None:
            runs.append(("", [node]))
        elif runs and runs[-1][0] == key:
            runs[-1][1].append(node)
        else:
            runs.append((key, [node]))
    return [(k, nodes) for k, nodes in runs if k]


def _writes_attribute(node: fx.Node) -> bool:
    """Whether the op writes a ``get_attr`` tensor in place (a buffer update, which the
    stage's recompute must find at the top of its graph)."""
    return any(src.op == "get_attr" for src in written_by(node))


def _output_written_after(nodes: list[fx.Node]) -> bool:
    """Whether an op after the run writes one of the run's values in place: FSDP2 hooks a
    unit's outputs for its backward, and an in-place op on one (a view, often) would drop
    that hook."""
    inside = set(nodes)
    return any(n in inside for node in nodes for user in node.users if user not in inside
               for n in written_by(user))


def _own_attributes(gm: fx.GraphModule, path: str, run: set[fx.Node]) -> list[fx.Node] | None:
    """The ``get_attr`` nodes of tensors under ``path`` when the run alone reads them and they
    are every tensor the module at ``path`` holds; else None (the layer stays inline)."""
    prefix = path + "."
    attrs = [n for n in gm.graph.nodes if n.op == "get_attr" and str(n.target).startswith(prefix)]
    if not attrs or any(u not in run for a in attrs for u in a.users):
        return None
    try:
        holder = gm.get_submodule(path)
    except AttributeError:
        return None
    held = {name for name, _ in holder.named_parameters(remove_duplicate=False)}
    held |= {name for name, _ in holder.named_buffers(remove_duplicate=False)}
    read = {str(a.target)[len(prefix):] for a in attrs}
    return attrs if held <= read else None


def _move(gm: fx.GraphModule, path: str, nodes: list[fx.Node], attrs: list[fx.Node]) -> None:
    """Replace ``nodes`` (one layer's ops, in graph order) and ``attrs`` by one call of a new
    ``fx.GraphModule`` at ``path`` that holds the layer's tensors and runs those ops."""
    inside = set(nodes) | set(attrs)
    inputs: list[fx.Node] = []
    for node in nodes:
        for arg in node.all_input_nodes:
            if arg not in inside and arg not in inputs:
                inputs.append(arg)
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for arg in inputs:
        env[arg] = sub.placeholder(arg.name)
        env[arg].meta = dict(arg.meta)
    prefix = len(path) + 1
    for attr in attrs:
        env[attr] = sub.get_attr(str(attr.target)[prefix:])
        env[attr].meta = dict(attr.meta)
    for node in nodes:
        env[node] = sub.node_copy(node, lambda n: env[n])
        if node.op == "call_module":  # a submodule under the layer (an experts call)
            env[node].target = str(node.target)[prefix:]
    sub.output(tuple(env[n] for n in outputs))
    holder = gm.get_submodule(path)
    layer = fx.GraphModule(holder, sub, class_name=f"Layer_{path.replace('.', '_')}")
    parent, _, name = path.rpartition(".")
    setattr(gm.get_submodule(parent) if parent else gm, name, layer)

    graph = gm.graph
    with graph.inserting_after(nodes[-1]):
        call = graph.call_module(path, tuple(inputs))
    call.meta = {k: v for k, v in nodes[0].meta.items() if k in ("nn_module_stack", "stack_trace")}
    call.meta["val"] = tuple(n.meta.get("val") for n in outputs)
    last = call
    for i, out in enumerate(outputs):
        with graph.inserting_after(last):
            item = graph.call_function(operator.getitem, (call, i))
        item.meta = {k: v for k, v in out.meta.items() if k in ("val", "tensor_meta")}
        out.replace_all_uses_with(item, delete_user_cb=lambda user: user not in inside)
        last = item
    for node in reversed([*attrs, *nodes]):
        graph.erase_node(node)


def group_layers(gm: fx.GraphModule) -> list[str]:
    """Move each layer of ``gm`` (a stage module) into a submodule at its path, in place.

    A layer is grouped when its ops are one run of consecutive op nodes, the tensors under
    its path are read by that run alone and are all the module at that path holds, every
    submodule it calls is under its path (an experts call, codegen/expert_parallel.py), none of
    its ops updates a tensor in place (a buffer write stays visible to the stage's
    recompute) and no later op writes one of its outputs in place (which would drop the
    backward hook FSDP2 puts on a unit's outputs). Others stay inline; the stage computes
    the same either way (the moved ops run in the same order on the same tensors).

    Args:
        gm: a stage's ``fx.GraphModule`` whose ``get_attr`` targets are FQNs.

    Returns:
        The paths of the grouped layers, in the order the stage runs them (each is now a
        submodule of ``gm`` whose ``forward`` takes the values it reads and returns a tuple
        of those read after it).
    """
    grouped: list[str] = []
    seen: dict[str, int] = {}
    runs = _runs(gm.graph)
    for key, _ in runs:
        seen[key] = seen.get(key, 0) + 1
    for key, nodes in runs:
        if (seen[key] != 1 or any(_writes_attribute(n) for n in nodes)
                or _output_written_after(nodes)
                or any(n.op == "call_module" and not str(n.target).startswith(key + ".")
                       for n in nodes)):
            continue
        attrs = _own_attributes(gm, key, set(nodes))
        if attrs is None:
            continue
        _move(gm, key, nodes, attrs)
        grouped.append(key)
    if grouped:
        gm.graph.lint()
        gm.recompile()
    return grouped

