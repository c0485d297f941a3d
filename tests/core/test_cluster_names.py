"""Device presets answer to the names people type and torch prints; an unknown name gets the
closest ones; every figure has a datasheet source and agrees with it."""

from __future__ import annotations

import re

import pytest

from autopart.core.cluster import (
    ALIASES,
    PRESETS,
    closest_presets,
    device_preset,
    normalise_device_name,
    preset_aliases,
)
from autopart.core.errors import PlanError


@pytest.mark.parametrize(("name", "preset"), [
    ("h100", "h100-sxm"),
    ("H100", "h100-sxm"),
    ("h100-sxm", "h100-sxm"),
    ("H100 SXM5", "h100-sxm"),
    ("h100_sxm", "h100-sxm"),
    ("  H100--SXM  ", "h100-sxm"),
    ("NVIDIA H100 80GB HBM3", "h100-sxm"),  # torch.cuda.get_device_name, H100 SXM5
    ("h100-pcie", "h100-pcie"),
    ("NVIDIA H100 PCIe", "h100-pcie"),  # torch.cuda.get_device_name, H100 PCIe
    ("H200", "h200"),
    ("NVIDIA H200", "h200"),  # torch.cuda.get_device_name, H200 (SXM and NVL)
    ("a100", "a100-80gb"),
    ("A100-80GB", "a100-80gb"),
    ("a100 80 GB", "a100-80gb"),
    ("a100-40gb", "a100-40gb"),
    ("NVIDIA A100-SXM4-80GB", "a100-80gb"),  # torch.cuda.get_device_name, A100 SXM4 80GB
    ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
    ("NVIDIA A100 80GB PCIe", "a100-80gb-pcie"),
    ("NVIDIA A100-PCIE-40GB", "a100-40gb-pcie"),
    ("a100-pcie", "a100-80gb-pcie"),
    ("NVIDIA L4", "l4"),
    ("Tesla A100-SXM4-40GB", "a100-40gb"),
    ("CPU", "cpu"),
])
def test_names_people_type_give_the_preset(name: str, preset: str) -> None:
    spec = device_preset(name)
    assert spec is PRESETS[preset]
    assert spec.name == preset  # profiles and plans record the canonical name


@pytest.mark.parametrize(("name", "normal"), [
    ("NVIDIA H100 80GB HBM3", "h100-80gb-hbm3"),
    (" H100_SXM ", "h100-sxm"),
    ("A100 80 GB", "a100-80gb"),
    ("nvidia-l4", "l4"),
    ("h100 - - pcie", "h100-pcie"),
])
def test_normalise(name: str, normal: str) -> None:
    assert normalise_device_name(name) == normal


def test_alias_table_is_consistent() -> None:
    for alias, preset in ALIASES.items():
        assert preset in PRESETS, alias
        assert alias not in PRESETS, f"{alias} is a preset name and an alias"
        assert normalise_device_name(alias) == alias, f"alias {alias!r} is not normalised"
    for name in PRESETS:
        assert normalise_device_name(name) == name
    assert preset_aliases("h100-sxm") == tuple(sorted(
        a for a in ALIASES if ALIASES[a] == "h100-sxm"))
    assert "h100-80gb-hbm3" in preset_aliases("h100-sxm")
    assert preset_aliases("l4") == ()


@pytest.mark.parametrize(("name", "match"), [
    ("h10", r"unknown device preset 'h10'; did you mean h100 \(= h100-sxm\)\? presets: "
            r"h100-sxm, h100-pcie, .*`autopart devices`"),
    ("a100-96gb", r"did you mean a100-80gb, a100-40gb"),
    ("NVIDIA H100 NVL", r"'NVIDIA H100 NVL'; did you mean h100 \(= h100-sxm\)"),
    ("rtx4090", r"unknown device preset 'rtx4090'; presets: h100-sxm"),  # nothing close
    ("", r"unknown device preset ''; presets:"),
])
def test_unknown_names_suggest_the_closest(name: str, match: str) -> None:
    with pytest.raises(PlanError, match=match):
        device_preset(name)


def test_closest_presets_one_per_preset_closest_first() -> None:
    close = closest_presets("a100-80g")
    assert close[0] == "a100-80gb"
    targets = [c.split("(= ")[-1].rstrip(")") for c in close]
    assert len(targets) == len(set(targets))  # one suggestion per preset
    assert closest_presets("h100-sxm4", n=1) == ["h100-sxm"]
    assert closest_presets("zzzz") == []


@pytest.mark.parametrize("name", [n for n in PRESETS if n != "cpu"])
def test_every_gpu_figure_has_a_source_that_states_it(name: str) -> None:
    spec = PRESETS[name]
    assert spec.url.startswith("https://www.nvidia.com/") or spec.url.startswith(
        "https://resources.nvidia.com/"), spec.url
    assert "datasheet" in spec.source and "datasheet" in spec.flops_source
    gb = spec.memory_bytes // 10**9
    assert re.search(rf"\b{gb} ?GB\b", spec.source), (spec.source, gb)
    # TF32 tensor cores run at half the BF16 rate on Ampere, Ada and Hopper (every datasheet)
    assert spec.peak_flops_tf32 == pytest.approx(spec.peak_flops_bf16 / 2, rel=0.01)
    assert spec.peak_flops_fp32 < spec.peak_flops_tf32 < spec.peak_flops_bf16
    assert spec.peak_flops == pytest.approx(spec.peak_flops_bf16, rel=0.01)
    # a stage-to-stage link is slower than the device's own memory
    assert spec.link_bandwidth_bytes_per_s < spec.memory_bandwidth_bytes_per_s


def test_pcie_parts_are_not_the_sxm_parts() -> None:
    sxm, pcie = device_preset("NVIDIA H100 80GB HBM3"), device_preset("NVIDIA H100 PCIe")
    assert pcie.peak_flops_bf16 < sxm.peak_flops_bf16
    assert pcie.memory_bandwidth_bytes_per_s < sxm.memory_bandwidth_bytes_per_s
    assert pcie.link_bandwidth_bytes_per_s < sxm.link_bandwidth_bytes_per_s  # PCIe, not NVLink
    a_sxm, a_pcie = device_preset("NVIDIA A100-SXM4-80GB"), device_preset("NVIDIA A100 80GB PCIe")
    assert a_pcie.link_bandwidth_bytes_per_s < a_sxm.link_bandwidth_bytes_per_s
    assert a_pcie.memory_bytes == a_sxm.memory_bytes
