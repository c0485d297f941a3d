"""Checkpoints: one safetensors file per stage plus the plan, written atomically, loadable anywhere."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from autopart.core.errors import CheckpointError
from autopart.core.jsonio import dumps, write_text_atomic
from autopart.core.plan import Plan

if TYPE_CHECKING:
    from autopart.runtime.local import PipelinedModule

__all__ = ["save_checkpoint", "read_checkpoint", "checkpoint_tensors", "current_checkpoint",
           "CHECKPOINT_FORMAT"]

CHECKPOINT_FORMAT = 1
_LATEST = "latest"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(pipe: PipelinedModule, directory: str | os.PathLike[str]) -> Path:
    """Write ``pipe``'s weights (one ``stage_<s>.safetensors`` per stage) and plan.

    Layout: ``directory/ckpt-<n>/`` holds ``plan.json``, ``manifest.json`` and the stage
    files; ``directory/latest`` names the current ``ckpt-<n>``. A new checkpoint is
    written to a temporary folder, renamed into place, and only then does ``latest``
    move to it (an atomic file replace); older checkpoints are removed after that. A crash
    at any point leaves the previous checkpoint complete and ``latest`` pointing at it.

    Each stage file holds the tensors that stage owns, under the original model's FQNs
    (tied replicas are not stored twice); parameters the graph never reads go with stage 0.

    Returns:
        The new ``ckpt-<n>`` folder.
    """
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    previous = sorted(p for p in root.glob("ckpt-*") if p.is_dir() and p.name[5:].isdigit())
    number = int(previous[-1].name[5:]) + 1 if previous else 0
    final = root / f"ckpt-{number:06d}"
    tmp = root / f".ckpt-{number:06d}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        owned = pipe.owned_tensors()
        for stage_index, tensors in owned.items():
            path = tmp / f"stage_{stage_index}.safetensors"
            save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(path))
        manifest = {"format": CHECKPOINT_FORMAT, "graph_fingerprint": pipe.plan.graph_fingerprint,
                    "state_keys": [[k, fqn] for k, fqn in pipe.state_layout()],
                    "stage_of": {fqn: s for s, tensors in owned.items() for fqn in tensors},
                    "shapes": {fqn: list(t.shape) for tensors in owned.values()
                               for fqn, t in tensors.items()}}
        write_text_atomic(tmp / "manifest.json", dumps(manifest))
        pipe.plan.save(tmp / "plan.json")
        _fsync_dir(tmp)
        os.replace(tmp, final)
        _fsync_dir(root)
        write_text_atomic(root / _LATEST, final.name + "\n")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in previous:
        shutil.rmtree(old, ignore_errors=True)
    return final


def current_checkpoint(root: Path) -> Path:
    """The ``ckpt-<n>`` folder that ``root/latest`` names.

    Raises:
        CheckpointError: no ``latest`` pointer, or it names a folder without a manifest.
    """
    pointer = root / _LATEST
    if not pointer.is_file():
        raise CheckpointError(f"{root} is not an autopart checkpoint (no 'latest' file); pass a "
                        "directory written by pipe.save(...)")
    folder = root / pointer.read_text(encoding="utf-8").strip()
    if not (folder / "manifest.json").is_file():
        raise CheckpointError(f"{root}/latest points at {folder.name}, which has no manifest.json; "
                        "the checkpoint is damaged")
    return folder


def _check_model(manifest: dict[str, Any], model: nn.Module, folder: Path) -> None:
    theirs: dict[str, list[int]] = manifest["shapes"]
    ours = {k: list(v.shape) for k, v in list(model.named_parameters()) + list(model.named_buffers())}
    missing = sorted(set(ours) - set(theirs))
    unexpected = sorted(set(theirs) - set(ours))
    shapes = sorted(k for k in set(ours) & set(theirs) if ours[k] != theirs[k])
    if missing or unexpected or shapes:
        detail = "; ".join(part for part in (
            f"missing from checkpoint: {missing[:5]}" if missing else "",
            f"not in the model: {unexpected[:5]}" if unexpected else "",
            "shape differs: " + ", ".join(f"{k} {theirs[k]} vs model {ours[k]}" for k in shapes[:5])
            if shapes else "") if part)
        raise CheckpointError(f"checkpoint {folder} is from another model ({detail}); load it into "
                        "the model it was saved from")


def read_checkpoint(directory: str | os.PathLike[str], model: nn.Module,
                    ) -> tuple[dict[str, torch.Tensor], Plan]:
    """Read a checkpoint written by ``pipe.save(directory)``, checked against ``model``.

    Args:
        directory: the checkpoint directory.
        model: a model of the same architecture (its names and shapes are compared).

    Returns:
        The model's ``state_dict`` (every key, tied names included) and the saved plan.

    Raises:
        CheckpointError: not a checkpoint, a damaged one, an unsupported format, or one
            saved from another model (the message lists the tensors that differ).
    """
    folder = current_checkpoint(Path(directory))
    manifest = _manifest(folder)
    _check_model(manifest, model, folder)
    tensors: dict[str, torch.Tensor] = {}
    for stage_index in sorted(set(manifest["stage_of"].values())):
        tensors.update(load_file(str(folder / f"stage_{stage_index}.safetensors")))
    state = {key: tensors[fqn] for key, fqn in manifest["state_keys"]}
    return state, Plan.load(folder / "plan.json")


def checkpoint_tensors(directory: str | os.PathLike[str]) -> Callable[[str], torch.Tensor]:
    """FQN -> tensor, read lazily from a ``pipe.save`` directory (only what is asked for),
    for a rank that materialises only its own stages.

    Raises:
        CheckpointError: not a checkpoint, or (when called) a tensor it does not hold.
    """
    folder = current_checkpoint(Path(directory))
    manifest = _manifest(folder)

    def tensor_of(fqn: str) -> torch.Tensor:
        if fqn not in manifest["stage_of"]:
            raise CheckpointError(f"checkpoint {folder} has no tensor {fqn!r}; it is from "
                                  "another model")
        path = folder / f"stage_{manifest['stage_of'][fqn]}.safetensors"
        with safe_open(str(path), framework="pt") as f:
            return nn.Parameter(f.get_tensor(fqn))

    return tensor_of


def _manifest(folder: Path) -> dict[str, Any]:
    try:
        manifest = json.loads((folder / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{folder}/manifest.json cannot be read ({exc}); the checkpoint "
                              "is damaged: load an earlier one or save again") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != CHECKPOINT_FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else manifest
        raise CheckpointError(f"checkpoint format {found!r} is not supported (this autopart "
                              f"reads {CHECKPOINT_FORMAT}); save it again with this version")
    return manifest
