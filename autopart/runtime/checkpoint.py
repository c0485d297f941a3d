"""Checkpoints: one safetensors file per stage plus the plan, written atomically, loadable anywhere."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from safetensors.torch import load as safetensors_load
from safetensors.torch import save_file
from torch import nn

from autopart.core.errors import CheckpointError
from autopart.core.jsonio import dumps, fsync_dir, write_text_atomic
from autopart.core.plan import Plan

if TYPE_CHECKING:
    from autopart.runtime.local import PipelinedModule

__all__ = ["save_checkpoint", "read_checkpoint", "checkpoint_tensors", "current_checkpoint",
           "CHECKPOINT_FORMAT"]

CHECKPOINT_FORMAT = 2  # 2: sha256, size and dtypes per file; 1 (no digests) still loads
_READABLE_FORMATS = (1, 2)
_LATEST = "latest"


def save_checkpoint(pipe: PipelinedModule, directory: str | os.PathLike[str]) -> Path:
    """Write ``pipe``'s weights (one ``stage_<s>.safetensors`` per stage) and plan.

    Layout: ``directory/ckpt-<n>/`` holds ``plan.json``, ``manifest.json`` and the stage
    files; ``directory/latest`` names the current ``ckpt-<n>``. A new checkpoint is
    written to a temporary folder, renamed into place, and only then does ``latest``
    move to it (an atomic file replace); older checkpoints are removed after that. A crash
    at any point leaves the previous checkpoint complete and ``latest`` pointing at it.

    Each stage file holds the tensors that stage owns, under the original model's FQNs
    (tied replicas are not stored twice); parameters the graph never reads go with stage 0.
    The manifest records each file's SHA-256 and size and each tensor's shape and dtype;
    loading checks them all. A save holds ``directory/.lock`` (``flock``) and first removes
    what killed saves left behind (temporary folders and pointer files).

    Returns:
        The new ``ckpt-<n>`` folder.
    """
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    with _save_lock(root):
        _remove_leftovers(root)
        previous = sorted(p for p in root.glob("ckpt-*") if p.is_dir() and p.name[5:].isdigit())
        number = int(previous[-1].name[5:]) + 1 if previous else 0
        final = root / f"ckpt-{number:06d}"
        tmp = root / f".ckpt-{number:06d}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            owned = pipe.owned_tensors()
            files = {}
            for stage_index, tensors in owned.items():
                path = tmp / f"stage_{stage_index}.safetensors"
                save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(path))
                files[path.name] = {"sha256": _sha256(path), "bytes": path.stat().st_size}
            manifest = {"format": CHECKPOINT_FORMAT, "graph_fingerprint": pipe.plan.graph_fingerprint,
                        "files": files,
                        "dtypes": {fqn: str(t.dtype).removeprefix("torch.") for tensors in owned.values()
                                   for fqn, t in tensors.items()},
                        "state_keys": [[k, fqn] for k, fqn in pipe.state_layout()],
                        "stage_of": {fqn: s for s, tensors in owned.items() for fqn in tensors},
                        "shapes": {fqn: list(t.shape) for tensors in owned.values()
                                   for fqn, t in tensors.items()}}
            write_text_atomic(tmp / "manifest.json", dumps(manifest))
            pipe.plan.save(tmp / "plan.json")
            fsync_dir(tmp)
            os.replace(tmp, final)
            fsync_dir(root)
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
        tensors.update(_load_verified(folder, f"stage_{stage_index}.safetensors", manifest))
    _check_tensors(manifest, tensors, model, folder)
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

    verified: set[str] = set()

    def tensor_of(fqn: str) -> torch.Tensor:
        if fqn not in manifest["stage_of"]:
            raise CheckpointError(f"checkpoint {folder} has no tensor {fqn!r}; it is from "
                                  "another model")
        name = f"stage_{manifest['stage_of'][fqn]}.safetensors"
        if name not in verified:
            _read_verified(folder, name, manifest)
            verified.add(name)
        with safe_open(str(folder / name), framework="pt") as f:
            value = f.get_tensor(fqn)
        _check_tensors(manifest, {fqn: value}, None, folder)
        return nn.Parameter(value)

    return tensor_of


def _manifest(folder: Path) -> dict[str, Any]:
    """The manifest, checked for shape: a damaged one raises, naming the file."""
    path = folder / "manifest.json"
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{path} cannot be read ({type(exc).__name__}: {exc}); the "
                              "checkpoint is damaged: load an earlier one or save again") from exc
    if not isinstance(manifest, dict) or manifest.get("format") not in _READABLE_FORMATS:
        found = manifest.get("format") if isinstance(manifest, dict) else manifest
        raise CheckpointError(f"{path}: checkpoint format {found!r:.40} is not supported (this "
                              f"autopart reads {list(_READABLE_FORMATS)}); save it again with "
                              "this version")
    try:
        keys = [(str(k), str(f)) for k, f in manifest["state_keys"]]
        stage_of = {str(f): int(s) for f, s in manifest["stage_of"].items()}
        shapes = {str(f): [int(d) for d in shape] for f, shape in manifest["shapes"].items()}
        ok = all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                 for s in manifest["stage_of"].values())
        if manifest["format"] >= 2:
            files = {str(n): (str(e["sha256"]), int(e["bytes"]))
                     for n, e in manifest["files"].items()}
            dtypes = {str(f): str(d) for f, d in manifest["dtypes"].items()}
            ok = ok and set(dtypes) == set(shapes) and all(
                f"stage_{s}.safetensors" in files for s in stage_of.values())
        ok = ok and set(stage_of) == set(shapes) and {f for _, f in keys} <= set(stage_of)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CheckpointError(f"{path} is damaged ({type(exc).__name__}: {exc}); load an earlier "
                              "checkpoint or save again") from exc
    if not ok:
        raise CheckpointError(f"{path} is damaged (its tensor, stage and file lists disagree); "
                              "load an earlier checkpoint or save again")
    return manifest


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _read_verified(folder: Path, name: str, manifest: dict[str, Any]) -> bytes:
    """A stage file's bytes, read once and checked against the manifest's size and SHA-256
    (format 2; format 1 recorded neither).

    Raises:
        CheckpointError: the file is missing, truncated, grown or altered.
    """
    path = folder / name
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"checkpoint file {path} is missing or unreadable ({exc}); the "
                              "checkpoint is damaged: load an earlier one or save again") from exc
    if manifest["format"] >= 2:
        sha, size = manifest["files"][name]["sha256"], int(manifest["files"][name]["bytes"])
        if len(data) != size or hashlib.sha256(data).hexdigest() != sha:
            raise CheckpointError(f"checkpoint file {path} does not match its manifest (size "
                                  f"{len(data)} vs {size} bytes, or SHA-256 differs): it was "
                                  "damaged or changed after the save; load an earlier "
                                  "checkpoint or save again")
    return data


def _load_verified(folder: Path, name: str, manifest: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every tensor of a verified stage file, by FQN.

    Raises:
        CheckpointError: see :func:`_read_verified`, or bytes safetensors cannot parse.
    """
    data = _read_verified(folder, name, manifest)
    try:
        return safetensors_load(data)
    except Exception as exc:  # safetensors raises its own error types for bad headers
        raise CheckpointError(f"checkpoint file {folder / name} cannot be read "
                              f"({type(exc).__name__}: {exc}); load an earlier checkpoint or "
                              "save again") from exc


