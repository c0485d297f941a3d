"""benchmarks/pipeline_cpu/peers.py: the LM workloads' DeepSpeed layer lists compute the model,
the harness's helpers, and (with DeepSpeed installed) a whole tiny run on two ranks."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from torch import nn

from benchmarks.pipeline_cpu import lm_workloads, peers

ROOT = Path(__file__).resolve().parents[2]


class _LayerSpec:
    """deepspeed.pipe.LayerSpec's contract: the class and its arguments, built on demand."""

    def __init__(self, typename: type, *module_args: Any, **module_kwargs: Any) -> None:
        self.typename, self.module_args, self.module_kwargs = typename, module_args, module_kwargs

    def build(self) -> nn.Module:
        return self.typename(*self.module_args, **self.module_kwargs)


class _TiedLayerSpec(_LayerSpec):
    def __init__(self, key: str, typename: type, *module_args: Any, forward_fn: Any = None,
                 tied_weight_attr: Any = ("weight",), **module_kwargs: Any) -> None:
        super().__init__(typename, *module_args, **module_kwargs)
        self.key, self.forward_fn, self.tied_weight_attr = key, forward_fn, tied_weight_attr


@pytest.fixture(params=["deepspeed", "stand-in"])
def deepspeed_pipe(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The real ``deepspeed.pipe`` (skipped when it is not installed), or a stand-in with its
    two spec classes (always: CI has no DeepSpeed)."""
    if request.param == "deepspeed":
        return pytest.importorskip("deepspeed.pipe")
    fake = types.ModuleType("deepspeed.pipe")
    fake.LayerSpec, fake.TiedLayerSpec = _LayerSpec, _TiedLayerSpec  # type: ignore[attr-defined]
    package = types.ModuleType("deepspeed")
    package.pipe = fake  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "deepspeed", package)
    monkeypatch.setitem(sys.modules, "deepspeed.pipe", fake)
    return fake


def _run_layers(layers: list[Any], ds: ModuleType, x: Any) -> tuple[Any, dict[str, nn.Module]]:
    """What PipelineModule does on one stage: build each spec (one module per tied key), then
    ``x = layer(x)``, a tied spec with ``forward_fn`` calling ``forward_fn(module, x)``."""
    tied: dict[str, nn.Module] = {}
    for layer in layers:
        if isinstance(layer, ds.TiedLayerSpec):
            mod = tied.setdefault(layer.key, layer.build())
            x = mod(x) if layer.forward_fn is None else layer.forward_fn(mod, x)
        elif isinstance(layer, ds.LayerSpec):
            x = layer.build()(x)
        else:
            assert isinstance(layer, nn.Module), type(layer)
            x = layer(x)
    return x, tied


@pytest.mark.parametrize("vocab", [96, 640])
def test_the_deepspeed_layer_list_computes_the_model(deepspeed_pipe: ModuleType, vocab: int) -> None:
    w = lm_workloads.gpt2_workload("t", "tiny", vocab=vocab, n_layer=3, n_embd=32, n_head=2,
                                   batch=4, seq=16, m=2)
    model, inputs, target, loss_fn = w.build()
    layers = w.ds_layers(model)
    assert [type(x).__name__ for x in layers[1:-2]] == ["GPT2Block"] * 3
    assert sum(1 for x in layers if type(x).__name__ == w.ds_type_regex) == 3
    ds_inputs, labels = w.ds_batch(inputs, target)
    logits, tied = _run_layers(layers, deepspeed_pipe, ds_inputs)
    expected = model(*inputs)
    torch.testing.assert_close(logits, expected.logits, rtol=0, atol=0)
    torch.testing.assert_close(w.ds_loss_fn(logits, labels), loss_fn(expected, target),
                               rtol=0, atol=0)
    # one embedding module serves the input and the head, with the model's tied matrix
    (embed,) = tied.values()
    assert torch.equal(embed.weight, model.transformer.wte.weight)
    assert model.lm_head.weight is model.transformer.wte.weight
    # ... and trains like it: the tied matrix's gradient sums both uses
    w.ds_loss_fn(logits, labels).backward()
    loss_fn(expected, target).backward()
    torch.testing.assert_close(embed.weight.grad, model.transformer.wte.weight.grad,
                               rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(embed.wpe.weight.grad, model.transformer.wpe.weight.grad,
                               rtol=1e-5, atol=1e-7)


def test_the_hand_split_halves_the_blocks() -> None:
    w = lm_workloads.TINY["gpt2_tiny"]
    model = w.build()[0]
    (fqn,) = w.hand_split(model)
    assert fqn == "transformer.h.1" and fqn in dict(model.named_modules())


def test_split_cuts_batch_rows_and_repeats_the_rest() -> None:
    x, y = torch.arange(12).reshape(6, 2), torch.arange(6)
    parts = peers.split(((x, 7), {"y": y, "scale": torch.ones(3)}), 3, 6)
    assert len(parts) == 3
    (x1, seven), rest = parts[1]
    assert torch.equal(x1, x[2:4]) and seven == 7
    assert torch.equal(rest["y"], y[2:4]) and torch.equal(rest["scale"], torch.ones(3))


def test_tied_groups_names_every_shared_parameter() -> None:
    model = lm_workloads.TINY["gpt2_tiny"].build()[0]
    assert peers.tied_groups(model) == [["lm_head.weight", "transformer.wte.weight"]]
    assert peers.tied_groups(nn.Linear(2, 2)) == []


def _launch(arms: dict[str, list[float]], loss: float = 2.0) -> dict[str, Any]:
    return {"arms": {a: {"step_s": sorted(t)[len(t) // 2], "steps_s": t, "first_loss": loss,
                         "loss_check": "pass", "fraction_of_ideal": 0.9}
                     for a, t in arms.items()}, "failed": {}}


def test_summary_pools_launches_and_pairs_steps() -> None:
    launches = [_launch({"autopart": [1.0, 1.0, 1.0], "deepspeed_uniform": [1.5, 1.2, 1.3]}),
                {"error": "ProcessRaisedException: boom", "wall_s": 1.0},
                _launch({"autopart": [2.0, 2.0, 2.0], "deepspeed_uniform": [2.6, 2.4, 2.8]})]
    launches[2]["arms"]["deepspeed_uniform"]["loss_check"] = "FAIL: first loss 2.1 vs single 2.0"
    s = peers.summarize(launches)
    assert s["autopart"]["step_s_per_launch"] == [1.0, 2.0]
    assert s["autopart"]["step_s"] == 1.5 and s["autopart"]["spread_over_launches"] == 0.6667
    ratio = s["deepspeed_uniform"]["time_over_autopart"]
    assert ratio["median"] == 1.3 and ratio["autopart_faster_in"] == "6/6 steps"
    assert "FAIL" in s["deepspeed_uniform"]["loss_check"]  # a failed check stays visible
    assert "time_over_autopart" not in s["autopart"]


def _report() -> ModuleType:
    spec = importlib.util.spec_from_file_location("benchmark_report", ROOT / "benchmarks" / "report.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _results(launches: list[dict[str, Any]]) -> dict[str, Any]:
    return {"machine": "x86_64, 2 cores", "python": "3.11.7", "torch": "2.13.0+cpu",
            "transformers": "5.23.0", "deepspeed": "0.19.8", "ortools": "9.15", "date": "today",
            "command": "python benchmarks/pipeline_cpu/peers.py", "ranks": 2,
            "threads_per_rank": 1, "steps": 3, "warmup": 1, "launches": len(launches),
            "workloads": {"gpt2_x": {
                "description": "GPT-2-like", "batch": 16, "num_microbatches": 8,
                "ideal_speedup": 1.7778, "launches": launches, "summary": peers.summarize(launches),
                "plan": {"schedule": "1f1b", "stages_per_rank": 1, "num_microbatches": 8,
                         "cuts": [120], "predicted_step_s": 0.9}}}}


def test_report_section_shows_every_arm_and_draws_the_chart(tmp_path: Path) -> None:
    launches = [_launch({"autopart": [1.0, 1.1, 0.9], "deepspeed_type": [1.5, 1.4, 1.6],
                         "single": [1.8, 1.7, 1.9]})]
    launches[0]["failed"] = {"deepspeed_parameters": "RuntimeError: no"}
    (tmp_path / "pipeline_cpu").mkdir()
    (tmp_path / "figures").mkdir()
    (tmp_path / "pipeline_cpu" / "results_peers.json").write_text(json.dumps(_results(launches)))
    text = "\n".join(_report().peers_measured(tmp_path, tmp_path / "figures"))
    assert "## Peers, measured" in text and "### gpt2_x" in text
    assert "| deepspeed_type | 1.500 |" in text and "1.500x" in text  # median, ratio
    assert "deepspeed_parameters" in text and "RuntimeError: no" in text
    assert (tmp_path / "figures" / "peers.png").read_bytes()[:4] == b"\x89PNG"
    missing = "\n".join(_report().peers_measured(tmp_path / "none", tmp_path / "figures"))
    assert "No recorded results" in missing


@pytest.mark.slow
def test_peers_runs_every_arm_on_two_ranks(tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    out = tmp_path / "results_peers.json"
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "pipeline_cpu" / "peers.py"),
                           "--workloads", "gpt2_tiny", "--steps", "1", "--warmup", "1",
                           "--launches", "1", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    wl = report["workloads"]["gpt2_tiny"]
    (launch,) = wl["launches"]
    assert launch["failed"] == {}, launch["failed"]
    arms = launch["arms"]
    expected = {"autopart", "deepspeed_parameters", "deepspeed_uniform", "deepspeed_type",
                "hand_split", "single", "torch_1f1b"}
    if wl["plan"]["schedule"] == "interleaved_1f1b":
        expected.add("torch_interleaved_1f1b")
    assert set(arms) == expected
    for arm, row in arms.items():
        assert row["loss_check"] == "pass", (arm, row)
        assert row["loss_trajectory_check"] == "pass", (arm, row)  # 2 steps: the same update
        assert len(row["steps_s"]) == 1 and row["step_s"] > 0
    # DeepSpeed's partitions of [embed, block, block, ln_f, head]: two stages, every layer
    for arm in ("deepspeed_parameters", "deepspeed_uniform", "deepspeed_type"):
        parts = arms[arm]["parts"]
        assert parts[0] == 0 and parts[-1] == 5 and len(parts) == 3
    assert arms["deepspeed_type"]["parts"] == [0, 2, 5]  # one block on each stage
    assert report["deepspeed"] != "not installed"
    assert out.with_suffix(".md").read_text().count("| deepspeed_") == 3
    (tmp_path / "pipeline_cpu").mkdir()
    (tmp_path / "figures").mkdir()
    out.rename(tmp_path / "pipeline_cpu" / "results_peers.json")
    text = "\n".join(_report().peers_measured(tmp_path, tmp_path / "figures"))
    assert "### gpt2_tiny" in text and f"{arms['deepspeed_uniform']['step_s']:.3f}" in text
