"""compile() for a torchrun launch: agree on one plan, capture, and build this rank's stages."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn

from autopart.core.capture import CapturedGraph, capture
from autopart.core.errors import PlanError
from autopart.core.plan import Plan

__all__ = ["compile_distributed"]


def _device() -> torch.device:
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count()))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def _on_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))


def _checkpoint_tensors(directory: str | os.PathLike[str]) -> Any:
    """FQN -> tensor, read lazily from a ``pipe.save`` directory (only what is asked for)."""
    from safetensors import safe_open

    from autopart.runtime.checkpoint import _current

    folder = _current(Path(directory))
    manifest = json.loads((folder / "manifest.json").read_text(encoding="utf-8"))

    def tensor_of(fqn: str) -> torch.Tensor:
        if fqn not in manifest["stage_of"]:
            raise PlanError(f"checkpoint {folder} has no tensor {fqn!r}; it is from another model")
        path = folder / f"stage_{manifest['stage_of'][fqn]}.safetensors"
        with safe_open(str(path), framework="pt") as f:
            return nn.Parameter(f.get_tensor(fqn))

    return tensor_of


def _initialise(model: nn.Module, fqns: set[str], device: torch.device) -> Any:
    """Materialise only the modules holding ``fqns`` (meta -> device) and initialise them."""
    owners = {fqn.rpartition(".")[0] for fqn in fqns}
    init = getattr(model, "_init_weights", None)
    for name in sorted(owners):
        module = model.get_submodule(name) if name else model
        module.to_empty(device=device, recurse=False)
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
        elif callable(init):
            init(module)

    def tensor_of(fqn: str) -> torch.Tensor:
        try:
            return model.get_parameter(fqn)
        except AttributeError:
            return model.get_buffer(fqn)

    return tensor_of


def _retarget_device(captured: CapturedGraph, device: torch.device) -> None:
    """Point ops that a meta-device capture pinned to ``meta`` (``arange(..., device=meta)``,
    ``_assert_tensor_metadata(..., device=meta)``) at the device the stages run on."""
    changed = False
    for node in captured.graph_module.graph.nodes:
        if isinstance(node.kwargs.get("device"), torch.device) and node.kwargs["device"].type == "meta":
            node.kwargs = {**node.kwargs, "device": device}
            changed = True
    if changed:
        captured.graph_module.recompile()


def compile_distributed(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *,
                        loss_fn: Any, plan: Plan | str | os.PathLike[str] | None,
                        num_microbatches: int | None, schedule: str | None,
                        stages_per_rank: int | None, recompute: bool | None, optimize: str,
                        checkpoint: str | os.PathLike[str] | None, mesh: Any,
                        time_limit_s: float) -> Any:
    """See :func:`autopart.compile` with ``backend="distributed"``.

    Without a plan, rank 0 profiles and solves (on a materialised model) and sends the plan
    to every rank as JSON, so all ranks follow one decision.
    """
    from autopart.api import _microbatch_inputs, _solve
    from autopart.runtime.distributed import DistributedPipeline, broadcast_plan

    if not (dist.is_available() and dist.is_initialized()):
        raise PlanError("backend='distributed' needs an initialised process group: launch with "
                        "torchrun and call torch.distributed.init_process_group() first")
    pp_group = mesh.get_group("pp") if mesh is not None else None
    dp_group = mesh.get_group("dp") if mesh is not None else None
    pp_size = dist.get_world_size(pp_group)
    pp_rank = dist.get_rank(pp_group)
    device = _device()
    if plan is None:
        mine = None
        if dist.get_rank() == 0:
            if _on_meta(model):
                raise PlanError("a meta-device model cannot be profiled here; plan it first "
                                "(autopart.compile on a materialised copy, or `autopart plan`) "
                                "and pass plan=")
            choices = {"schedule_kind": schedule, "stages_per_rank": stages_per_rank,
                       "recompute": recompute}
            mine, _ = _solve(model, args, kwargs, ["cpu"] * pp_size if device.type == "cpu"
                             else [f"cuda:{i}" for i in range(pp_size)], num_microbatches,
                             optimize, loss_fn is not None, time_limit_s, {}, choices)
        the_plan = broadcast_plan(mine)  # from global rank 0 to every rank
    else:
        the_plan = plan if isinstance(plan, Plan) else Plan.load(plan)
    mb_args, mb_kwargs = _microbatch_inputs(args, kwargs, the_plan.num_microbatches)
    meta = _on_meta(model)
    if meta:
        mb_args, mb_kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"),
                                                  (mb_args, mb_kwargs))
    captured = capture(model, mb_args, mb_kwargs)
    if meta:
        _retarget_device(captured, device)
    tensor_of = None
    if checkpoint is not None:
        tensor_of = _checkpoint_tensors(checkpoint)
    elif meta:
        local = {st.stage_index for st in the_plan.stages if st.rank == pp_rank}
        from autopart.codegen.split import split_graph

        needed = {captured.attr_fqns.get(t, t) for sg in split_graph(
            captured, [c.position for c in the_plan.cuts]) if sg.stage_index in local
            for t in sg.attr_targets}
        tensor_of = _initialise(model, needed, device)
    return DistributedPipeline(model, captured, the_plan, device, loss_fn=loss_fn,
                               pp_group=pp_group, dp_group=dp_group, tensor_of=tensor_of)
