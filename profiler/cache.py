"""Profile cache: CostGraph JSON files keyed by graph, device, input shapes, dtype and versions."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from autopart.core.costgraph import CostGraph
from autopart.core.errors import PlanError
from autopart.core.jsonio import dumps, write_text_atomic
from autopart.core.version import __version__

__all__ = ["cache_dir", "profile_key", "load_cached", "store", "cached_profile",
           "PROFILER_REVISION"]

#: Bumped whenever the profiler's numbers change for the same inputs, so that profiles
#: cached by an earlier revision are never reused (2: empty autograd-call cost subtracted).
PROFILER_REVISION = "2"


def cache_dir() -> Path:
    """Where profiles are kept: ``$AUTOPART_CACHE_DIR``, else ``$XDG_CACHE_HOME/autopart``,
    else ``~/.cache/autopart``."""
    if os.environ.get("AUTOPART_CACHE_DIR"):
        return Path(os.environ["AUTOPART_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "autopart"


def _versions() -> dict[str, str]:
    versions = {"torch": torch.__version__, "autopart": __version__,
                "profiler": PROFILER_REVISION}
    try:
        import transformers

        versions["transformers"] = transformers.__version__
    except ImportError:
        pass
    return versions


def profile_key(fingerprint: str, device: str, flat_inputs: list[Any], *, dtype: str,
                training: bool, method: str) -> dict[str, Any]:
    """Everything a cached profile depends on, as a JSON-able dict.

    Args:
        fingerprint: the captured graph's fingerprint.
        device: ``"cpu"``, ``"cuda:N"`` (with the GPU's name added) or a preset name.
        flat_inputs: the graph's flat inputs; their shapes and dtypes enter the key.
        dtype: the profiled dtype's name.
        training: whether the backward was profiled.
        method: ``"measured"`` or ``"analytical"`` plus any option that changes the numbers.
    """
    shapes = [[list(x.shape), str(x.dtype)] if isinstance(x, torch.Tensor) else repr(x)
              for x in flat_inputs]
    if device.startswith("cuda") and torch.cuda.is_available():
        device = f"{device}:{torch.cuda.get_device_name(torch.device(device))}"
    return {"fingerprint": fingerprint, "device": device, "inputs": shapes, "dtype": dtype,
            "training": training, "method": method, "versions": _versions()}


def _path(key: dict[str, Any], root: Path | None) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return (root or cache_dir()) / f"profile-{digest}.json"


def load_cached(key: dict[str, Any], root: Path | None = None) -> CostGraph | None:
    """The cached CostGraph for ``key``, or None.

    A file whose stored key differs from ``key`` in any field (a hash collision, or a file
    from another version) is never used; nor is one that does not parse.
    """
    path = _path(key, root)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("key") != json.loads(json.dumps(key)):
            return None
        return CostGraph.from_dict(data["costs"])
    except (OSError, json.JSONDecodeError, KeyError, TypeError, AttributeError, PlanError):
        return None


def store(key: dict[str, Any], costs: CostGraph, root: Path | None = None) -> Path:
    """Write ``costs`` under ``key``, atomically, as JSON; returns the file's path."""
    path = _path(key, root)
    write_text_atomic(path, dumps({"key": key, "costs": costs.to_dict()}))
    return path


def cached_profile(key: dict[str, Any], compute: Callable[[], CostGraph],
                   root: Path | None = None) -> tuple[CostGraph, bool]:
    """``(costs, hit)``: the cached profile for ``key``, else ``compute()`` stored under it."""
    hit = load_cached(key, root)
    if hit is not None:
        return hit, True
    costs = compute()
    store(key, costs, root)
    return costs, False
