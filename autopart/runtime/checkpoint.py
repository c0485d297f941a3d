"""Training checkpoints on torch.distributed.checkpoint (DCP): model and optimizer state under
the original FQNs, committed atomically, restored onto any plan or the plain model."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import warnings
from collections.abc import Callable, Iterator
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
from autopart.runtime._dcp_files import SafeReader, read_metadata, safetensors_weights

__all__ = ["save_checkpoint", "load_checkpoint", "checkpoint_extra", "checkpoint_plan",
           "checkpoint_tensors", "current_checkpoint", "PendingSave", "CHECKPOINT_FORMAT"]

CHECKPOINT_FORMAT = 3  # 3: DCP + autopart.json; 1 and 2 (safetensors per stage) load weights
_LATEST = "latest"
_MANIFEST = "autopart.json"  # written last: a folder without it is not a checkpoint
_OPT = "optim.state."  # DCP key of optimizer state: optim.state.<fqn>.<name>


@dataclass
class _Target:
    """What a checkpoint reads and writes of one process's model: ``writes`` (canonical FQN
    -> tensor this process saves: each tensor once over all ranks, up to dp replicas),
    ``holds`` (every tensor it loads into, a tied replica on another rank included),
    ``params`` (id(parameter) -> FQN, for the optimizer) and how to finish a load."""

    writes: dict[str, torch.Tensor]
    holds: dict[str, torch.Tensor]
    params: dict[int, str]
    aliases: dict[str, str]
    plan: Plan | None
    distributed: bool
    device: torch.device
    after_load: Callable[[], None]


def _target(module: nn.Module) -> _Target:
    """The checkpoint's view of a pipeline (told apart by what it offers, since the runtimes
    import this module) or of a plain module."""
    if not isinstance(module, nn.Module):
        raise CheckpointError(f"cannot checkpoint a {type(module).__name__}; pass a pipeline or "
                              "an nn.Module")
    obj: Any = module
    params = {id(p): f for f, p in obj.named_parameters()}
    if hasattr(obj, "pp_rank"):  # DistributedPipeline: this rank's stages
        held = obj.state_dict(keep_vars=True)
        return _Target(obj.owned_tensors(), held, params, {f: f for f in held}, obj.plan,
                       dist.get_world_size() > 1, obj.device, lambda: None)
    if hasattr(obj, "owned_tensors"):  # PipelinedModule: every stage, one process
        owned = {f: t for tensors in obj.owned_tensors().values() for f, t in tensors.items()}
        return _Target(owned, owned, params, dict(obj.state_layout()), obj.plan, False,
                       obj.devices[0], lambda: obj._sync_replicas(force=True))
    canon: dict[int, str] = {}  # a tied tensor's canonical name: the first one listed
    for f, t in list(obj.named_parameters()) + list(obj.named_buffers()):
        canon.setdefault(id(t), f)
    named = dict(obj.named_parameters()) | dict(obj.named_buffers())
    tensors = {f: named[f] for f in canon.values()}
    aliases = {k: canon[id(v)] for k, v in obj.state_dict(keep_vars=True).items()
               if id(v) in canon}
    first = next(iter(tensors.values()), torch.empty(0))
    return _Target(tensors, tensors, params, aliases, None, False, first.device, lambda: None)


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
        tensors, groups, scalars = _optimizer_state(optimizer, target)
        state.update(tensors)
    rank0 = not target.distributed or dist.get_rank() == 0
    number = -1
    lock = _save_lock(root) if rank0 else contextlib.nullcontext()
    lock.__enter__()
    try:
        if rank0:
            root.mkdir(parents=True, exist_ok=True)
            _remove_leftovers(root)
            previous = _committed(root)
            number = int(previous[-1].name[5:]) + 1 if previous else 0
            tmp = root / f".ckpt-{number:06d}.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        if target.distributed:
            number = _broadcast_int(number, target.device)
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
        with _quiet():
            if async_save:
                future = state_dict_saver.async_save(state, **kwargs)
                assert isinstance(future, Future)  # the thread checkpointer's response
                return PendingSave(future, commit)
            state_dict_saver.save(state, **kwargs)
    except BaseException:
        lock.__exit__(None, None, None)
        raise
    return commit()


def _commit(root: Path, tmp: Path, number: int, meta: dict[str, Any], target: _Target,
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
            files = {p.name: {"sha256": _sha256(p), "bytes": p.stat().st_size}
                     for p in sorted(tmp.iterdir()) if p.is_file()}
            write_text_atomic(tmp / _MANIFEST, dumps({**meta, "files": files}))
            fsync_dir(tmp)
            os.replace(tmp, final)
            fsync_dir(root)
            write_text_atomic(root / _LATEST, final.name + "\n")
            for old in _committed(root)[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
        except OSError as exc:
            ok, error = 0, f"{type(exc).__name__}: {exc}"
            shutil.rmtree(tmp, ignore_errors=True)
    if target.distributed:
        ok = _broadcast_int(ok, target.device)
    if not ok:
        why = error or "see rank 0's error"
        raise CheckpointError(f"committing checkpoint {final} failed on rank 0 ({why}); the "
                              "previous checkpoint is still the latest")
    return final


def _optimizer_state(optimizer: torch.optim.Optimizer, target: _Target,
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
    for index, entries in sd["state"].items():
        fqn = fqns[index]
        if fqn not in target.writes:
            continue
        for name, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{_OPT}{fqn}.{name}"] = value.detach()
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
    if (path / _LATEST).is_file() or (path / _MANIFEST).is_file() or path.name.startswith(
            (".ckpt-", "ckpt-")):
        folder = current_checkpoint(path)
        if (folder / "manifest.json").is_file() and not (folder / _MANIFEST).is_file():
            return _load_weights(safetensors_weights(folder), target, folder, optimizer)
        meta = _verified_manifest(folder)
    else:
        return _load_weights(safetensors_weights(path), target, path, optimizer)
    metadata = read_metadata(folder).state_dict_metadata
    saved = {k: v for k, v in metadata.items() if not k.startswith(_OPT)}
    _check_model(saved, target, folder)
    state: dict[str, Any] = {f: t.detach() for f, t in target.holds.items()}
    if optimizer is not None:
        if meta.get("optimizer") is None:
            raise CheckpointError(f"checkpoint {folder} holds no optimizer state (saved without "
                                  "optimizer=); load without optimizer= or save with it")
        state.update(_optimizer_buffers(optimizer, target, metadata))
    with torch.no_grad(), _quiet():
        state_dict_loader.load(state, storage_reader=SafeReader(str(folder)), no_dist=True)
    target.after_load()
    if optimizer is not None:
        _restore_optimizer(optimizer, target, state, meta["optimizer"], folder)
    return dict(meta.get("extra") or {})


def _optimizer_buffers(optimizer: torch.optim.Optimizer, target: _Target,
                       metadata: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Empty tensors (saved shape and dtype) for the optimizer state of every parameter the
    optimizer holds, under their DCP keys."""
    by_fqn: dict[str, list[str]] = {}
    for key in metadata:
        if key.startswith(_OPT):  # optim.state.<fqn>.<name>; state names have no dots
            owner, name = key[len(_OPT):].rsplit(".", 1)
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
                m = metadata[f"{_OPT}{fqn}.{name}"]
                out[f"{_OPT}{fqn}.{name}"] = torch.empty(tuple(m.size), dtype=m.properties.dtype)
    return out


