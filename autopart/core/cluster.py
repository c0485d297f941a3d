"""Cluster: the devices a plan targets and the links between them, with named presets."""

from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass

from autopart.core.errors import PlanError

__all__ = ["DeviceSpec", "Cluster", "PRESETS", "ALIASES", "ESTIMATE_SOURCE", "WORKSPACE_SOURCE",
           "device_preset", "normalise_device_name", "preset_aliases", "closest_presets"]


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    """One accelerator (or host CPU) as the cost model sees it.

    Attributes:
        name: preset name or device string, e.g. ``"h100-sxm"`` or ``"cpu"``.
        memory_bytes: usable device memory, bytes.
        peak_flops: dense peak for the profiled dtype, FLOP/s (bf16 tensor cores for GPUs).
            Kept for the solver; :meth:`peak_flops_for` gives the per-dtype figures.
        memory_bandwidth_bytes_per_s: device memory bandwidth, bytes/s.
        link_bandwidth_bytes_per_s: bandwidth to a neighbouring device, bytes/s, one direction.
        link_latency_us: fixed cost of one point-to-point transfer, µs.
        source: public source of the figures.
        op_overhead_us: fixed cost of one op regardless of its size (eager dispatch plus kernel
            launch), µs. Used when costs profiled at one batch size are scaled to another:
            ``t(b) = op_overhead_us + (t(b0) - op_overhead_us) * b / b0``.
        peak_flops_fp32: dense FP32 peak (CUDA cores, no tensor cores), FLOP/s; 0 = unknown.
        peak_flops_tf32: dense TF32 tensor-core peak, FLOP/s; 0 = unknown.
        peak_flops_bf16: dense BF16/FP16 tensor-core peak, FLOP/s; 0 = unknown.
        flops_source: datasheet the per-dtype peaks come from (dense figures: the
            datasheets' "with sparsity" numbers are halved).
        url: where the datasheet is published; "" for figures that are not a datasheet's.
        workspace_bytes: memory a stage holds on this device besides its tensors, bytes: the
            cuBLAS and cuBLASLt workspaces PyTorch keeps per (handle, stream) pair, one pair
            per stage's compute stream (:data:`WORKSPACE_SOURCE`); 0 on the CPU.
    """

    name: str
    memory_bytes: int
    peak_flops: float
    memory_bandwidth_bytes_per_s: float
    link_bandwidth_bytes_per_s: float
    link_latency_us: float
    source: str
    op_overhead_us: float = 5.0
    peak_flops_fp32: float = 0.0
    peak_flops_tf32: float = 0.0
    peak_flops_bf16: float = 0.0
    flops_source: str = ""
    url: str = ""
    workspace_bytes: int = 0

    def peak_flops_for(self, dtype: str, *, tf32: bool = False) -> float:
        """Dense peak FLOP/s for matmuls in ``dtype``.

        Args:
            dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"`` (``torch.float32`` etc. as
                text also work: the ``"torch."`` prefix is ignored).
            tf32: float32 matmuls run on TF32 tensor cores (PyTorch's default is off:
                ``torch.backends.cuda.matmul.allow_tf32 = False``).

        Returns:
            FLOP/s; a per-dtype figure left at 0 falls back to ``peak_flops``.

        Raises:
            PlanError: a dtype other than the three above.
        """
        name = dtype.removeprefix("torch.")
        if name in ("bfloat16", "float16"):
            value = self.peak_flops_bf16
        elif name == "float32":
            value = self.peak_flops_tf32 if tf32 else self.peak_flops_fp32
        else:
            raise PlanError(f"DeviceSpec {self.name!r}: no peak for dtype {dtype!r}; "
                            "use float32, bfloat16 or float16")
        return value if value > 0 else self.peak_flops

    def __post_init__(self) -> None:
        for attr in ("memory_bytes", "peak_flops", "memory_bandwidth_bytes_per_s",
                     "link_bandwidth_bytes_per_s"):
            if getattr(self, attr) <= 0:
                raise PlanError(f"DeviceSpec {self.name!r}: {attr} must be > 0, got "
                                f"{getattr(self, attr)}")
        for attr in ("peak_flops_fp32", "peak_flops_tf32", "peak_flops_bf16"):
            if getattr(self, attr) < 0:
                raise PlanError(f"DeviceSpec {self.name!r}: {attr} must be >= 0, got "
                                f"{getattr(self, attr)}")
        if self.link_latency_us < 0:
            raise PlanError(f"DeviceSpec {self.name!r}: link_latency_us must be >= 0, got "
                            f"{self.link_latency_us}")


