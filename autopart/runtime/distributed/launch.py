"""What a rank of a torchrun launch needs before it builds its stages: its process group and
device, and its weights when the model was built on ``meta``."""

from __future__ import annotations

import datetime
import os
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from autopart.core.errors import PlanError

__all__ = ["init_from_env", "require_process_group", "rank_device", "materialise"]


_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def init_from_env(timeout_s: float = 600.0) -> bool:
    """Initialise the default process group from ``torchrun``'s environment when none exists.

    Under ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set)
    with no group yet: ``init_process_group`` with NCCL when CUDA is available (after
    ``torch.cuda.set_device(LOCAL_RANK)``), else gloo, rendezvous ``env://``; rank 0 says so
    once on stderr. A group the program made itself is left as it is.

    Args:
        timeout_s: the group's collective timeout, seconds (default 600, torch's NCCL default).

    Returns:
        True when this call made the group.

    Raises:
        PlanError: only some of the four variables are set (name the missing ones).
    """
    if not dist.is_available() or dist.is_initialized():
        return False
    present = [v for v in _TORCHRUN_VARS if os.environ.get(v)]
    if not present:
        return False
    if len(present) < len(_TORCHRUN_VARS):
        missing = [v for v in _TORCHRUN_VARS if v not in present]
        raise PlanError(f"{', '.join(present)} are set but {', '.join(missing)} are not; launch "
                        "with torchrun, or set all four, or call init_process_group yourself")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "nccl"
    else:
        backend = "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    if dist.get_rank() == 0:
        print(f"autopart: initialised the default process group ({backend}, "
              f"{dist.get_world_size()} ranks, from torchrun's environment)", file=sys.stderr,
              flush=True)
    return True


def require_process_group() -> None:
    """Check that this process is a rank of an initialised process group.

    Raises:
        PlanError: no process group is initialised.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise PlanError("backend='distributed' needs an initialised process group: launch with "
                        "torchrun (autopart.compile then initialises it) or call "
                        "torch.distributed.init_process_group() first")


def rank_device() -> torch.device:
    """This rank's device: ``cuda:LOCAL_RANK`` (made current) when CUDA is available, else cpu."""
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count()))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


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
