"""Tests of `autopart plan` and `autopart show`: plan tables, certificate, baselines, one-line errors."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from rich.console import Console
from typer.testing import CliRunner

from autopart.apps.cli import app
from autopart.apps.report import pareto_table
from autopart.core.costgraph import CostGraph, NodeCost
from autopart.core.plan import BaselineReport, Plan


def synthetic(num_layers: int = 4, *, source: str = "analytical:h100-sxm") -> CostGraph:
    """emb -> h.0 .. h.{L-1} (two nodes each) -> head, 1 MB activations, 4 MB per layer of weights."""
    specs = [("emb", "emb.w")]
    for i in range(num_layers):
        specs += [(f"h.{i}.mlp", f"h.{i}.w"), (f"h.{i}", "")]
    specs.append(("head", "head.w"))
    nodes, prev, params = [], "x", {}
    for i, (module, param) in enumerate(specs):
        if param:
            params[param] = 4 * 2**20
        nodes.append(NodeCost(
            name=f"n{i}", op="aten.test.default", module_path=module, fwd_us=100.0,
            bwd_input_us=100.0, bwd_weight_us=100.0, flops=0, bytes_accessed=0,
            output_bytes=2**20, saved_bytes=2**20, param_bytes=params.get(param, 0) if param else 0,
            inputs=(prev,), params=(param,) if param else ()))
        prev = f"n{i}"
    return CostGraph(nodes=tuple(nodes), graph_inputs={"x": 2**20}, graph_outputs=(prev,),
                     param_sizes=params, param_numel={k: v // 4 for k, v in params.items()},
                     trainable=frozenset(params), source=source, bwd_source="estimated:test",
                     batch_size=8, fingerprint="cli-test")


@pytest.fixture
def profile(tmp_path: Path) -> Path:
    path = tmp_path / "profile.json"
    synthetic().save(path)
    return path


def invoke(*args: str) -> tuple[int, str]:
    res = CliRunner().invoke(app, list(args))
    return res.exit_code, res.output


def test_plan_devices_writes_and_prints(profile: Path, tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    code, text = invoke("plan", str(profile), "--pipeline-only",
                        "--devices", "2", "--time-limit", "5", "--out", str(out))
    assert code == 0, text
    plan = Plan.load(out)
    assert plan.num_stages == 2 * plan.stages_per_rank and plan.cluster_fingerprint == "2xh100-sxm"
    assert plan.batch_size == 8 and plan.library_versions["ortools"]
    assert f"autopart plan: {plan.num_stages} stages" in text and "solver certificate" in text
    assert re.search(r"gap\s*│\s*\d+\.\d\d%", text) and f"wrote {out}" in text


def test_plan_cluster_options_reach_the_solver(profile: Path, tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    code, text = invoke("plan", str(profile), "--pipeline-only",
                        "--cluster", "a100-80gb:3", "--optimize", "memory",
                        "--batch-size", "16", "--num-microbatches", "4", "--schedule", "gpipe",
                        "--out", str(out))
    assert code == 0, text
    plan = Plan.load(out)
    assert plan.cluster_fingerprint == "3xa100-80gb" and plan.optimize == "memory"
    assert (plan.batch_size, plan.num_microbatches, plan.schedule_kind) == (16, 4, "gpipe")
    assert [st.device for st in plan.stages] == ["cuda:0", "cuda:1", "cuda:2"]


def test_plan_lists_baselines_that_do_not_apply(tmp_path: Path) -> None:
    path = tmp_path / "small.json"
    synthetic(num_layers=2).save(path)  # 2 blocks: torchtitan's split needs one per stage
    code, text = invoke("plan", str(path), "--pipeline-only",
                        "--devices", "3", "--out", str(tmp_path / "p.json"))
    assert code == 0, text
    assert "baselines not applicable" in text
    assert "uniform_layers: 3 stages need at least 3 layers" in " ".join(text.split())


def test_show_prints_baselines_and_certificate(profile: Path, tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    assert invoke("plan", str(profile), "--pipeline-only", "--devices", "2", "--out", str(out))[0] == 0
    plan = Plan.load(out)
    with_baselines = dataclasses.replace(plan, baselines=(
        BaselineReport("uniform_layers", plan.predicted_step_time_us * 1.25, 2**30),))
    with_baselines.save(out)
    code, text = invoke("show", str(out))
    assert code == 0, text
    assert "baselines on the same costs" in text and "uniform_layers" in text and "1.25x" in text
    assert "solver certificate" in text and "OPTIMAL" in text


def test_pareto_table_when_the_plan_has_a_frontier() -> None:
    plan = SimpleNamespace(pareto=({"predicted_step_time_us": 2000.0, "peak_memory_bytes": 2**31},
                                   SimpleNamespace(predicted_step_time_us=1000.0,
                                                   peak_memory_bytes=2**32)))
    table = pareto_table(plan)  # type: ignore[arg-type]
    assert table is not None
    console = Console(width=100, record=True)
    console.print(table)
    rows = [ln for ln in console.export_text().splitlines() if "GiB" in ln]
    assert "1.00" in rows[0] and "4.00 GiB" in rows[0] and "2.00" in rows[1]  # sorted by time
    assert pareto_table(SimpleNamespace(pareto=())) is None  # type: ignore[arg-type]


def _write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("case,extra,match", [
    ("missing", ["--devices", "2"], r"no such file; pass a CostGraph JSON"),
    ("notjson", ["--devices", "2"], r"not JSON"),
    ("list", ["--devices", "2"], r"expected a JSON object \(a CostGraph\), got list"),
    ("schema", ["--devices", "2"], r"CostGraph schema_version 99 is not supported"),
    ("ok", [], r"pass exactly one of --devices N or --cluster PRESET:N"),
    ("ok", ["--devices", "2", "--cluster", "h100-sxm:2"], r"pass exactly one of"),
    ("ok", ["--cluster", "h999:2"], r"unknown device preset 'h999'; presets: h100-sxm, .*autopart devices"),
    ("ok", ["--cluster", "h10:2"], r"unknown device preset 'h10'; did you mean h100 \(= h100-sxm\)\?"),
    ("ok", ["--cluster", "h100-sxm"], r"expected PRESET:N, e.g. h100-sxm:8"),
    ("ok", ["--devices", "0"], r"at least one device, got 0"),
    ("measured", ["--devices", "2"], r"measured on 'cuda:0', which names no device preset"),
    ("ok", ["--devices", "2", "--optimize", "fast"], r"optimize='fast'; expected one of"),
    ("ok", ["--devices", "2", "--num-microbatches", "3"], r"must be >= 1 and divide batch_size=8"),
    ("ok", ["--devices", "2", "--schedule", "pipedream"], r"schedule_kind='pipedream'"),
    ("ok", ["--devices", "2", "--memory-cap", "0.001"], r"memory cap"),
    ("ok", ["--devices", "2", "--memory-cap", "-1"], r"--memory-cap -1.0: must be > 0 GiB"),
])
def test_bad_input_is_one_line_exit_2(tmp_path: Path, case: str, extra: list[str], match: str) -> None:
    good = synthetic().to_dict()
    files = {
        "missing": str(tmp_path / "nope.json"),
        "notjson": _write(tmp_path, "bad.json", "{not json"),
        "list": _write(tmp_path, "list.json", "[1, 2]"),
        "schema": _write(tmp_path, "schema.json", json.dumps({**good, "schema_version": 99})),
        "ok": _write(tmp_path, "ok.json", json.dumps(good)),
        "measured": _write(tmp_path, "m.json", json.dumps({**good, "source": "measured:cuda:0"})),
    }
    code, text = invoke("plan", files[case], "--pipeline-only", *extra, "--out", str(tmp_path / "p.json"))
    assert code == 2, text
    assert re.search(match, text) and "Traceback" not in text
    assert len(text.strip().splitlines()) == 1, text
    assert not (tmp_path / "p.json").exists()


def test_show_bad_plan_is_one_line(tmp_path: Path) -> None:
    code, text = invoke("show", _write(tmp_path, "x.json", "{}"))
    assert code == 2 and len(text.strip().splitlines()) == 1 and "invalid plan" in text