def _host_memory_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 16 * 2**30


_GB = 10**9
_H100_URL = "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet"
_H200_URL = "https://www.nvidia.com/en-us/data-center/h200/"
_A100_URL = ("https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
             "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf")
_L4_URL = "https://www.nvidia.com/en-us/data-center/l4/"
_A100_FLOPS = ("NVIDIA A100 Tensor Core GPU datasheet (every A100 part): FP32 19.5 TFLOPS, "
               "TF32 156 TFLOPS, BF16/FP16 312 TFLOPS (dense)")

#: Where ``link_latency_us`` and ``op_overhead_us`` come from: no datasheet gives them.
ESTIMATE_SOURCE = ("autopart's estimate, not a datasheet figure: one point-to-point transfer "
                   "costs a few µs over NVLink and about 10 µs over PCIe; one eager op costs "
                   "about 5 µs of dispatch and kernel launch; measured profiles replace both")

_MiB = 2**20
#: Where ``workspace_bytes`` comes from.
WORKSPACE_SOURCE = (
    "measured on an H100 80GB HBM3 (torch 2.11.0+cu130, benchmarks/gpu/memory_breakdown.py): "
    "65 MiB per stream that ran matmuls (195 MiB freed by torch._C._cuda_clearCublasWorkspaces "
    "after three); PyTorch keeps a cuBLAS and a cuBLASLt workspace per (handle, stream) pair "
    "(ATen's CublasHandlePool), each of the size the cuBLAS documentation recommends "
    "(cublasSetWorkspace: 32 MiB on Hopper, 4 MiB before). Pre-Hopper: two 4 MiB workspaces "
    "and the same 1 MiB, not measured here")
_HOPPER_WS = 65 * _MiB
_PRE_HOPPER_WS = 9 * _MiB