def _restore_optimizer(optimizer: torch.optim.Optimizer, target: _Target, state: dict[str, Any],
                       saved: dict[str, Any], folder: Path) -> None:
    current = optimizer.state_dict()
    order = [p for g in optimizer.param_groups for p in g["params"]]
    new_state: dict[int, dict[str, Any]] = {}
    loaded: dict[str, dict[str, Any]] = {}
    for key, value in state.items():
        if key.startswith(_OPT):
            fqn, name = key[len(_OPT):].rsplit(".", 1)
            loaded.setdefault(fqn, {})[name] = value
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


def _load_weights(weights: dict[str, torch.Tensor], target: _Target, source: Path,
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
            t.copy_(canonical[fqn])
    target.after_load()
    return {}


@dataclass
class _Shape:
    size: tuple[int, ...]


def _check_model(saved: dict[str, Any], target: _Target, where: Path) -> None:
    missing = sorted(set(target.holds) - set(saved))
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
def current_checkpoint(root: Path) -> Path:
    """The committed folder a path names: ``root/latest``'s target, or ``root`` itself when
    it is one ``ckpt-<n>`` folder.

    Raises:
        CheckpointError: no ``latest`` pointer, a partial folder (no ``autopart.json``: its
            save did not finish), or ``latest`` naming a folder that is gone.
    """
    if (root / _MANIFEST).is_file() or (root / "manifest.json").is_file():  # format 3; 1-2
        return root
    if root.name.startswith((".ckpt-", "ckpt-")) and root.is_dir():
        raise CheckpointError(f"{root} is a partial checkpoint: its save did not finish (no "
                              f"{_MANIFEST}); load the directory's latest checkpoint instead")
    pointer = root / _LATEST
    if not pointer.is_file():
        raise CheckpointError(f"{root} is not an autopart checkpoint (no 'latest' file); pass a "
                              "directory written by pipe.save(...)")
    folder = root / pointer.read_text(encoding="utf-8").strip()
    if not (folder / _MANIFEST).is_file() and not (folder / "manifest.json").is_file():
        raise CheckpointError(f"{root}/latest points at {folder.name}, which has no "
                              f"{_MANIFEST}; the checkpoint is damaged")
    return folder


def _verified_manifest(folder: Path) -> dict[str, Any]:
    """``autopart.json``, checked for shape, and every file it lists checked for size and
    SHA-256 (so DCP reads only the bytes that were committed)."""
    path = folder / _MANIFEST
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
            digest = _sha256(file) if found_size == size else ""
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


def checkpoint_extra(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``extra`` dict a checkpoint was saved with (``{}`` when none)."""
    return dict(_verified_manifest(current_checkpoint(Path(directory))).get("extra") or {})


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
    if not (folder / _MANIFEST).is_file():
        weights = safetensors_weights(folder)

        def from_weights(fqn: str) -> torch.Tensor:
            if fqn not in weights:
                raise CheckpointError(f"checkpoint {folder} has no tensor {fqn!r}; it is from "
                                      "another model")
            return nn.Parameter(weights[fqn])

        return from_weights
    _verified_manifest(folder)
    metadata = read_metadata(folder).state_dict_metadata

    def tensor_of(fqn: str) -> torch.Tensor:
        m = metadata.get(fqn)
        if not isinstance(m, TensorStorageMetadata) or fqn.startswith(_OPT):
            raise CheckpointError(f"checkpoint {folder} has no tensor {fqn!r}; it is from "
                                  "another model")
        value = torch.empty(tuple(m.size), dtype=m.properties.dtype)
        with _quiet():
            state_dict_loader.load({fqn: value}, storage_reader=SafeReader(str(folder)), no_dist=True)
        return nn.Parameter(value)

    return tensor_of


# ---- files ---------------------------------------------------------------------------------
@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Hide DCP's warning that a ``no_dist`` call runs in one process (that is the intent)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        yield


def _committed(root: Path) -> list[Path]:
    return sorted(p for p in root.glob("ckpt-*") if p.is_dir() and p.name[5:].isdigit())


def _broadcast_int(value: int, device: torch.device) -> int:
    box = torch.tensor([value], dtype=torch.int64, device=device)
    dist.broadcast(box, src=0)
    return int(box.item())


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _remove_leftovers(root: Path) -> None:
    """Remove what killed saves left in ``root`` (the caller holds the save lock, so no
    save is in flight): ``.ckpt-<n>.tmp`` folders and ``.latest.*.tmp`` files."""
    for entry in root.iterdir():
        name = entry.name
        if name.startswith(".ckpt-") and ".tmp" in name:
            shutil.rmtree(entry, ignore_errors=True)
        elif name.startswith(f".{_LATEST}.") and name.endswith(".tmp") and entry.is_file():
            entry.unlink(missing_ok=True)


@contextlib.contextmanager
def _save_lock(root: Path) -> Iterator[None]:
    """Hold ``root/.lock`` exclusively (``flock``): one save of a directory at a time, and
    the lock dies with its process, so a killed save never blocks the next."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "a+b") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)

