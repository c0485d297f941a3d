"""What a rank of a torchrun launch needs before it builds its stages: its process group and
device, and its weights when the model was built on ``meta``."""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from autopart.core.capture import CapturedGraph
from autopart.core.errors import PlanError
from autopart.core.jsonio import dumps
from autopart.core.plan import Plan

__all__ = ["require_process_group", "broadcast_plan", "rank_device", "on_meta", "retarget_meta",
           "materialise"]


def require_process_group() -> None:
    """Check that this process is a rank of an initialised process group.

    Raises:
        PlanError: no process group is initialised.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise PlanError("backend='distributed' needs an initialised process group: launch with "
                        "torchrun and call torch.distributed.init_process_group() first")


def rank_device() -> torch.device:
    """This rank's device: ``cuda:LOCAL_RANK`` (made current) when CUDA is available, else cpu."""
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count()))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def on_meta(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is on the ``meta`` device."""
    return any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))


def retarget_meta(captured: CapturedGraph, device: torch.device) -> None:
    """Point ops that a meta-device capture pinned to ``meta`` (``arange(..., device=meta)``,
    ``_assert_tensor_metadata(..., device=meta)``) at the device the stages run on."""
    changed = False
    for node in captured.graph_module.graph.nodes:
        if isinstance(node.kwargs.get("device"), torch.device) and node.kwargs["device"].type == "meta":
            node.kwargs = {**node.kwargs, "device": device}
            changed = True
    if changed:
        captured.graph_module.recompile()


def materialise(model: nn.Module, device: torch.device) -> Callable[[str], torch.Tensor]:
    """A ``tensor_of`` for :func:`autopart.codegen.build_stages` that materialises, on first
    request, only the module holding the tensor asked for (meta -> ``device``) and
    initialises it (``reset_parameters``, else Hugging Face's ``_init_weights``). Codegen
    asks only for the tensors of the stages it builds, so nothing else leaves ``meta``.

    Returns:
        canonical FQN -> the materialised parameter or buffer.
    """
    init = getattr(model, "_init_weights", None)
    done: set[str] = set()

    def tensor_of(fqn: str) -> torch.Tensor:
        owner = fqn.rpartition(".")[0]
        if owner not in done:
            module = model.get_submodule(owner) if owner else model
            module.to_empty(device=device, recurse=False)
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
            elif callable(init):
                init(module)
            done.add(owner)
        try:
            return model.get_parameter(fqn)
        except AttributeError:
            return model.get_buffer(fqn)

    return tensor_of


def broadcast_plan(plan: Plan | None, src: int = 0, group: dist.ProcessGroup | None = None) -> Plan:
    """Send ``src``'s plan to every rank as JSON bytes (validated on receipt, never pickled)."""
    payload = dumps(plan.to_dict()).encode() if plan is not None else b""
    size = torch.tensor([len(payload)], dtype=torch.int64)
    dist.broadcast(size, src=src, group=group)
    data = torch.zeros(int(size.item()), dtype=torch.uint8)
    if plan is not None:
        data.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    dist.broadcast(data, src=src, group=group)
    return Plan.from_dict(json.loads(bytes(data.tolist()).decode()))
