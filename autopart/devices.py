"""Device strings to ranks and to the Cluster the solver plans for."""

from __future__ import annotations

import dataclasses
import warnings

import torch

from autopart.core.cluster import PRESETS, Cluster, DeviceSpec
from autopart.core.errors import PlanError
from autopart.core.plan import Plan
from autopart.core.version import __version__
from autopart.profiler.links import LinkFigures

__all__ = ["cluster_for_devices", "resolve_devices", "plan_devices", "library_versions"]

_CUDA_PRESETS = (("H200", "h200"), ("H100", "h100-sxm"), ("A100-SXM4-80GB", "a100-80gb"),
                 ("A100 80GB", "a100-80gb"), ("A100", "a100-40gb"), ("L4", "l4"))


def library_versions() -> dict[str, str]:
    """Versions a plan records: torch and autopart (the solver adds ortools)."""
    return {"torch": torch.__version__, "autopart": __version__}


def cluster_for_devices(devices: list[str], host_link: LinkFigures | None = None) -> Cluster:
    """A Cluster for runtime device strings: ``"cpu"`` takes the ``cpu`` preset; a CUDA device
    takes the preset its name matches (H100, H200, A100, L4) with the memory it reports.

    Args:
        devices: one device string per rank.
        host_link: measured link between CPU ranks (:func:`autopart.profiler.links.host_link`);
            when given, ``cpu`` devices take its latency and bandwidth instead of the preset's
            nominal 2 µs and 10 GB/s.

    Raises:
        PlanError: a device that is neither ``cpu`` nor ``cuda:N``.
    """
    specs: list[DeviceSpec] = []
    cpu = PRESETS["cpu"]
    if host_link is not None:
        cpu = dataclasses.replace(
            cpu, link_bandwidth_bytes_per_s=host_link.bandwidth_bytes_per_s,
            link_latency_us=host_link.latency_us,
            source=(f"{cpu.source}; link measured between two {host_link.backend} processes "
                    f"on this host: {host_link.latency_us:.0f} µs + "
                    f"{host_link.bandwidth_bytes_per_s / 1e9:.2f} GB/s"))
    for name in devices:
        dev = torch.device(name)
        if dev.type == "cpu":
            specs.append(cpu)
            continue
        if dev.type != "cuda":
            raise PlanError(f"device {name!r}: only 'cpu' and 'cuda:N' devices are supported")
        props = torch.cuda.get_device_properties(dev)
        preset = next((PRESETS[p] for key, p in _CUDA_PRESETS if key in props.name), PRESETS["l4"])
        specs.append(dataclasses.replace(preset, name=props.name.replace(" ", "-").lower(),
                                         memory_bytes=int(props.total_memory)))
    return Cluster(tuple(specs), tuple(devices))


def _on_this_machine(dev: torch.device) -> bool:
    """``cpu``, or a CUDA device this process can see."""
    return dev.type == "cpu" or (dev.type == "cuda" and torch.cuda.is_available()
                                 and (dev.index or 0) < torch.cuda.device_count())


def plan_devices(plan: Plan, devices: list[str] | tuple[str, ...] | None) -> list[str]:
    """The devices a plan's ranks run on in this process: ``devices`` when given, else the
    devices the plan names when every one is here (``cpu``, or a visible ``cuda:N``; four
    stages on one GPU stay on that GPU), else what :func:`resolve_devices` picks for its
    rank count (a plan made for GPUs this machine lacks runs on ``cpu``), with a warning.

    Raises:
        PlanError: as :func:`resolve_devices`.
    """
    if devices is not None:
        return resolve_devices(devices, len(plan.ranks))
    named = [r.device for r in plan.ranks]
    if all(_on_this_machine(torch.device(d)) for d in named):
        return named
    chosen = resolve_devices(None, len(plan.ranks))
    warnings.warn(f"the plan's devices {named} are not all on this machine; its ranks run on "
                  f"{chosen} (pass devices=[...] to choose)", RuntimeWarning, stacklevel=3)
    return chosen


def resolve_devices(devices: list[str] | tuple[str, ...] | None, num_ranks: int | None,
                    ) -> list[str]:
    """One device string per rank.

    Args:
        devices: the devices given, or None (the visible GPUs, else ``num_ranks`` x cpu).
        num_ranks: the rank count wanted, or None (as many as ``devices``).

    Raises:
        PlanError: nothing to go on (no GPU, no count), a count that differs from the
            devices given, or a CUDA device that is not visible.
    """
    if devices is None:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count and (num_ranks is None or num_ranks <= count):
            return [f"cuda:{i}" for i in range(num_ranks or count)]
        if num_ranks is None:
            raise PlanError("no GPU is visible, so pass num_stages=S (stages run on 'cpu') "
                            "or devices=[...]")
        return ["cpu"] * num_ranks
    names = [str(d) for d in devices]
    if not names:
        raise PlanError("devices is empty; pass at least one device, e.g. ['cuda:0', 'cuda:1']")
    if num_ranks is not None and num_ranks != len(names):
        raise PlanError(f"the plan has {num_ranks} ranks but {len(names)} devices were "
                        "given; pass one device per rank")
    for d in names:
        dev = torch.device(d)
        if dev.type == "cuda" and not _on_this_machine(dev):
            raise PlanError(f"device {d!r} is not available (visible CUDA devices: "
                            f"{torch.cuda.device_count()}); use 'cpu' or a visible GPU")
    return names
