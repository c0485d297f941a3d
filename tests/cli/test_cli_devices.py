"""`autopart devices`, `autopart --version`, and the preset names `profile --device` and
`plan --cluster` accept."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from autopart.apps.cli import app
from autopart.core.cluster import ESTIMATE_SOURCE, PRESETS
from autopart.core.costgraph import CostGraph
from autopart.core.plan import Plan
from autopart.core.version import __version__
from tests.cli.test_cli_plan import synthetic


def invoke(*args: str) -> tuple[int, str]:
    res = CliRunner().invoke(app, list(args))
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exc_info
    return res.exit_code, res.output


def test_devices_json_has_every_preset_figure_and_source() -> None:
    code, text = invoke("devices", "--json")
    assert code == 0, text
    rows = {row["name"]: row for row in json.loads(text)}
    assert list(rows) == list(PRESETS)
    h100 = rows["h100-sxm"]
    assert h100["memory_bytes"] == 80 * 10**9
    assert h100["peak_flops_per_s"] == {"float32": 67e12, "tf32": 494.7e12,
                                        "bfloat16": 989.4e12, "float16": 989.4e12}
    assert h100["memory_bandwidth_bytes_per_s"] == 3.35e12
    assert h100["link_bandwidth_bytes_per_s"] == 450e9
    assert "h100" in h100["aliases"] and "h100-80gb-hbm3" in h100["aliases"]
    assert "H100 Tensor Core GPU datasheet" in h100["sources"]["memory_bytes"]
    assert "FP32 67 TFLOPS" in h100["sources"]["peak_flops_per_s"]
    assert h100["sources"]["link_latency_us"] == ESTIMATE_SOURCE
    assert h100["url"].startswith("https://")
    for row in rows.values():  # every figure is named in sources
        figures = {k for k in row if k not in ("name", "aliases", "sources", "url")}
        assert set(row["sources"]) == figures, row["name"]
        assert all(row["sources"].values()), row["name"]


def test_devices_table_lists_presets_figures_and_sources() -> None:
    code, text = invoke("devices")
    assert code == 0, text
    for name in PRESETS:
        assert re.search(rf"^│ {re.escape(name)} ", text, re.M), name
    assert re.search(r"│ h100-sxm +│ +80 │ +989\.4 │ +494\.7 │ +67 │ +3\.35 │ +450 │ +5 │", text), text
    assert "h100-sxm  also: h100, " in text
    assert "datasheet: https://" in text and "Link latency and per-op overhead" in text


@pytest.mark.parametrize("name", ["h100", "NVIDIA H100 80GB HBM3", "H100-SXM"])
def test_devices_one_preset_by_any_name(name: str) -> None:
    code, text = invoke("devices", name, "--json")
    assert code == 0, text
    assert [row["name"] for row in json.loads(text)] == ["h100-sxm"]


def test_devices_unknown_name_suggests_the_closest() -> None:
    code, text = invoke("devices", "a100-80")
    assert code == 2, text
    assert "Traceback" not in text and len(text.strip().splitlines()) == 1, text
    assert re.match(r"error: unknown device preset 'a100-80'; did you mean a100-80gb", text), text


def test_version() -> None:
    code, text = invoke("--version")
    assert code == 0, text
    assert re.fullmatch(rf"autopart {re.escape(__version__)} \(python 3\.\d+\.\d+, torch \S+, "
                        r"ortools \S+, transformers [^)]+\)\n", text), text


@pytest.mark.parametrize(("device", "preset"), [
    ("h100", "h100-sxm"),
    ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
])
def test_profile_device_accepts_preset_names(tmp_path: Path, device: str, preset: str) -> None:
    out = tmp_path / "p.json"
    code, text = invoke("profile", "hf:GPT2LMHeadModel", "--config", "n_layer=2",
                        "--config", "n_embd=64", "--config", "n_head=2", "--config",
                        "vocab_size=128", "--seq-len", "16", "--device", device, "--no-cache",
                        "--out", str(out))
    assert code == 0, text
    costs = CostGraph.from_dict(json.loads(out.read_text()))
    assert costs.source == f"analytical:{preset}"
    # the profile names its preset, so `plan --devices N` finds it again
    plan_out = tmp_path / "plan.json"
    code, text = invoke("plan", str(out), "--devices", "2", "--time-limit", "5",
                        "--out", str(plan_out))
    assert code == 0, text
    # a DGX-class preset plans tp, pp and dp together: its fingerprint names the host
    assert Plan.load(plan_out).cluster_fingerprint.split("/")[0] == f"2x{preset}"


@pytest.mark.parametrize(("device", "match"), [
    ("h10", r"--device: unknown device preset 'h10'; did you mean h100 \(= h100-sxm\)\?.*"
            r"or cpu / cuda:N to measure"),
    ("cuda:x", r"--device 'cuda:x': profile device 'cuda:x' is not valid"),
])
def test_profile_bad_device_is_one_line(device: str, match: str) -> None:
    code, text = invoke("profile", "hf:GPT2LMHeadModel", "--device", device)
    assert code == 2, text
    assert "Traceback" not in text and len(text.strip().splitlines()) == 1, text
    assert re.search(match, text), text


@pytest.mark.parametrize(("cluster", "fingerprint"), [
    ("h100:4", "4xh100-sxm"),
    ("NVIDIA A100 80GB PCIe:2", "2xa100-80gb-pcie"),
    ("H200:2", "2xh200"),
])
def test_plan_cluster_accepts_preset_names(tmp_path: Path, cluster: str, fingerprint: str) -> None:
    profile = tmp_path / "profile.json"
    synthetic().save(profile)
    out = tmp_path / "plan.json"
    code, text = invoke("plan", str(profile), "--cluster", cluster, "--time-limit", "5",
                        "--out", str(out))
    assert code == 0, text
    assert Plan.load(out).cluster_fingerprint.split("/")[0] == fingerprint


@pytest.mark.parametrize("args", [
    ["profile", "hf:GPT2LMHeadModel", "--device", "h100"],
    ["demo", "--steps", "1"],
])
def test_a_missing_optional_package_names_its_extra(monkeypatch: pytest.MonkeyPatch,
                                                    args: list[str]) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers now fails
    code, text = invoke(*args)
    assert code == 2, text
    assert "Traceback" not in text and len(text.strip().splitlines()) == 1, text
    assert text.strip() == ("error: this command needs the 'transformers' package, which is not "
                            "installed; install the 'hf' extra: pip install 'autopart[hf]'")
