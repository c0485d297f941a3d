"""``autopart devices``: the device presets, the names each accepts, their figures and sources."""

from __future__ import annotations

import json
from typing import Any

import typer

__all__ = ["devices", "describe_preset"]


def describe_preset(name: str) -> dict[str, Any]:
    """One preset as JSON-able data: every figure with its unit in the key and its source.

    Args:
        name: a canonical preset name (a key of ``PRESETS``).

    Returns:
        ``{"name", "aliases", "memory_bytes", "peak_flops_per_s": {"float32", "tf32",
        "bfloat16", "float16"}, "memory_bandwidth_bytes_per_s", "link_bandwidth_bytes_per_s",
        "link_latency_us", "op_overhead_us", "sources": {figure: source}, "url"}``. Link
        bandwidth is one direction; peaks are dense (no sparsity).
    """
    from autopart.core.cluster import ESTIMATE_SOURCE, PRESETS, preset_aliases

    spec = PRESETS[name]
    return {
        "name": spec.name,
        "aliases": list(preset_aliases(name)),
        "memory_bytes": spec.memory_bytes,
        "peak_flops_per_s": {
            "float32": spec.peak_flops_for("float32"),
            "tf32": spec.peak_flops_for("float32", tf32=True),
            "bfloat16": spec.peak_flops_for("bfloat16"),
            "float16": spec.peak_flops_for("float16"),
        },
        "memory_bandwidth_bytes_per_s": spec.memory_bandwidth_bytes_per_s,
        "link_bandwidth_bytes_per_s": spec.link_bandwidth_bytes_per_s,
        "link_latency_us": spec.link_latency_us,
        "op_overhead_us": spec.op_overhead_us,
        "sources": {
            "memory_bytes": spec.source,
            "peak_flops_per_s": spec.flops_source or spec.source,
            "memory_bandwidth_bytes_per_s": spec.source,
            "link_bandwidth_bytes_per_s": spec.source,
            "link_latency_us": ESTIMATE_SOURCE,
            "op_overhead_us": ESTIMATE_SOURCE,
        },
        "url": spec.url,
    }


def devices(name: str | None = typer.Argument(None, help="show only this preset; any name it "
                                              "accepts, e.g. h100 or 'NVIDIA H100 80GB HBM3'"),
            as_json: bool = typer.Option(False, "--json", help="print JSON (exact figures, "
                                         "bytes and FLOP/s) instead of tables"),
            ) -> None:
    """List the device presets (for --device and --cluster) with their figures and sources.

    For each preset: the other names it answers to, its memory, dense peak FLOP/s per dtype,
    memory and link bandwidths, and the datasheet each figure comes from.
    """
    from rich.console import Console
    from rich.table import Table

    from autopart.core.cluster import ESTIMATE_SOURCE, PRESETS, device_preset

    names = list(PRESETS) if name is None else [device_preset(name).name]
    rows = [describe_preset(n) for n in names]
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    console = Console(width=None if Console().is_terminal else 120)
    table = Table(title="Device presets (analytical profiles and plans; peaks are dense, "
                        "link bandwidth is one direction)")
    for col in ("preset", "memory GB", "BF16/FP16 TFLOP/s", "TF32 TFLOP/s", "FP32 TFLOP/s",
                "memory TB/s", "link GB/s", "link µs"):
        table.add_column(col, justify="left" if col == "preset" else "right")
    for row in rows:
        peaks = row["peak_flops_per_s"]
        table.add_row(row["name"], f"{row['memory_bytes'] / 1e9:.0f}",
                      f"{peaks['bfloat16'] / 1e12:g}", f"{peaks['tf32'] / 1e12:g}",
                      f"{peaks['float32'] / 1e12:g}",
                      f"{row['memory_bandwidth_bytes_per_s'] / 1e12:g}",
                      f"{row['link_bandwidth_bytes_per_s'] / 1e9:g}",
                      f"{row['link_latency_us']:g}")
    console.print(table)
    for row in rows:
        console.print(f"[bold]{row['name']}[/bold]  also: {', '.join(row['aliases']) or '-'}",
                      highlight=False)
        console.print(f"  figures: {row['sources']['memory_bytes']}", highlight=False)
        console.print(f"  peaks: {row['sources']['peak_flops_per_s']}", highlight=False)
        if row["url"]:
            console.print(f"  datasheet: {row['url']}", highlight=False, soft_wrap=True)
    console.print(f"Link latency and per-op overhead: {ESTIMATE_SOURCE}.", highlight=False)
    console.print("Names are matched ignoring case, spaces, dashes and a leading 'NVIDIA', so "
                  "torch.cuda.get_device_name() output works (e.g. 'NVIDIA H100 80GB HBM3').",
                  highlight=False)