#: Canonical preset name -> the device as the analytical cost model sees it. Every figure's
#: source is in ``source`` (memory, bandwidths), ``flops_source`` (per-dtype peaks), ``url``
#: (the datasheet) and :data:`ESTIMATE_SOURCE` (latency, op overhead). Peaks are dense: the
#: datasheets' "with sparsity" figures are halved. ``autopart devices`` prints this table.
PRESETS: dict[str, DeviceSpec] = {
    "h100-sxm": DeviceSpec(
        "h100-sxm", 80 * _GB, 989e12, 3.35e12, 450e9, 5.0,
        "NVIDIA H100 Tensor Core GPU datasheet (SXM5: 989 TFLOPS dense BF16, 3.35 TB/s HBM3, "
        "80 GB, NVLink 900 GB/s bidirectional)",
        peak_flops_fp32=67e12, peak_flops_tf32=494.7e12,
        peak_flops_bf16=989.4e12,
        flops_source=("NVIDIA H100 Tensor Core GPU datasheet, SXM5: FP32 67 TFLOPS, "
                      "TF32 989 TFLOPS and BF16/FP16 1,979 TFLOPS with sparsity (dense: half)"),
        url=_H100_URL, workspace_bytes=_HOPPER_WS),
    "h100-pcie": DeviceSpec(
        "h100-pcie", 80 * _GB, 756e12, 2.0e12, 64e9, 10.0,
        "NVIDIA H100 Tensor Core GPU datasheet and H100 PCIe product brief PB-11133-001 (PCIe: "
        "80 GB HBM2e, 2,000 GB/s, PCIe Gen5 128 GB/s bidirectional; NVLink only through a "
        "bridge between pairs, so stages talk over PCIe)",
        peak_flops_fp32=51e12, peak_flops_tf32=378e12,
        peak_flops_bf16=756e12,
        flops_source=("NVIDIA H100 Tensor Core GPU datasheet, PCIe: FP32 51 TFLOPS, "
                      "TF32 756 TFLOPS and BF16/FP16 1,513 TFLOPS with sparsity (dense: half)"),
        url=_H100_URL, workspace_bytes=_HOPPER_WS),
    "h200": DeviceSpec(
        "h200", 141 * _GB, 989e12, 4.8e12, 450e9, 5.0,
        "NVIDIA H200 Tensor Core GPU datasheet (SXM: 989 TFLOPS dense BF16, 4.8 TB/s HBM3e, "
        "141 GB, NVLink 900 GB/s bidirectional)",
        peak_flops_fp32=67e12, peak_flops_tf32=494.7e12,
        peak_flops_bf16=989.4e12,
        flops_source=("NVIDIA H200 Tensor Core GPU datasheet, SXM: FP32 67 TFLOPS, "
                      "TF32 989 TFLOPS and BF16/FP16 1,979 TFLOPS with sparsity (dense: half)"),
        url=_H200_URL, workspace_bytes=_HOPPER_WS),
    "a100-80gb": DeviceSpec(
        "a100-80gb", 80 * _GB, 312e12, 2.039e12, 300e9, 5.0,
        "NVIDIA A100 Tensor Core GPU datasheet (SXM 80GB: 312 TFLOPS dense BF16, 2,039 GB/s, "
        "NVLink 600 GB/s bidirectional)",
        peak_flops_fp32=19.5e12, peak_flops_tf32=156e12,
        peak_flops_bf16=312e12, flops_source=_A100_FLOPS, url=_A100_URL,
        workspace_bytes=_PRE_HOPPER_WS),
    "a100-40gb": DeviceSpec(
        "a100-40gb", 40 * _GB, 312e12, 1.555e12, 300e9, 5.0,
        "NVIDIA A100 Tensor Core GPU datasheet (SXM 40GB: 312 TFLOPS dense BF16, 1,555 GB/s, "
        "NVLink 600 GB/s bidirectional)",
        peak_flops_fp32=19.5e12, peak_flops_tf32=156e12,
        peak_flops_bf16=312e12, flops_source=_A100_FLOPS, url=_A100_URL,
        workspace_bytes=_PRE_HOPPER_WS),
    "a100-80gb-pcie": DeviceSpec(
        "a100-80gb-pcie", 80 * _GB, 312e12, 1.935e12, 32e9, 10.0,
        "NVIDIA A100 Tensor Core GPU datasheet (80GB PCIe: 312 TFLOPS dense BF16, 1,935 GB/s, "
        "PCIe Gen4 64 GB/s bidirectional; NVLink only through a bridge between pairs)",
        peak_flops_fp32=19.5e12, peak_flops_tf32=156e12,
        peak_flops_bf16=312e12, flops_source=_A100_FLOPS, url=_A100_URL,
        workspace_bytes=_PRE_HOPPER_WS),
    "a100-40gb-pcie": DeviceSpec(
        "a100-40gb-pcie", 40 * _GB, 312e12, 1.555e12, 32e9, 10.0,
        "NVIDIA A100 Tensor Core GPU datasheet (40GB PCIe: 312 TFLOPS dense BF16, 1,555 GB/s, "
        "PCIe Gen4 64 GB/s bidirectional; NVLink only through a bridge between pairs)",
        peak_flops_fp32=19.5e12, peak_flops_tf32=156e12,
        peak_flops_bf16=312e12, flops_source=_A100_FLOPS, url=_A100_URL,
        workspace_bytes=_PRE_HOPPER_WS),
    "l4": DeviceSpec(
        "l4", 24 * _GB, 121e12, 300e9, 32e9, 10.0,
        "NVIDIA L4 Tensor Core GPU datasheet (121 TFLOPS dense BF16, 300 GB/s GDDR6, 24 GB, "
        "PCIe Gen4 x16 64 GB/s bidirectional)",
        peak_flops_fp32=30.3e12, peak_flops_tf32=60e12,
        peak_flops_bf16=121e12,
        flops_source=("NVIDIA L4 Tensor Core GPU datasheet: FP32 30.3 TFLOPS, "
                      "TF32 120 TFLOPS and BF16/FP16 242 TFLOPS with sparsity (dense: half)"),
        url=_L4_URL, workspace_bytes=_PRE_HOPPER_WS),
    "cpu": DeviceSpec(
        "cpu", _host_memory_bytes(), 1e11, 2e10, 1e10, 2.0,
        "nominal host figures (memory read from the OS; copies between stages on one host "
        "run at memcpy speed, taken as 10 GB/s); use measured profiles for real CPU plans",
        peak_flops_fp32=1e11, peak_flops_tf32=1e11,
        peak_flops_bf16=1e11,
        flops_source="nominal: one figure for every dtype; measure on CPU instead"),
}

