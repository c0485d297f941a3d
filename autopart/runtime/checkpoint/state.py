"""CheckpointState: what a checkpoint reads and writes of one process's model."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from autopart.core.plan import Plan

__all__ = ["CheckpointState", "Checkpointable"]


@dataclass(frozen=True)
class CheckpointState:
    """One process's share of a model, as :mod:`autopart.runtime.checkpoint.save_load` sees it.

    Attributes:
        writes: canonical FQN -> tensor this process saves (each tensor once over all ranks,
            up to data-parallel replicas).
        holds: canonical FQN -> every tensor this process loads into (a tied parameter's
            replica on another rank included).
        params: ``id(parameter)`` -> canonical FQN, to re-key the optimizer's state.
        aliases: ``state_dict`` key -> canonical FQN (a tied name maps to its owner's).
        plan: the plan saved beside the tensors, or None (a plain model).
        distributed: saving and loading are collective over the default process group.
        device: where the collectives' small tensors live (the first stage's device).
        after_load: called once the tensors are loaded (refreshes tied replicas).
        whole: for a process whose tensors are pieces of whole ones (tensor- or
            ZeRO-sharded): ``(fqn, piece) -> whole tensor`` of that FQN's parameter or of an
            optimizer state tensor shaped like it (collective over the process's peers),
            applied to optimizer state on save; ``writes`` are whole already. None: nothing is
            split.
        part: the inverse, ``(fqn, whole) -> this process's piece``, applied to optimizer
            state on load (``holds`` are whole buffers that ``after_load`` cuts).
        optional: FQNs of ``holds`` a checkpoint may lack, which then keep their values: a
            plain module's non-persistent buffers (not in its ``state_dict``, derived from
            its config, e.g. a rotary embedding's ``original_inv_freq``, which a pipeline
            whose graph never reads it does not save).
    """

    writes: dict[str, torch.Tensor]
    holds: dict[str, torch.Tensor]
    params: dict[int, str]
    aliases: dict[str, str]
    plan: Plan | None
    distributed: bool
    device: torch.device
    after_load: Callable[[], None]
    whole: Callable[[str, torch.Tensor], torch.Tensor] | None = None
    part: Callable[[str, torch.Tensor], torch.Tensor] | None = None
    optional: frozenset[str] = frozenset()


@runtime_checkable
class Checkpointable(Protocol):
    """A model that describes its own checkpoint state (both runtimes' pipelines)."""

    def checkpoint_state(self) -> CheckpointState:
        """This process's share of the model (see :class:`CheckpointState`)."""
        ...
