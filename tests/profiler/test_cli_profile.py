"""Tests of `autopart profile`: analytical and measured runs, and one-line errors with exit code 2."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from autopart.apps.cli import app
from autopart.core.costgraph import CostGraph

pytest.importorskip("transformers")
SMALL = ["--config", "n_layer=1", "--config", "n_embd=32", "--config", "n_head=2",
         "--config", "vocab_size=128", "--seq-len", "8", "--batch-size", "2"]


@pytest.fixture(autouse=True)
def _cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("AUTOPART_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize("device,source", [("h100-sxm", "analytical:h100-sxm"), ("cpu", "measured:cpu")])
def test_profile_writes_costgraph(tmp_path: Path, device: str, source: str) -> None:
    out = tmp_path / "p.json"
    res = CliRunner().invoke(app, ["profile", "hf:GPT2LMHeadModel", *SMALL, "--device", device,
                                   "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "total" in res.output and "transformer.h.0" in res.output
    costs = CostGraph.load(out)
    assert costs.source == source and costs.batch_size == 2
    again = CliRunner().invoke(app, ["profile", "hf:GPT2LMHeadModel", *SMALL, "--device", device,
                                     "--out", str(out)])
    assert "from cache" in again.output


def test_profile_file_function(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("import torch\n\ndef build():\n"
                   "    return torch.nn.Sequential(torch.nn.Linear(4, 4)), (torch.randn(2, 4),)\n")
    res = CliRunner().invoke(app, ["profile", f"{src}:build", "--out", str(tmp_path / "o.json")])
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize("args,match", [
    (["hf:GPT2LMHeadModel", "--device", "h999"],
     r"unknown device preset 'h999'; presets: h100-sxm, .*h200.*or cpu / cuda:N to measure"),
    (["hf:NoSuchModelXYZ", "--device", "h100-sxm"], r"unknown transformers model class"),
    (["hf:GPT2LMHeadModel", "--config", "nlayer=2"], r"GPT2Config has no key 'nlayer'; valid keys:.*n_layer"),
    (["hf:GPT2LMHeadModel", "--device", "cuda:0"], r"needs CUDA|not a visible GPU"),
    (["hf:GPT2LMHeadModel", "--dtype", "int8"], r"--dtype 'int8'; valid: float32, bfloat16"),
    (["nofile.py:f"], r"valid forms are hf:"),
])
def test_bad_input_is_one_line_exit_2(args: list[str], match: str) -> None:
    import re

    import torch

    if "cuda:0" in args and torch.cuda.is_available():
        pytest.skip("checks the no-GPU error")
    res = CliRunner().invoke(app, ["profile", *args])
    assert res.exit_code == 2
    assert re.search(match, res.output) and "Traceback" not in res.output
    assert len(res.output.strip().splitlines()) == 1
