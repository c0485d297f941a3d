"""HostTopology: GPUs grouped in hosts, the intra-host and inter-host links, with DGX presets."""

from __future__ import annotations

from dataclasses import dataclass

from autopart.core.errors import PlanError

__all__ = ["HostTopology", "TOPOLOGY_PRESETS", "DEVICE_TOPOLOGY", "COLLECTIVE_EFFICIENCY_SOURCE",
           "host_topology", "topology_for_device"]

_GB = 10**9

#: Where ``collective_efficiency`` and the per-step latencies come from.
COLLECTIVE_EFFICIENCY_SOURCE = (
    "autopart's estimate, not a datasheet figure: NCCL's ring collectives reach about 80 % of "
    "the link's one-direction bandwidth as bus bandwidth on large messages (nccl-tests "
    "all_reduce_perf reports ~230-240 GB/s busbw on a DGX A100's 300 GB/s NVLink, and ~90 % "
    "of line rate over InfiniBand); one ring step costs a few µs (NVLink ~1 µs, InfiniBand ~5 µs)")


@dataclass(frozen=True, slots=True)
class HostTopology:
    """How GPUs are grouped into hosts and what joins them.

    Rank placement follows Megatron-LM (Narayanan et al., SC'21, section 3.3): the tp GPUs of a
    tensor-parallel group sit in one host, dp replicas next, pipeline ranks outermost.

    Attributes:
        name: preset name, e.g. ``"dgx-a100"``.
        gpus_per_host: GPUs in one host (8 in a DGX).
        intra_host_bandwidth_bytes_per_s: per GPU, one direction, inside a host (NVLink /
            NVSwitch), bytes/s.
        inter_host_bandwidth_bytes_per_s: per GPU, one direction, between hosts (the host's
            InfiniBand divided by its GPUs), bytes/s.
        intra_host_latency_us: one step of a ring collective inside a host, µs.
        inter_host_latency_us: one step of a ring collective between hosts, µs.
        collective_efficiency: share of the link bandwidth a ring collective reaches (bus
            bandwidth / link bandwidth), 0 < x <= 1 (:data:`COLLECTIVE_EFFICIENCY_SOURCE`).
        source: public source of the link figures.
    """

    name: str
    gpus_per_host: int
    intra_host_bandwidth_bytes_per_s: float
    inter_host_bandwidth_bytes_per_s: float
    intra_host_latency_us: float = 1.0
    inter_host_latency_us: float = 5.0
    collective_efficiency: float = 0.8
    source: str = ""

    def __post_init__(self) -> None:
        if self.gpus_per_host < 1:
            raise PlanError(f"HostTopology {self.name!r}: gpus_per_host must be >= 1, got "
                            f"{self.gpus_per_host}")
        for attr in ("intra_host_bandwidth_bytes_per_s", "inter_host_bandwidth_bytes_per_s"):
            if getattr(self, attr) <= 0:
                raise PlanError(f"HostTopology {self.name!r}: {attr} must be > 0, got "
                                f"{getattr(self, attr)}")
        if self.intra_host_latency_us < 0 or self.inter_host_latency_us < 0:
            raise PlanError(f"HostTopology {self.name!r}: latencies must be >= 0, got "
                            f"{self.intra_host_latency_us} and {self.inter_host_latency_us}")
        if not 0 < self.collective_efficiency <= 1:
            raise PlanError(f"HostTopology {self.name!r}: collective_efficiency must be in "
                            f"(0, 1], got {self.collective_efficiency}")

    def link(self, group_span: int) -> tuple[float, float]:
        """``(bandwidth bytes/s, latency µs per ring step)`` of a group whose members lie
        ``group_span`` GPUs apart at most: inside one host when ``group_span <= gpus_per_host``,
        else across hosts. The bandwidth is the link's times :attr:`collective_efficiency`.

        Args:
            group_span: the stride of the group times its size (tp for a tp group; tp x dp
                for a dp group placed after tp).
        """
        if group_span <= self.gpus_per_host:
            return (self.intra_host_bandwidth_bytes_per_s * self.collective_efficiency,
                    self.intra_host_latency_us)
        return (self.inter_host_bandwidth_bytes_per_s * self.collective_efficiency,
                self.inter_host_latency_us)


_DGX_A100 = ("NVIDIA DGX A100 System Architecture whitepaper and DGX A100 datasheet: 8 x A100 "
             "80GB SXM4, third-generation NVLink via NVSwitch at 600 GB/s bidirectional per GPU "
             "(300 GB/s each way), 8 x 200 Gb/s HDR InfiniBand ConnectX-6 for compute "
             "(one per GPU: 25 GB/s each way)")
_DGX_H100 = ("NVIDIA DGX H100 datasheet: 8 x H100 SXM5, fourth-generation NVLink at 900 GB/s "
             "bidirectional per GPU (450 GB/s each way), 8 x 400 Gb/s NDR ConnectX-7 for "
             "compute (one per GPU: 50 GB/s each way)")
_HGX_H200 = ("NVIDIA HGX H200 (8 x H200 SXM): NVLink 900 GB/s bidirectional per GPU; one "
             "400 Gb/s NDR adapter per GPU assumed, as in DGX H100")

#: Named host topologies; :data:`DEVICE_TOPOLOGY` says which one a device preset lives in.
TOPOLOGY_PRESETS: dict[str, HostTopology] = {
    "dgx-a100": HostTopology("dgx-a100", 8, 300 * _GB, 25 * _GB, source=_DGX_A100),
    "dgx-h100": HostTopology("dgx-h100", 8, 450 * _GB, 50 * _GB, source=_DGX_H100),
    "hgx-h200": HostTopology("hgx-h200", 8, 450 * _GB, 50 * _GB, source=_HGX_H200),
}

#: Device preset -> the host it ships in by default (the DGX-class SXM parts).
DEVICE_TOPOLOGY: dict[str, str] = {
    "a100-80gb": "dgx-a100", "a100-40gb": "dgx-a100", "h100-sxm": "dgx-h100",
    "h200": "hgx-h200",
}


def host_topology(name: str) -> HostTopology:
    """The preset called ``name``.

    Raises:
        PlanError: unknown name; the message lists the presets.
    """
    try:
        return TOPOLOGY_PRESETS[name.strip().lower()]
    except KeyError:
        raise PlanError(f"unknown host topology {name!r}; presets: "
                        f"{', '.join(TOPOLOGY_PRESETS)}") from None


def topology_for_device(device: str, link_bandwidth_bytes_per_s: float,
                        link_latency_us: float) -> HostTopology:
    """The host a device preset ships in; other devices get one GPU per host whose only link
    is the device's own (``DeviceSpec.link_bandwidth_bytes_per_s``), so tp stays 1.

    Args:
        device: canonical device preset name (``DeviceSpec.name``).
        link_bandwidth_bytes_per_s: the device's link, bytes/s, one direction.
        link_latency_us: its latency, µs.
    """
    preset = DEVICE_TOPOLOGY.get(device)
    if preset is not None:
        return TOPOLOGY_PRESETS[preset]
    return HostTopology(f"1x{device}", 1, link_bandwidth_bytes_per_s,
                        link_bandwidth_bytes_per_s, link_latency_us, link_latency_us,
                        source="one device per host; its DeviceSpec link for everything")
