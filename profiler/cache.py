"""Profile cache: CostGraph JSON files keyed by graph, device, input shapes, dtype and versions."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from autopart.core.costgraph import CostGraph
from autopart.core.errors import PlanError
from autopart.core.jsonio import dumps, write_text_atomic
from autopart.core.version import __version__

__all__ = ["cache_dir", "host_file", "profile_key", "load_cached", "store", "cached_profile",
           "load_measure", "store_measure", "cache_enabled", "machine_busy", "PROFILER_REVISION"]

#: Bumped whenever the profiler's numbers change for the same inputs, so that profiles
#: cached by an earlier revision are never reused (2: empty autograd-call cost subtracted;
#: 3: ``NodeCost.saved_from`` and ``strided_output_bytes`` recorded, a reused node's saved
#: storages no longer counted again; 4: grouped GEMMs (mixture-of-experts experts) counted and
#: priced as matmuls, a parameter read through a transpose / view / cast timed as the weight
#: gradient).
PROFILER_REVISION = "4"


def cache_dir() -> Path:
    """Where profiles are kept: ``$AUTOPART_CACHE_DIR``, else ``$XDG_CACHE_HOME/autopart``,
    else ``~/.cache/autopart``."""
    if os.environ.get("AUTOPART_CACHE_DIR"):
        return Path(os.environ["AUTOPART_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "autopart"


def cache_enabled() -> bool:
    """Whether :func:`autopart.planning.profile_model` uses the cache by default: yes, unless
    ``$AUTOPART_CACHE`` is ``0``, ``off``, ``no`` or ``false``."""
    return os.environ.get("AUTOPART_CACHE", "1").strip().lower() not in ("0", "off", "no",
                                                                          "false")


def _cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``'s first ``model name``, else
    ``platform.processor()``, else the machine type)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def host_file(kind: str, method: str) -> Path:
    """Where a measurement of this host (not of a graph) is cached: ``<cache>/links/
    <kind>-<method>-<CPU model>-torch<version>.json`` (spaces and slashes made ``_``)."""
    name = f"{kind}-{method}-{_cpu_name()}-torch{torch.__version__}"
    return cache_dir() / "links" / (name.replace(" ", "_").replace("/", "_") + ".json")


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
        device: ``"cpu"``, ``"cuda:N"`` (with the GPU's name added) or a preset name. A
            measured ``"cpu"`` profile also records the CPU's model name and
            ``torch.get_num_threads()``: op times depend on both.
        flat_inputs: the graph's flat inputs; their shapes and dtypes enter the key.
        dtype: the profiled dtype's name.
        training: whether the backward was profiled.
        method: ``"measured"`` or ``"analytical"`` plus any option that changes the numbers.
    """
    shapes = [[list(x.shape), str(x.dtype)] if isinstance(x, torch.Tensor) else repr(x)
              for x in flat_inputs]
    if device.startswith("cuda") and torch.cuda.is_available():
        device = f"{device}:{torch.cuda.get_device_name(torch.device(device))}"
    elif device == "cpu" and method.startswith("measured"):
        device = f"cpu:{_cpu_name()}:threads={torch.get_num_threads()}"
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
    """Write ``costs`` under ``key``, atomically, as JSON; returns the file's path.

    Measures stored beside an earlier profile under the same key (:func:`store_measure`)
    are dropped: they were measured on that profile.
    """
    path = _path(key, root)
    write_text_atomic(path, dumps({"key": key, "costs": costs.to_dict()}))
    return path


def _read(key: dict[str, Any], root: Path | None) -> dict[str, Any] | None:
    """The cache file's content for ``key`` when it parses and its stored key is ``key``."""
    try:
        data = json.loads(_path(key, root).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(data, dict) or data.get("key") != json.loads(json.dumps(key)):
        return None
    return data


def load_measure(key: dict[str, Any], name: str, root: Path | None = None) -> float | None:
    """A number measured on the profile cached under ``key`` (e.g. the zero-bubble split's
    cost per node), or None when the profile or that number is not cached. Numbers stored
    under other names (an old file's ``"split_backward_factor"``) are ignored."""
    data = _read(key, root)
    measures = data.get("measures") if data is not None else None
    value = measures.get(name) if isinstance(measures, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def store_measure(key: dict[str, Any], name: str, value: float,
                  root: Path | None = None) -> Path | None:
    """Add ``name = value`` to the profile cached under ``key``, atomically.

    Returns:
        The file's path, or None when no profile is cached under ``key`` (a number measured
        on a profile is kept only with it).
    """
    data = _read(key, root)
    if data is None:
        return None
    measures = data.get("measures")
    data["measures"] = {**(measures if isinstance(measures, dict) else {}), name: value}
    path = _path(key, root)
    write_text_atomic(path, dumps(data))
    return path


def machine_busy() -> str | None:
    """Why CPU timings taken now would be high, or None: the 1-minute load average
    (``os.getloadavg``) above the number of CPUs means more runnable threads than cores."""
    try:
        load = os.getloadavg()[0]
    except OSError:  # not on this platform
        return None
    cpus = os.cpu_count() or 1
    return f"load average {load:.1f} on {cpus} CPUs" if load > cpus else None


def cached_profile(key: dict[str, Any], compute: Callable[[], CostGraph],
                   root: Path | None = None) -> tuple[CostGraph, bool]:
    """``(costs, hit)``: the cached profile for ``key``, else ``compute()`` stored under it.

    A CPU profile measured while the machine was oversubscribed (:func:`machine_busy`,
    checked before and after) is used but not stored, with a warning: its times are those
    of a contended machine, and a cached profile would carry them into every later plan.
    """
    hit = load_cached(key, root)
    if hit is not None:
        return hit, True
    cpu = str(key.get("device", "")).startswith("cpu") and str(
        key.get("method", "")).startswith("measured")
    busy = machine_busy() if cpu else None
    costs = compute()
    busy = busy or (machine_busy() if cpu else None)
    if busy is None:
        store(key, costs, root)
    else:
        warnings.warn(f"profiled while the machine was busy ({busy}): op times may be high, "
                      "so this profile is not cached; plan again on a quieter machine for "
                      "timings to keep", RuntimeWarning, stacklevel=2)
    return costs, False
