"""Training checkpoints on torch.distributed.checkpoint (DCP): model and optimizer state under
the original FQNs, committed atomically, restored onto any plan or the plain model."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint import state_dict_loader, state_dict_saver
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from autopart.core.errors import CheckpointError
from autopart.core.jsonio import dumps, fsync_dir, write_text_atomic
from autopart.core.plan import Plan
from autopart.runtime.checkpoint._dcp_files import SafeReader, read_metadata, safetensors_weights
from autopart.runtime.checkpoint._files import (
    CHECKPOINT_FORMAT,
    LATEST,
    MANIFEST,
    OPT,
    broadcast_int,
    committed,
    current_checkpoint,
    quiet,
    remove_leftovers,
    save_lock,
    sha256,
    verified_manifest,
)
from autopart.runtime.checkpoint._optim import optimizer_buffers, optimizer_state, restore_optimizer
from autopart.runtime.checkpoint.state import Checkpointable, CheckpointState

__all__ = ["save_checkpoint", "load_checkpoint", "checkpoint_extra", "checkpoint_plan",
           "checkpoint_tensors", "current_checkpoint", "PendingSave", "CHECKPOINT_FORMAT"]


def _target(module: nn.Module) -> CheckpointState:
    """The checkpoint's view of a pipeline (its own :meth:`checkpoint_state`) or of a plain
    module."""
    if not isinstance(module, nn.Module):
        raise CheckpointError(f"cannot checkpoint a {type(module).__name__}; pass a pipeline or "
                              "an nn.Module")
    if isinstance(module, Checkpointable):
        return module.checkpoint_state()
    obj: Any = module
    params = {id(p): f for f, p in obj.named_parameters()}
    canon: dict[int, str] = {}  # a tied tensor's canonical name: the first one listed
    for f, t in list(obj.named_parameters()) + list(obj.named_buffers()):
        canon.setdefault(id(t), f)
    named = dict(obj.named_parameters()) | dict(obj.named_buffers())
    tensors = {f: named[f] for f in canon.values()}
    aliases = {k: canon[id(v)] for k, v in obj.state_dict(keep_vars=True).items()
               if id(v) in canon}
    first = next(iter(tensors.values()), torch.empty(0))
    persistent = set(obj.state_dict(keep_vars=True))
    optional = frozenset(f for f, _ in obj.named_buffers() if f in tensors and f not in persistent)
    return CheckpointState(tensors, tensors, params, aliases, None, False, first.device,
                           lambda: None, optional=optional)


# ---- saving ------------------------------------------------------------------------------
class PendingSave:
    """An ``async_save`` in flight: the tensors are already copied, the files are being
    written. :meth:`wait` (on every rank) finishes the write and commits the checkpoint."""

    def __init__(self, future: Future[Any], commit: Callable[[], Path]) -> None:
        self._future, self._commit = future, commit
        self.path: Path | None = None

    def wait(self) -> Path:
        """Block until written, commit, and return the ``ckpt-<n>`` folder."""
        if self.path is None:
            self._future.result()
            self.path = self._commit()
        return self.path


def save_checkpoint(obj: nn.Module, directory: str | os.PathLike[str], *,
                    optimizer: torch.optim.Optimizer | None = None,
                    extra: dict[str, Any] | None = None, async_save: bool = False,
                    keep: int = 1) -> Path | PendingSave:
    """Write model (and optimizer) state in DCP's sharded format, committed atomically.

    Call on every rank of a :class:`DistributedPipeline` (collective over the default
    group); in one process for a :class:`PipelinedModule` or a plain ``nn.Module``.

    Layout: ``directory/ckpt-<n>/`` holds DCP's ``.metadata`` and ``__<rank>_0.distcp``
    files, ``plan.json`` and ``autopart.json`` (format, ``extra``, optimizer param groups,
    each file's SHA-256 and size); ``directory/latest`` names the current folder. Ranks
    write into ``.ckpt-<n>.tmp``; after every rank has written, rank 0 writes
    ``autopart.json``, renames the folder into place and only then moves ``latest``
    (atomic file replace). A crash at any point leaves the previous checkpoint whole and
    ``latest`` on it; a folder without ``autopart.json`` is refused on load.

    Keys are the original model's FQNs (a tied weight once, under the name
    ``named_parameters`` lists): ``<fqn>`` for weights and buffers, ``optim.state.<fqn>.<name>``
    for optimizer state tensors, so any plan, or the plain model, can read them back.

    Args:
        obj: the pipeline (or plain model) to save.
        directory: the checkpoint root; created if missing.
        optimizer: its state is saved too (every parameter it holds must be ``obj``'s).
        extra: JSON-serialisable values (step, data position, ...) read back with
            :func:`checkpoint_extra`.
        async_save: return a :class:`PendingSave` once the tensors are copied, while files
            are written in a background thread (``dcp.async_save``); call ``wait()`` (every
            rank) before the next save or at exit.
        keep: how many committed checkpoints to keep (default 1: older ones are removed
            after the commit).

    Returns:
        The new ``ckpt-<n>`` folder, or a :class:`PendingSave` with ``async_save``.

    Raises:
        CheckpointError: ``extra`` or an optimizer hyperparameter is not JSON, or the
            optimizer holds a tensor that is not the model's.
    """
    if keep < 1:
        raise CheckpointError(f"keep={keep} must be >= 1")
    target = _target(obj)
    root = Path(directory)
    try:
        extra_json = json.loads(json.dumps(extra or {}))
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"extra={extra!r:.80} is not JSON-serialisable ({exc}); pass "
                              "numbers, strings, lists and dicts") from exc
    state = {f: t.detach() for f, t in target.writes.items()}
    groups: list[dict[str, Any]] = []
    scalars: dict[str, dict[str, Any]] = {}
    if optimizer is not None:
        tensors, groups, scalars = optimizer_state(optimizer, target)
        state.update(tensors)
    rank0 = not target.distributed or dist.get_rank() == 0
    number = -1
    lock = save_lock(root) if rank0 else contextlib.nullcontext()
    lock.__enter__()
    try:
        if rank0:
            root.mkdir(parents=True, exist_ok=True)
            remove_leftovers(root)
            previous = committed(root)
            number = int(previous[-1].name[5:]) + 1 if previous else 0
            tmp = root / f".ckpt-{number:06d}.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        if target.distributed:
            number = broadcast_int(number, target.device)
            everyone: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, (groups, scalars))
            groups = [g for gs, _ in everyone for g in gs]
            scalars = {f: v for _, sc in everyone for f, v in sc.items()}
        tmp = root / f".ckpt-{number:06d}.tmp"
        meta = {"format": CHECKPOINT_FORMAT, "extra": extra_json,
                "optimizer": None if optimizer is None else {"groups": groups,
                                                             "scalars": scalars},
                "plan": target.plan is not None}

        def commit() -> Path:
            try:
                return _commit(root, tmp, number, meta, target, keep)
            finally:
                lock.__exit__(None, None, None)

        kwargs: dict[str, Any] = {"checkpoint_id": str(tmp), "no_dist": not target.distributed}
        with quiet():
            if async_save:
                future = state_dict_saver.async_save(state, **kwargs)
                assert isinstance(future, Future)  # the thread checkpointer's response
                return PendingSave(future, commit)
            state_dict_saver.save(state, **kwargs)
    except BaseException:
        lock.__exit__(None, None, None)
        raise
    return commit()


def _commit(root: Path, tmp: Path, number: int, meta: dict[str, Any], target: CheckpointState,
            keep: int) -> Path:
    """Rank 0 (after every rank wrote): manifest, rename, ``latest``; then old folders go.
    Every rank learns whether it worked and returns the folder or raises."""
    final = root / f"ckpt-{number:06d}"
    ok, error = 1, ""
    if target.distributed:
        dist.barrier()
    if not target.distributed or dist.get_rank() == 0:
        try:
            if target.plan is not None:
                target.plan.save(tmp / "plan.json")
            files = {p.name: {"sha256": sha256(p), "bytes": p.stat().st_size}
                     for p in sorted(tmp.iterdir()) if p.is_file()}
            write_text_atomic(tmp / MANIFEST, dumps({**meta, "files": files}))
            fsync_dir(tmp)
            os.replace(tmp, final)
            fsync_dir(root)
            write_text_atomic(root / LATEST, final.name + "\n")
            for old in committed(root)[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
        except OSError as exc:
            ok, error = 0, f"{type(exc).__name__}: {exc}"
            shutil.rmtree(tmp, ignore_errors=True)
    if target.distributed:
        ok = broadcast_int(ok, target.device)
    if not ok:
        why = error or "see rank 0's error"
        raise CheckpointError(f"committing checkpoint {final} failed on rank 0 ({why}); the "
                              "previous checkpoint is still the latest")
    return final


# ---- loading -----------------------------------------------------------------------------
def load_checkpoint(directory: str | os.PathLike[str], obj: nn.Module, *,
                    optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """Restore ``obj`` (and ``optimizer``) from a checkpoint, whatever plan saved it.

    ``obj`` may be a :class:`PipelinedModule` or :class:`DistributedPipeline` of any plan
    (another rank count or cut), or the plain model. ``directory`` may also be a plain
    model's weights: a ``.safetensors`` file or a folder of them (``save_pretrained``
    output), or a format 1/2 autopart checkpoint (weights only). Each process reads only
    the tensors it holds (DCP reads byte ranges); tensors are cast to the model's dtype.

    Args:
        directory: a ``pipe.save`` root (its ``latest``), one ``ckpt-<n>`` folder, or weights.
        obj: what to load into; every tensor it holds must be in the checkpoint.
        optimizer: restored too: its state by FQN, and each param group's options from the
            saved group holding that group's first parameter (learning rate, betas, ...).

    Returns:
        The ``extra`` dict saved with the checkpoint (``{}`` for plain weights).

    Raises:
        CheckpointError: not a checkpoint, a partial or damaged one (a file's SHA-256 or
            size differs from the manifest), one of another model (lists what differs), or
            an optimizer given for a checkpoint without optimizer state.
    """
    target = _target(obj)
    path = Path(directory)
    if not path.exists():
        raise CheckpointError(f"{path} does not exist; pass a directory written by "
                              "pipe.save(...), or a plain model's weights")
    if (path / LATEST).is_file() or (path / MANIFEST).is_file() or path.name.startswith(
            (".ckpt-", "ckpt-")):
        folder = current_checkpoint(path)
        if (folder / "manifest.json").is_file() and not (folder / MANIFEST).is_file():
            return _load_weights(safetensors_weights(folder), target, folder, optimizer)
        meta = verified_manifest(folder)
    else:
        return _load_weights(safetensors_weights(path), target, path, optimizer)
    metadata = read_metadata(folder).state_dict_metadata
    saved = {k: v for k, v in metadata.items() if not k.startswith(OPT)}
    _check_model(saved, target, folder)
    state: dict[str, Any] = {f: t.detach() for f, t in target.holds.items() if f in saved}
    if optimizer is not None:
        if meta.get("optimizer") is None:
            raise CheckpointError(f"checkpoint {folder} holds no optimizer state (saved without "
                                  "optimizer=); load without optimizer= or save with it")
        state.update(optimizer_buffers(optimizer, target, metadata))
    with torch.no_grad(), quiet():
        state_dict_loader.load(state, storage_reader=SafeReader(str(folder)), no_dist=True)
    target.after_load()
    if optimizer is not None:
        restore_optimizer(optimizer, target, state, meta["optimizer"], folder)
    return dict(meta.get("extra") or {})


def _load_weights(weights: dict[str, torch.Tensor], target: CheckpointState, source: Path,
                  optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """A plain model's weights (state_dict keys; tied aliases resolve to their owner)."""
    if optimizer is not None:
        raise CheckpointError(f"{source} holds weights only (no optimizer state); load "
                              "without optimizer=")
    canonical: dict[str, torch.Tensor] = {}
    for key, value in weights.items():
        canonical.setdefault(target.aliases.get(key, key), value)
    shapes = {f: _Shape(tuple(v.shape)) for f, v in canonical.items()}
    _check_model(shapes, target, source)
    with torch.no_grad():
        for fqn, t in target.holds.items():
            if fqn in canonical:  # an optional one may be absent (_check_model)
                t.copy_(canonical[fqn])
    target.after_load()
    return {}


