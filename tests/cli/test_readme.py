"""The README stands alone and says what the code does: its links point inside the
repository, its commands exist, its preset table matches the presets."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from autopart.apps.cli import app
from autopart.core.cluster import PRESETS, device_preset

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_links_point_inside_the_repository() -> None:
    targets = re.findall(r"\]\(([^)\s]+)\)", README)
    assert targets, "no links found"
    anchors = {re.sub(r"[^a-z0-9 -]", "", h.lower()).replace(" ", "-")
               for h in re.findall(r"^#+ (.+)$", README, re.M)}
    for target in targets:
        assert not target.startswith(("http://", "https://", "/", "..")), target
        if target.startswith("#"):
            assert target[1:] in anchors, target
        else:
            assert (ROOT / target).exists(), target
    assert "/work/" not in README and "shared/" not in README


def test_the_newcomer_commands_come_first() -> None:
    quick = README.index("## Quick start")
    assert README.index("make demo") > quick and README.index("make test") > quick
    assert README.index("make demo") < README.index("## Install")


def test_every_autopart_command_shown_exists() -> None:
    blocks = "\n".join(re.findall(r"```bash\n(.*?)```", README, re.S))
    shown = set(re.findall(r"^(?:\.venv/bin/)?autopart ([a-z][a-z-]*)", blocks, re.M))
    registered = {c.name or c.callback.__name__ for c in app.registered_commands
                  if c.callback is not None}
    assert shown, "no autopart commands in the README"
    assert shown <= registered, shown - registered
    assert {"devices", "profile", "plan", "show", "demo"} <= shown


def _preset_rows() -> list[list[str]]:
    start = README.index("### Device presets")
    section = README[start:README.index("\n## ", start)]
    rows = [[c.strip() for c in line.strip("|").split("|")]
            for line in section.splitlines() if line.startswith("| `")]
    assert rows, "no preset table"
    return rows


def test_preset_table_lists_every_preset() -> None:
    assert [row[0].strip("`") for row in _preset_rows()] == list(PRESETS)


@pytest.mark.parametrize("row", _preset_rows(), ids=lambda r: r[0].strip("`"))
def test_preset_table_rows_match_the_presets(row: list[str]) -> None:
    name, aliases, memory, bf16, bandwidth, link = row
    spec = PRESETS[name.strip("`")]
    for alias in re.findall(r"`([^`]+)`", aliases):
        assert device_preset(alias) is spec, alias
    if spec.name == "cpu":
        return
    assert memory == f"{spec.memory_bytes // 10**9} GB"
    assert float(bf16.split()[0]) == pytest.approx(spec.peak_flops_bf16 / 1e12, rel=0.005)
    assert float(bandwidth.split()[0]) == pytest.approx(
        spec.memory_bandwidth_bytes_per_s / 1e12, rel=0.01)
    assert float(link.split()[0]) == pytest.approx(spec.link_bandwidth_bytes_per_s / 1e9)
