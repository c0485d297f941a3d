"""Reading checkpoint files without unpickling them: DCP metadata through an allow-list
unpickler, and plain weights from safetensors files (a model's ``save_pretrained`` output)."""

from __future__ import annotations

import io
import json
import pickle
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from autopart.core.errors import CheckpointError

__all__ = ["SafeReader", "read_metadata", "safetensors_weights"]

# Everything DCP's ``.metadata`` pickle names (torch 2.4 - 2.13): its dataclasses, torch
# dtypes and Size, layouts and memory formats, and the PosixPath of the checkpoint id.
_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "TensorProperties",
        "ChunkStorageMetadata", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.distributed.checkpoint.planner": {"LoadItemType", "WriteItemType"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "Path"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice"},
}


class _AllowListUnpickler(pickle.Unpickler):
    """Resolves only the names in ``_ALLOWED`` and torch dtypes; anything else raises."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in DCP metadata")


def read_metadata(folder: Path) -> Metadata:
    """The DCP ``.metadata`` of ``folder``, unpickled with an allow-list.

    Raises:
        CheckpointError: the file is missing, damaged, or names an object DCP never writes.
    """
    path = folder / ".metadata"
    try:
        metadata = _AllowListUnpickler(io.BytesIO(path.read_bytes())).load()
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ImportError, TypeError,
            ValueError, IndexError) as exc:
        raise CheckpointError(f"{path} cannot be read ({type(exc).__name__}: {exc}); the "
                              "checkpoint is damaged: load an earlier one or save again") from exc
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path} holds a {type(metadata).__name__}, not DCP metadata; the "
                              "checkpoint is damaged")
    return metadata


class SafeReader(FileSystemReader):
    """``FileSystemReader`` whose metadata goes through :func:`read_metadata` (DCP's own
    reader calls ``pickle.load`` on it). Tensor data is read by DCP with
    ``torch.load(weights_only=True)``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise CheckpointError("rank-local DCP metadata is not written by autopart")
        metadata = read_metadata(Path(str(self.path)))
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def safetensors_weights(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a ``.safetensors`` file, or of a folder's ``*.safetensors`` files (a
    Hugging Face ``save_pretrained`` folder, sharded or not; a ``.index.json`` names them).

    Raises:
        CheckpointError: no safetensors file, an unreadable one, or a key in two files.
    """
    if path.is_file():
        files = [path]
    else:
        index = sorted(path.glob("*.safetensors.index.json"))
        if index:
            try:
                names = sorted(set(json.loads(index[0].read_text())["weight_map"].values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                raise CheckpointError(f"{index[0]} cannot be read ({type(exc).__name__}: "
                                      f"{exc}); re-save the model") from exc
            files = [path / n for n in names]
        else:
            files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path} holds no .safetensors file; pass a folder written by "
                              "pipe.save(...) or save_pretrained(...), or a .safetensors file")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as handle:
                for key in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                    if key in out:
                        raise CheckpointError(f"{key!r} is in two safetensors files of {path}")
                    out[key] = handle.get_tensor(key)
        except CheckpointError:
            raise
        except Exception as exc:  # safetensors raises its own error types
            raise CheckpointError(f"{f} cannot be read ({type(exc).__name__}: {exc}); it is "
                                  "damaged or not a safetensors file") from exc
    return out
