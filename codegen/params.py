"""Parameter ownership: each stage holds only what it reads; tied parameters are replicated."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from autopart.codegen.split import StageGraph
from autopart.core.capture import CapturedGraph
from autopart.core.errors import PlanError

__all__ = ["Placement", "build_stage_modules", "retarget_device_literals"]


@dataclass
class Placement:
    """Where each parameter and buffer lives after codegen.

    Attributes:
        owner: canonical FQN -> stage index that owns it (first stage to read it).
        replicas: canonical FQN -> other stage indices holding a copy. Parameter replicas
            are separate tensors whose gradients the runtime sums into the owner's;
            buffer replicas share the owner's tensor when on the same device.
        tensors: (stage index, FQN) -> the tensor that stage reads.
    """

    owner: dict[str, int] = field(default_factory=dict)
    replicas: dict[str, list[int]] = field(default_factory=dict)
    tensors: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)


def _attr_root(tensors: dict[str, torch.Tensor], buffers: set[str]) -> nn.Module:
    """An nn.Module tree holding ``tensors`` under their dotted FQNs."""
    root = nn.Module()
    for fqn, value in tensors.items():
        *path, leaf = fqn.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, nn.Module())
            mod = getattr(mod, part)
        if isinstance(value, nn.Parameter):
            mod.register_parameter(leaf, value)
        else:
            mod.register_buffer(leaf, value, persistent=fqn in buffers)
    return root


def _to_device(value: torch.Tensor, device: torch.device, copy: bool) -> torch.Tensor:
    if isinstance(value, nn.Parameter):
        if not copy and value.device == device:
            return value
        data = value.detach().to(device, copy=True)
        return nn.Parameter(data, requires_grad=value.requires_grad)
    if not copy and value.device == device:
        return value
    return value.detach().to(device, copy=True)


def build_stage_modules(captured: CapturedGraph, stage_graphs: list[StageGraph],
                        devices: list[torch.device], *, keep: set[int] | None = None,
                        tensor_of: Callable[[str], torch.Tensor] | None = None,
                        ) -> tuple[list[fx.GraphModule | None], Placement]:
    """Turn stage graphs into ``fx.GraphModule``s on their devices, each owning its tensors.

    The owner stage keeps the model's own tensor when it already sits on that stage's device
    (no copy: the pipeline and the model share storage, as torchgpipe does); otherwise it
    gets a copy on its device. A parameter read by several stages (GPT-2's tied ``wte`` and
    ``lm_head``) is replicated into every later stage that reads it.

    Args:
        captured: the captured model.
        stage_graphs: from :func:`autopart.codegen.split.split_graph`.
        devices: one device per stage.
        keep: build only these stages (a rank of a multi-process pipeline); the others are
            ``None`` in the result, but ownership is still decided over all stages. A kept
            stage whose tensor's owner is not kept takes the tensor itself (it is that
            rank's copy), and kept stages on one device that read the same tensor share it
            (interleaved GPT-2 with the embedding and the tied head on one rank: one
            parameter, one gradient).
        tensor_of: where a tensor comes from, by canonical FQN; default: the captured
            graph's own attribute (the model's tensor).

    Returns:
        The stage modules (class names ``Stage0``..) and the placement of every tensor.
    """
    if len(devices) != len(stage_graphs):
        raise PlanError(f"{len(stage_graphs)} stage graphs but {len(devices)} devices; pass one "
                        "device per stage")
    placement = Placement()
    modules: list[fx.GraphModule | None] = []
    # with ``keep`` (one process's stages): the tensor already built for an FQN on a device
    built_on: dict[tuple[str, torch.device], torch.Tensor] = {}
    for sg, device in zip(stage_graphs, devices, strict=True):
        built = keep is None or sg.stage_index in keep
        tensors: dict[str, torch.Tensor] = {}
        persistent: set[str] = set()
        for target in sg.attr_targets:
            fqn = captured.attr_fqns.get(target, target)
            first = fqn not in placement.owner
            if first:
                placement.owner[fqn] = sg.stage_index
            else:
                placement.replicas.setdefault(fqn, []).append(sg.stage_index)
            if not built:
                continue
            original = tensor_of(fqn) if tensor_of is not None else captured.attr_value(target)
            owner_key = (placement.owner[fqn], fqn)
            shared = built_on.get((fqn, device)) if keep is not None else None
            if shared is not None:
                # one process's stages share one tensor: both readers' gradients accumulate
                # into its .grad and its optimizer updates every reader
                value = shared
            elif first or owner_key not in placement.tensors:
                value = _to_device(original, device, copy=False)
            else:
                # Parameters get their own replica (own .grad); buffers and constants are
                # shared when the device allows, so in-place updates reach every reader.
                value = _to_device(placement.tensors[owner_key], device,
                                   copy=isinstance(original, nn.Parameter))
            placement.tensors[(sg.stage_index, fqn)] = value
            built_on.setdefault((fqn, device), value)
            tensors[fqn] = value
            if fqn in captured.buffers:
                persistent.add(fqn)
        if not built:
            modules.append(None)
            continue
        root = _attr_root(tensors, persistent)
        retarget_device_literals(sg.graph, device)
        gm = fx.GraphModule(root, sg.graph, class_name=f"Stage{sg.stage_index}")
        modules.append(gm)
    return modules, placement


def retarget_device_literals(graph: fx.Graph, device: torch.device) -> int:
    """Point every device literal of the graph's ops at ``device``; return how many changed.

    ``torch.export`` records the device a tensor was made on as a literal
    (``arange(..., device=cpu)`` for GPT-2's position ids, ``_to_copy(x, device=...)``,
    ``_assert_tensor_metadata(..., device=meta)``), so a graph captured on the CPU or on
    ``meta`` would make those tensors there while its stage runs on a GPU (``index_select``:
    "index is on cpu, different from other tensors on cuda:0"). A stage runs on one device,
    so every literal becomes that device, as the profiler does when it replays nodes.
    """
    changed = 0

    def swap(value: Any) -> Any:
        nonlocal changed
        if isinstance(value, torch.device) and value != device:
            changed += 1
            return device
        return value

    for node in graph.nodes:
        if node.op in ("call_function", "call_method"):
            node.args = fx.node.map_aggregate(node.args, swap)
            node.kwargs = fx.node.map_aggregate(node.kwargs, swap)
    return changed
