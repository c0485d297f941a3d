"""A tiny deterministic training loop shared by the checkpoint tests (one process and the
spawned workers): GPT-2 from tests.zoo, AdamW with weight-decay groups, clipping."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

MAX_NORM = 0.05  # below GPT-2's first gradient norms (~1-3): every step clips
LR = 1e-3


def batch(step: int) -> tuple[tuple[torch.Tensor], torch.Tensor]:
    """Step ``step``'s tokens and targets, (8, 16) each, the same in every process."""
    g = torch.Generator().manual_seed(1000 + step)
    return (torch.randint(0, 512, (8, 16), generator=g),), torch.randint(0, 512, (8, 16), generator=g)


def adamw(named: Any) -> torch.optim.AdamW:
    """AdamW with two param groups: weight decay on matrices, none on biases and norms."""
    params = list(named)
    decay = [p for _, p in params if p.dim() >= 2]
    rest = [p for _, p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                              {"params": rest, "weight_decay": 0.0}], lr=LR)


def scrambled(model: nn.Module) -> nn.Module:
    """``model`` with every weight changed, so a resume that loads nothing is caught."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)
    return model


def train(step_fn: Any, clip: Any, opt: torch.optim.Optimizer, steps: range) -> list[float]:
    """``step_fn(args, target) -> loss`` then clip, step, zero_grad, for each step."""
    losses = []
    for step in steps:
        args, target = batch(step)
        loss = step_fn(args, target)
        norm = clip(MAX_NORM)
        assert float(norm) > MAX_NORM, f"step {step}: norm {float(norm)} is not clipped"
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    return losses


def plain_step(model: nn.Module, loss_fn: Any) -> Any:
    def step(args: Any, target: Any) -> torch.Tensor:
        loss = loss_fn(model(*args), target)
        loss.backward()
        return loss.detach()
    return step


def optimizer_state(named: Any, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """``<fqn>.<name>`` -> optimizer state tensor, plus ``<fqn>.lr`` / ``.weight_decay``."""
    out = {}
    group_of = {id(p): g for g in opt.param_groups for p in g["params"]}
    for fqn, p in named:
        for name, value in opt.state.get(p, {}).items():
            out[f"{fqn}.{name}"] = torch.as_tensor(value).detach().clone()
        g = group_of[id(p)]
        out[f"{fqn}.weight_decay"] = torch.tensor(float(g["weight_decay"]))
        out[f"{fqn}.lr"] = torch.tensor(float(g["lr"]))
    return out