#: Other names for the presets, written as :func:`normalise_device_name` leaves them (lower
#: case, dashes, no ``NVIDIA``/``Tesla`` prefix). A bare family name means the SXM part with
#: the most memory, the one in DGX/HGX systems. Names ``torch.cuda.get_device_name()`` prints
#: are marked "torch"; an H200 NVL also prints ``NVIDIA H200`` and gets the SXM figures.
ALIASES: dict[str, str] = {
    "h100": "h100-sxm",
    "h100-sxm5": "h100-sxm",
    "h100-80gb": "h100-sxm",
    "h100-sxm-80gb": "h100-sxm",
    "h100-sxm5-80gb": "h100-sxm",
    "h100-80gb-hbm3": "h100-sxm",  # torch: "NVIDIA H100 80GB HBM3"
    "h100-pcie-80gb": "h100-pcie",  # torch: "NVIDIA H100 PCIe" is h100-pcie itself
    "h100-80gb-pcie": "h100-pcie",
    "h200-sxm": "h200",  # torch: "NVIDIA H200" is h200 itself
    "h200-141gb": "h200",
    "h200-sxm-141gb": "h200",
    "a100": "a100-80gb",
    "a100-sxm": "a100-80gb",
    "a100-sxm4": "a100-80gb",
    "a100-sxm-80gb": "a100-80gb",
    "a100-80gb-sxm": "a100-80gb",
    "a100-sxm4-80gb": "a100-80gb",  # torch: "NVIDIA A100-SXM4-80GB"
    "a100-sxm-40gb": "a100-40gb",
    "a100-40gb-sxm": "a100-40gb",
    "a100-sxm4-40gb": "a100-40gb",  # torch: "NVIDIA A100-SXM4-40GB"
    "a100-pcie": "a100-80gb-pcie",
    "a100-pcie-80gb": "a100-80gb-pcie",  # torch: "NVIDIA A100 80GB PCIe" is the preset itself
    "a100-pcie-40gb": "a100-40gb-pcie",  # torch: "NVIDIA A100-PCIE-40GB"
}


def normalise_device_name(name: str) -> str:
    """The form presets and aliases are stored in: lower case, runs of spaces, underscores
    and dashes as one dash, no leading ``NVIDIA``/``Tesla``, ``80 GB`` as ``80gb``.

    E.g. ``"NVIDIA H100 80GB HBM3"`` -> ``"h100-80gb-hbm3"``, ``" H100_SXM "`` -> ``"h100-sxm"``.
    """
    text = re.sub(r"[\s_\-]+", "-", name.strip().lower()).strip("-")
    text = re.sub(r"^(nvidia|tesla)-", "", text)
    return re.sub(r"(\d)-gb\b", r"\1gb", text)


