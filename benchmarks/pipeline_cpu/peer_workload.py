"""The workload contract of ``peers.py``: one model, every arm's view of it.

``lm_workloads.py`` (the language models) and ``workloads.py`` (the CNN, encoder-decoder and
heterogeneous models) each define ``WORKLOADS: dict[str, PeerWorkload]``; ``peers.py`` runs
every arm of each on two gloo ranks. Every rank process calls ``build`` itself, so ``build``
seeds itself (seed 0): every rank and every arm start from the same weights and data.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["PeerWorkload"]


@dataclass(frozen=True)
class PeerWorkload:
    """One benchmark row of ``peers.py``.

    Attributes:
        name: the row's key, e.g. ``"gpt2_balanced"``.
        description: one line for the report.
        batch: full-batch rows (dim 0 of every input and of the target).
        num_microbatches: m, the same for every arm; must divide ``batch``.
        build: seeded (seed 0) ``() -> (model, example_inputs, target, loss_fn)`` for the full
            batch, as :data:`autopart.apps.bench.Workload`; ``loss_fn(model(*example_inputs),
            target)`` is the scalar loss.
        ds_layers: ``model -> layers`` for ``deepspeed.pipe.PipelineModule`` that compute
            ``model(*inputs)`` exactly with ``model``'s weights (``nn.Module`` instances and/or
            ``LayerSpec`` / ``TiedLayerSpec``; tied weights through ``TiedLayerSpec``).
        ds_loss_fn: ``(last DS layer's output, labels) -> loss``.
        ds_batch: ``(example_inputs, target) -> (inputs, labels)`` as DeepSpeed's data iterator
            yields them (a tensor or a tuple of tensors, and a tensor); ``peers.py`` slices both
            into m microbatches along dim 0.
        ds_type_regex: the block layer's class name, for ``partition_method="type:<regex>"``.
        hand_split: ``model -> {fqn: SplitPoint.BEGINNING}`` cutting the model's repeated
            blocks into two equal halves (the split users write by hand); fqns are the
            model's own.
    """

    name: str
    description: str
    batch: int
    num_microbatches: int
    build: Callable[[], tuple[nn.Module, tuple[Any, ...], Any, Callable[[Any, Any], torch.Tensor]]]
    ds_layers: Callable[[nn.Module], list[Any]]
    ds_loss_fn: Callable[[Any, Any], torch.Tensor]
    ds_batch: Callable[[tuple[Any, ...], Any], tuple[Any, Any]]
    ds_type_regex: str
    hand_split: Callable[[nn.Module], dict[str, Any]]
