"""A checkpoint's files: the ``ckpt-<n>`` folders, the ``latest`` pointer, the manifest and
its checks, and the save lock."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from autopart.core.errors import CheckpointError

__all__ = ["CHECKPOINT_FORMAT", "LATEST", "MANIFEST", "OPT", "current_checkpoint",
           "verified_manifest", "committed", "broadcast_int", "sha256", "remove_leftovers",
           "save_lock", "quiet"]

CHECKPOINT_FORMAT = 3  # 3: DCP + autopart.json; 1 and 2 (safetensors per stage) load weights
LATEST = "latest"
MANIFEST = "autopart.json"  # written last: a folder without it is not a checkpoint
OPT = "optim.state."  # DCP key of optimizer state: optim.state.<fqn>.<name>


def current_checkpoint(root: Path) -> Path:
    """The committed folder a path names: ``root/latest``'s target, or ``root`` itself when
    it is one ``ckpt-<n>`` folder.

    Raises:
        CheckpointError: no ``latest`` pointer, a partial folder (no ``autopart.json``: its
            save did not finish), or ``latest`` naming a folder that is gone.
    """
    if (root / MANIFEST).is_file() or (root / "manifest.json").is_file():  # format 3; 1-2
        return root
    if root.name.startswith((".ckpt-", "ckpt-")) and root.is_dir():
        raise CheckpointError(f"{root} is a partial checkpoint: its save did not finish (no "
                              f"{MANIFEST}); load the directory's latest checkpoint instead")
    pointer = root / LATEST
    if not pointer.is_file():
        raise CheckpointError(f"{root} is not an autopart checkpoint (no 'latest' file); pass a "
                              "directory written by pipe.save(...)")
    folder = root / pointer.read_text(encoding="utf-8").strip()
    if not (folder / MANIFEST).is_file() and not (folder / "manifest.json").is_file():
        raise CheckpointError(f"{root}/latest points at {folder.name}, which has no "
                              f"{MANIFEST}; the checkpoint is damaged")
    return folder


def verified_manifest(folder: Path) -> dict[str, Any]:
    """``autopart.json``, checked for shape, and every file it lists checked for size and
    SHA-256 (so DCP reads only the bytes that were committed)."""
    path = folder / MANIFEST
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{path} cannot be read ({type(exc).__name__}: {exc}); the "
                              "checkpoint is damaged: load an earlier one or save again") from exc
    if not isinstance(meta, dict) or meta.get("format") != CHECKPOINT_FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else meta
        raise CheckpointError(f"{path}: checkpoint format {found!r:.40} is not supported (this "
                              f"autopart reads {CHECKPOINT_FORMAT}, and formats 1-2 as weights); "
                              "save it again with this version")
    try:
        files = {str(n): (str(e["sha256"]), int(e["bytes"])) for n, e in meta["files"].items()}
        opt = meta["optimizer"]
        ok = ".metadata" in files and isinstance(meta["extra"], dict) and (
            opt is None or (isinstance(opt["groups"], list) and isinstance(opt["scalars"], dict)))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CheckpointError(f"{path} is damaged ({type(exc).__name__}: {exc}); load an earlier "
                              "checkpoint or save again") from exc
    if not ok:
        raise CheckpointError(f"{path} is damaged (no .metadata listed, or bad extra / optimizer "
                              "entries); load an earlier checkpoint or save again")
    for name, (sha, size) in files.items():
        file = folder / name
        try:
            found_size = file.stat().st_size
            digest = sha256(file) if found_size == size else ""
        except OSError as exc:
            raise CheckpointError(f"checkpoint file {file} is missing or unreadable ({exc}); the "
                                  "checkpoint is damaged: load an earlier one or save again"
                                  ) from exc
        if found_size != size or digest != sha:
            raise CheckpointError(f"checkpoint file {file} does not match its manifest (size "
                                  f"{found_size} vs {size} bytes, or SHA-256 differs): it was "
                                  "damaged or changed after the save; load an earlier "
                                  "checkpoint or save again")
    return meta


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Hide DCP's warning that a ``no_dist`` call runs in one process (that is the intent)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        yield


def committed(root: Path) -> list[Path]:
    return sorted(p for p in root.glob("ckpt-*") if p.is_dir() and p.name[5:].isdigit())


def broadcast_int(value: int, device: torch.device) -> int:
    box = torch.tensor([value], dtype=torch.int64, device=device)
    dist.broadcast(box, src=0)
    return int(box.item())


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def remove_leftovers(root: Path) -> None:
    """Remove what killed saves left in ``root`` (the caller holds the save lock, so no
    save is in flight): ``.ckpt-<n>.tmp`` folders and ``.latest.*.tmp`` files."""
    for entry in root.iterdir():
        name = entry.name
        if name.startswith(".ckpt-") and ".tmp" in name:
            shutil.rmtree(entry, ignore_errors=True)
        elif name.startswith(f".{LATEST}.") and name.endswith(".tmp") and entry.is_file():
            entry.unlink(missing_ok=True)


@contextlib.contextmanager
def save_lock(root: Path) -> Iterator[None]:
    """Hold ``root/.lock`` exclusively (``flock``): one save of a directory at a time, and
    the lock dies with its process, so a killed save never blocks the next."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "a+b") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
