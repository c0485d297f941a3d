"""Optimizer state in a checkpoint: re-keyed from parameter positions to FQNs on save, and
back onto whatever optimizer holds the parameters on load."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from autopart.core.errors import CheckpointError
from autopart.runtime.checkpoint._files import OPT
from autopart.runtime.checkpoint.state import CheckpointState

__all__ = ["optimizer_state", "optimizer_buffers", "restore_optimizer"]


def optimizer_state(optimizer: torch.optim.Optimizer, target: CheckpointState,
                     ) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]],
                                dict[str, dict[str, Any]]]:
    """Optimizer state re-keyed from positions to FQNs: DCP tensors, JSON param groups
    (``params`` as FQNs) and JSON non-tensor state entries, of the parameters this process
    writes."""
    sd = optimizer.state_dict()
    order = [p for g in optimizer.param_groups for p in g["params"]]
    fqns = []
    for p in order:
        if id(p) not in target.params:
            raise CheckpointError(f"the optimizer holds a {tuple(p.shape)} tensor that is not a "
                                  "parameter of the pipeline; build it from pipe.parameters()")
        fqns.append(target.params[id(p)])
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for index, entries in sorted(sd["state"].items()):  # one order on every peer (whole)
        fqn = fqns[index]
        if fqn not in target.writes:
            continue
        for name, value in sorted(entries.items()):
            if isinstance(value, torch.Tensor):
                tensors[f"{OPT}{fqn}.{name}"] = (value.detach() if target.whole is None
                                                 else target.whole(fqn, value))
            else:
                scalars.setdefault(fqn, {})[name] = _json_value(value, f"state {name} of {fqn}")
    groups = []
    for group in sd["param_groups"]:
        hyper = {k: _json_value(v, f"param group option {k}") for k, v in group.items()
                 if k != "params"}
        groups.append({**hyper, "params": [fqns[i] for i in group["params"]]})
    return tensors, groups, scalars


def _json_value(value: Any, what: str) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"optimizer {what} = {value!r:.60} is not JSON-serialisable; "
                              "checkpoints store optimizer options as JSON") from exc


def optimizer_buffers(optimizer: torch.optim.Optimizer, target: CheckpointState,
                       metadata: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Empty tensors (saved shape and dtype) for the optimizer state of every parameter the
    optimizer holds, under their DCP keys."""
    by_fqn: dict[str, list[str]] = {}
    for key in metadata:
        if key.startswith(OPT):  # optim.state.<fqn>.<name>; state names have no dots
            owner, name = key[len(OPT):].rsplit(".", 1)
            by_fqn.setdefault(owner, []).append(name)
    out: dict[str, torch.Tensor] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            fqn = target.params.get(id(p))
            if fqn is None:
                raise CheckpointError(f"the optimizer holds a {tuple(p.shape)} tensor that is "
                                      "not a parameter of the model; build it from "
                                      "pipe.parameters()")
            for name in by_fqn.get(fqn, []):
                m = metadata[f"{OPT}{fqn}.{name}"]
                out[f"{OPT}{fqn}.{name}"] = torch.empty(tuple(m.size), dtype=m.properties.dtype)
    return out


def restore_optimizer(optimizer: torch.optim.Optimizer, target: CheckpointState, state: dict[str, Any],
                       saved: dict[str, Any], folder: Path) -> None:
    current = optimizer.state_dict()
    order = [p for g in optimizer.param_groups for p in g["params"]]
    new_state: dict[int, dict[str, Any]] = {}
    loaded: dict[str, dict[str, Any]] = {}
    for key, value in state.items():
        if key.startswith(OPT):
            fqn, name = key[len(OPT):].rsplit(".", 1)
            loaded.setdefault(fqn, {})[name] = (value if target.part is None
                                                else target.part(fqn, value))
    for index, p in enumerate(order):
        fqn = target.params[id(p)]
        entries = {**loaded.get(fqn, {}), **saved["scalars"].get(fqn, {})}
        if entries:
            new_state[index] = entries
    group_of: dict[str, dict[str, Any]] = {}
    for g in saved["groups"]:
        for fqn in g["params"]:
            group_of.setdefault(fqn, g)
    new_groups = []
    for group, mine in zip(current["param_groups"], optimizer.param_groups, strict=True):
        first = target.params[id(mine["params"][0])] if mine["params"] else None
        theirs = group_of.get(first) if first is not None else None
        if theirs is None and first is not None:
            raise CheckpointError(f"checkpoint {folder} has no optimizer param group holding "
                                  f"{first!r}; it was saved with another optimizer set-up")
        restored = dict(group)
        for k, v in (theirs or {}).items():
            if k != "params" and k in group:
                restored[k] = tuple(v) if isinstance(group[k], tuple) else v
        new_groups.append(restored)
    optimizer.load_state_dict({"state": new_state, "param_groups": new_groups})