def preset_aliases(preset: str) -> tuple[str, ...]:
    """The other names :func:`device_preset` accepts for the canonical ``preset``, sorted."""
    return tuple(sorted(a for a, p in ALIASES.items() if p == preset))


def closest_presets(name: str, n: int = 3) -> list[str]:
    """Up to ``n`` names close to ``name`` (difflib ratio >= 0.6 on normalised names), each as
    ``"alias (= preset)"`` or ``"preset"``, one per preset, closest first."""
    known = [*PRESETS, *ALIASES]
    out: list[str] = []
    seen: set[str] = set()
    for match in difflib.get_close_matches(normalise_device_name(name), known, n=len(known),
                                           cutoff=0.6):
        preset = ALIASES.get(match, match)
        if preset not in seen:
            seen.add(preset)
            out.append(match if match == preset else f"{match} (= {preset})")
        if len(out) == n:
            break
    return out


def device_preset(name: str) -> DeviceSpec:
    """Look up a preset by any name people type for it.

    Case, spaces, underscores and dashes do not matter, nor does a leading ``NVIDIA``:
    ``"h100"``, ``"H100-SXM"``, ``"NVIDIA H100 80GB HBM3"`` (as ``torch.cuda.get_device_name``
    prints it) all give ``PRESETS["h100-sxm"]``. :data:`ALIASES` lists the other names.

    Args:
        name: a preset name, an alias or a CUDA device name.

    Returns:
        The preset's :class:`DeviceSpec` (its ``name`` is the canonical preset name).

    Raises:
        PlanError: unknown name; the message suggests the closest names and lists the presets.
    """
    key = normalise_device_name(name)
    spec = PRESETS.get(ALIASES.get(key, key))
    if spec is not None:
        return spec
    close = closest_presets(name)
    hint = f"did you mean {', '.join(close)}? " if close else ""
    raise PlanError(f"unknown device preset {name!r}; {hint}presets: {', '.join(PRESETS)} "
                    "(`autopart devices` lists them with every name they accept)")


@dataclass(frozen=True, slots=True)
class Cluster:
    """Devices in pipeline order; link ``i`` joins ``devices[i]`` and ``devices[i + 1]``.

    Attributes:
        devices: one spec per rank.
        device_names: runtime device strings per rank (``"cuda:0"``, ``"cpu"``).
    """

    devices: tuple[DeviceSpec, ...]
    device_names: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.devices:
            raise PlanError("Cluster needs at least one device, got none; pass one DeviceSpec "
                            "per rank")
        if len(self.devices) != len(self.device_names):
            raise PlanError(f"Cluster: {len(self.devices)} device specs but "
                             f"{len(self.device_names)} device names")

    @property
    def num_ranks(self) -> int:
        """Number of ranks (devices)."""
        return len(self.devices)

    def transfer_us(self, nbytes: int, src: int, dst: int) -> float:
        """Time to move ``nbytes`` from rank ``src`` to rank ``dst``, µs (0 on the same device).

        Uses the slower endpoint's link: bytes / bandwidth + latency.
        """
        if nbytes <= 0 or self.device_names[src] == self.device_names[dst] and src == dst:
            return 0.0
        a, b = self.devices[src], self.devices[dst]
        bw = min(a.link_bandwidth_bytes_per_s, b.link_bandwidth_bytes_per_s)
        return nbytes / bw * 1e6 + max(a.link_latency_us, b.link_latency_us)

    def fingerprint(self) -> str:
        """Short text naming the devices, e.g. ``"4xh100-sxm"`` or ``"cpu,cpu"``."""
        names = [d.name for d in self.devices]
        if len(set(names)) == 1:
            return f"{len(names)}x{names[0]}"
        return ",".join(names)

    @classmethod
    def uniform(cls, spec: DeviceSpec, device_names: list[str] | tuple[str, ...]) -> Cluster:
        """A cluster of identical devices."""
        return cls(tuple(spec for _ in device_names), tuple(device_names))