@dataclass
class _Shape:
    size: tuple[int, ...]


def _check_model(saved: dict[str, Any], target: CheckpointState, where: Path) -> None:
    missing = sorted(set(target.holds) - set(saved) - target.optional)
    unexpected = [] if target.distributed else sorted(set(saved) - set(target.holds))
    shapes = sorted(f for f in set(target.holds) & set(saved)
                    if tuple(saved[f].size) != tuple(target.holds[f].shape))
    if missing or unexpected or shapes:
        detail = "; ".join(part for part in (
            f"missing from checkpoint: {missing[:5]}" if missing else "",
            f"not in the model: {unexpected[:5]}" if unexpected else "",
            "shape differs: " + ", ".join(f"{k} {list(saved[k].size)} vs model "
                                          f"{list(target.holds[k].shape)}" for k in shapes[:5])
            if shapes else "") if part)
        raise CheckpointError(f"checkpoint {where} is from another model ({detail}); load it "
                              "into the model it was saved from")


# ---- reading a checkpoint's parts ---------------------------------------------------------
def checkpoint_extra(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``extra`` dict a checkpoint was saved with (``{}`` when none)."""
    return dict(verified_manifest(current_checkpoint(Path(directory))).get("extra") or {})


def checkpoint_plan(directory: str | os.PathLike[str]) -> Plan:
    """The plan the checkpoint was saved from.

    Raises:
        CheckpointError: saved from a plain model (no plan), or not a checkpoint.
    """
    folder = current_checkpoint(Path(directory))
    if not (folder / "plan.json").is_file():
        raise CheckpointError(f"checkpoint {folder} was saved from a plain model and has no "
                              "plan; compile the model first and load into the pipeline")
    return Plan.load(folder / "plan.json")


def checkpoint_tensors(directory: str | os.PathLike[str]) -> Callable[[str], torch.Tensor]:
    """FQN -> parameter, read from a checkpoint on request (only the bytes of the tensors
    asked for), for a rank that materialises only its own stages.

    Raises:
        CheckpointError: not a checkpoint, or (when called) a tensor it does not hold.
    """
    folder = current_checkpoint(Path(directory))
    if not (folder / MANIFEST).is_file():
        weights = safetensors_weights(folder)

        def from_weights(fqn: str) -> torch.Tensor:
            if fqn not in weights:
                raise CheckpointError(f"checkpoint {folder} has no tensor {fqn!r}; it is from "
                                      "another model")
            return nn.Parameter(weights[fqn])

        return from_weights
    verified_manifest(folder)
    metadata = read_metadata(folder).state_dict_metadata

    def tensor_of(fqn: str) -> torch.Tensor:
        m = metadata.get(fqn)
        if not isinstance(m, TensorStorageMetadata) or fqn.startswith(OPT):
            raise CheckpointError(f"checkpoint {folder} has no tensor {fqn!r}; it is from "
                                  "another model")
        value = torch.empty(tuple(m.size), dtype=m.properties.dtype)
        with quiet():
            state_dict_loader.load({fqn: value}, storage_reader=SafeReader(str(folder)), no_dist=True)
        return nn.Parameter(value)

    return tensor_of
