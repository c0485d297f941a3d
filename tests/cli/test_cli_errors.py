"""Every user error of the CLI is one line and exit code 2, never a traceback; the
infeasibility message names a device count that was checked to fit, or says none does."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from autopart.apps.cli import app
from autopart.core.plan import BaselineReport, Plan
from tests.cli.test_cli_plan import synthetic


def invoke(*args: str) -> tuple[int, str]:
    res = CliRunner().invoke(app, list(args))
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exc_info
    return res.exit_code, res.output


def one_line(code: int, text: str, match: str) -> None:
    assert code == 2, text
    assert "Traceback" not in text and len(text.strip().splitlines()) == 1, text
    assert re.search(match, text), text


@pytest.fixture
def plan_file(tmp_path: Path) -> Path:
    profile = tmp_path / "profile.json"
    synthetic().save(profile)
    out = tmp_path / "plan.json"
    # one stage per rank (the edits below count stages); the solver's own choice may be a V
    assert invoke("plan", str(profile), "--pipeline-only", "--devices", "2", "--schedule", "1f1b",
                  "--out", str(out))[0] == 0
    return out


@pytest.mark.parametrize(("content", "match"), [
    (None, r"nope.json: cannot read a plan file there \(No such file"),
    ("dir", r"cannot read a plan file there \(Is a directory\)"),
    (b"\x89PNG\r\n\x1a\n\x00\xff", r"not a JSON plan file \(not UTF-8 text"),
    (b"[" * 100_000, r"nested too deep"),
    (b'{"a": 1, "a": 2}', r"key 'a' appears twice"),
    (b'{"batch_size": 1' + b"0" * 400 + b"}", r"invalid plan"),
    (b"null", r"plan must be a JSON object, got NoneType"),
])
def test_show_bad_files_are_one_line(tmp_path: Path, content: bytes | str | None,
                                     match: str) -> None:
    path = tmp_path / "nope.json"
    if content == "dir":
        path = tmp_path
    elif isinstance(content, bytes):
        path.write_bytes(content)
    one_line(*invoke("show", str(path)), match)


@pytest.mark.parametrize(("edit", "match"), [
    (lambda d: d.update(num_microbatches=2.7), r"num_microbatches=2.7 must be an integer"),
    (lambda d: d.update(num_microbatches=True), r"num_microbatches=True must be an integer"),
    (lambda d: d["ranks"].append(dict(d["ranks"][0], rank=2)), r"2 stages on 3 ranks"),
    (lambda d: d["stages"][1].update(rank="1"), r"stages\[1\].rank='1' must be an integer"),
    (lambda d: d.update(predicted_step_time_us=1e400), r"predicted_step_time_us=inf"),
])
def test_show_mutated_plans_are_one_line(plan_file: Path, edit: object, match: str) -> None:
    data = json.loads(plan_file.read_text())
    edit(data)  # type: ignore[operator]
    plan_file.write_text(json.dumps(data))
    one_line(*invoke("show", str(plan_file)), match)


def test_show_a_hand_written_plan_with_zero_predictions(plan_file: Path) -> None:
    plan = Plan.load(plan_file)
    zero = dataclasses.replace(plan, predicted_step_time_us=0.0, baselines=(
        BaselineReport("uniform_layers", 10.0, 2**30),))
    zero.save(plan_file)
    code, text = invoke("show", str(plan_file))
    assert code == 0, text
    assert "uniform_layers" in text and "Traceback" not in text


@pytest.mark.parametrize(("args", "match"), [
    (["show"], r"Missing argument 'plan'.* \(see `.* show --help`\)"),
    (["nope"], r"No such command 'nope'"),
    (["plan", "p.json", "--devices", "abc"], r"Invalid value for '--devices'"),
    (["plan", "p.json", "--devices", "2", "--bogus"], r"No such option: --bogus"),
    (["profile", "hf:GPT2LMHeadModel", "--batch-size", "0"], r"--batch-size"),
    (["profile", "no_such_file.py:f"], r"valid forms are hf:<transformers model class>"),
    (["profile", "hf:GPT2LMHeadModel", "--config", "n_layer=abc", "--device", "h100-sxm"],
     r"--config 'n_layer=abc': GPT2Config refused it: .*expected int"),
    (["profile", "hf:GPT2LMHeadModel", "--config", "n_head=5", "--device", "h100-sxm"],
     r"GPT2LMHeadModel\(GPT2Config with --config \['n_head=5'\]\) could not be built"),
])
def test_bad_arguments_are_one_line(args: list[str], match: str) -> None:
    one_line(*invoke(*args), match)


@pytest.mark.parametrize(("body", "match"), [
    ("raise RuntimeError('boom')\n", r"importing it failed: RuntimeError: boom"),
    ("def f():\n    raise ValueError('no model')\n", r"calling it failed: ValueError: no model"),
    ("def f():\n    return 3\n", r"returned int; it must return \(model, example_inputs\)"),
    ("def f(:\n", r"importing it failed: SyntaxError"),
])
def test_profile_user_file_errors_are_one_line(tmp_path: Path, body: str, match: str) -> None:
    path = tmp_path / "m.py"
    path.write_text(body)
    one_line(*invoke("profile", f"{path}:f", "--out", str(tmp_path / "c.json")), match)


def test_profile_model_that_cannot_be_captured_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "m.py"
    path.write_text("import torch\n"
                    "class M(torch.nn.Module):\n"
                    "    def forward(self, x):\n"
                    "        if x.sum() > 0:\n"
                    "            return x * 2\n"
                    "        return x\n"
                    "def f():\n"
                    "    return M(), (torch.randn(2, 3),)\n")
    code, text = invoke("profile", f"{path}:f", "--out", str(tmp_path / "c.json"), "--no-cache")
    # torch.export prints the partial graph itself; autopart's own report is one last line
    assert code == 2 and "Traceback" not in text, text
    assert re.match(r"error: .*m.py", text.strip().splitlines()[-1]), text


@pytest.mark.parametrize(("content", "match"), [
    ("dir", r"cannot read it"),
    (b"\xff\xfe", r"cannot read it"),
    (b"[" * 100_000, r"nested too deep"),
    (b'{"nodes": 3}', r"CostGraph"),
])
def test_plan_bad_profile_files_are_one_line(tmp_path: Path, content: bytes | str,
                                             match: str) -> None:
    path = tmp_path if content == "dir" else tmp_path / "c.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    one_line(*invoke("plan", str(path), "--pipeline-only",
                     "--devices", "2", "--out", str(tmp_path / "p.json")),
             match)


def test_plan_unwritable_out_is_one_line(tmp_path: Path) -> None:
    profile = tmp_path / "profile.json"
    synthetic().save(profile)
    blocker = tmp_path / "file"
    blocker.write_text("")
    one_line(*invoke("plan", str(profile), "--pipeline-only",
                     "--devices", "2", "--out", str(blocker / "p.json")),
             r"error: .*file")


def test_memory_infeasible_names_a_device_count_that_fits(tmp_path: Path) -> None:
    profile = tmp_path / "profile.json"
    synthetic(num_layers=8).save(profile)
    CAP = "0.1"  # GiB: each stage also holds an H100's 65 MiB of cuBLAS workspaces
    out = str(tmp_path / "p.json")
    code, text = invoke("plan", str(profile), "--pipeline-only", "--devices", "2", "--memory-cap", CAP,
                        "--out", out)
    one_line(code, text, r"no partition onto 2 ranks fits the memory cap")
    found = re.search(r"— (\d+) devices fit \(checked: largest predicted peak (\d+) bytes", text)
    assert found, text
    n = found.group(1)
    assert int(found.group(2)) <= float(CAP) * 2**30
    # the count named really fits, and one fewer does not
    code, text = invoke("plan", str(profile), "--pipeline-only",
                        "--devices", n, "--memory-cap", CAP, "--out", out)
    assert code == 0, text
    assert max(r.peak_memory_bytes for r in Plan.load(out).ranks) <= float(CAP) * 2**30
    code, text = invoke("plan", str(profile), "--pipeline-only",
                        "--devices", str(int(n) - 1), "--memory-cap", "0.02",
                        "--out", out)
    one_line(code, text, r"fits the memory cap")


def test_memory_infeasible_says_when_no_device_count_fits(tmp_path: Path) -> None:
    profile = tmp_path / "profile.json"
    synthetic(num_layers=8).save(profile)
    out = str(tmp_path / "p.json")
    code, text = invoke("plan", str(profile), "--pipeline-only", "--devices", "2", "--memory-cap", "0.001",
                        "--out", out)
    found = re.search(r"no number of devices fits this cap \(the graph's cuts allow at most "
                      r"(\d+) stages\): raise the cap to at least (\d+) bytes \(([\d.]+) GiB\), "
                      r"which fits on (\d+) devices", text)
    assert found, text
    one_line(code, text, "at least")
    # the cap named fits on the devices named
    code, text = invoke("plan", str(profile), "--pipeline-only", "--devices", found.group(4), "--memory-cap",
                        found.group(3), "--out", out)
    assert code == 0, text