def _check_tensors(manifest: dict[str, Any], tensors: dict[str, torch.Tensor],
                   model: nn.Module | None, folder: Path) -> None:
    """Each tensor's shape and dtype as the manifest says, and (format 2) as the model's."""
    ours = {} if model is None else dict(list(model.named_parameters())
                                         + list(model.named_buffers()))
    for fqn, value in tensors.items():
        want = manifest["shapes"].get(fqn)
        dtype = manifest.get("dtypes", {}).get(fqn)
        found = str(value.dtype).removeprefix("torch.")
        if want is not None and list(value.shape) != want:
            raise CheckpointError(f"checkpoint {folder}: {fqn} has shape {list(value.shape)}, its "
                                  f"manifest says {want}; the checkpoint is damaged")
        if dtype is not None and found != dtype:
            raise CheckpointError(f"checkpoint {folder}: {fqn} is {found}, its manifest says "
                                  f"{dtype}; a stage file was re-saved in another dtype: save the "
                                  "checkpoint again from the pipeline")
        if fqn in ours and dtype is not None and ours[fqn].dtype != value.dtype:
            raise CheckpointError(f"checkpoint {folder}: {fqn} is {found}, the model's is "
                                  f"{str(ours[fqn].dtype).removeprefix('torch.')}; convert the "
                                  "model (e.g. model.to(dtype)) or the checkpoint first")


def _remove_leftovers(root: Path) -> None:
    """Remove what killed saves left in ``root`` (the caller holds the save lock, so no
    save is in flight): ``.ckpt-<n>.tmp-<pid>`` folders and ``.latest.*.tmp`` files."""
    for entry in root.iterdir():
        name = entry.name
        if name.startswith(".ckpt-") and ".tmp-" in name:
            shutil.rmtree(entry, ignore_errors=True)
        elif name.startswith(f".{_LATEST}.") and name.endswith(".tmp") and entry.is_file():
            entry.unlink(missing_ok=True)


@contextlib.contextmanager
def _save_lock(root: Path) -> Iterator[None]:
    """Hold ``root/.lock`` exclusively (``flock``): one save of a directory at a time, and
    the lock dies with its process, so a killed save never blocks the next."""
    with open(root / ".lock", "a+b") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
