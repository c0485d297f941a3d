"""Pipeline: what every runtime's partitioned model offers, whichever backend built it."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from autopart.core.plan import Plan
from autopart.core.signature import InputSignature

__all__ = ["Pipeline"]


@runtime_checkable
class Pipeline(Protocol):
    """The partitioned model :func:`autopart.compile` returns.

    Implemented by :class:`autopart.PipelinedModule` (one process, every stage) and
    :class:`autopart.DistributedPipeline` (one rank of a ``torchrun`` launch, its stages).

    Attributes:
        plan: the plan it runs.
        signature: the inputs and outputs it was compiled for.
        timings_s: seconds spent per compile phase (``capture_s``, ``profile_s``,
            ``split_cost_s``, ``solve_s``, ``codegen_s``; phases not run are absent).
    """

    plan: Plan
    signature: InputSignature
    timings_s: dict[str, float]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Pipelined inference; the output has the model's structure."""
        ...

    def train_step(self, *args: Any, target: Any = None, **kwargs: Any) -> torch.Tensor:
        """Forward and backward of every microbatch; returns the mean loss (0-dim)."""
        ...

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """The parameters this process holds, each once (what an optimizer takes)."""
        ...

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        """Those parameters under the original model's FQNs."""
        ...

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Tensors this process holds, under the original model's FQNs."""
        ...

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True,
                        assign: bool = False) -> Any:
        """Copy values in by the original model's FQNs."""
        ...

    def stage_sources(self) -> dict[int, str]:
        """Stage index -> generated source of each stage this process holds."""
        ...

    def save_plan(self, path: str | os.PathLike[str]) -> list[Path]:
        """Write the plan and this process's stage sources; returns the paths written."""
        ...
