"""Real multi-process pipelines (gloo, spawned processes, no mocks) against the plain model."""


import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawn(fn: str, world: int, *args: object, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        import torch.multiprocessing as mp
        from tests.distributed.worker import {fn}
        if __name__ == "__main__":
            mp.spawn({fn}, args=({world}, {_free_port()}, *{args!r}), nprocs={world}, join=True)
    """)
    return subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


CASES = [("gpt2", "1f1b", 1, 2, False), ("gpt2", "interleaved_1f1b", 2, 2, False),
         ("gpt2", "zero_bubble", 1, 2, False), ("bert", "1f1b", 1, 4, False),
         ("llama", "interleaved_1f1b", 2, 2, False), ("tied_mlp", "zero_bubble", 1, 4, False),
         ("gpt2", "1f1b", 1, 2, True), ("tied_mlp", "zero_bubble", 1, 2, True),
         # the V schedules: rank 0 holds the first and the last stage (GPT-2's tied wte on
         # one rank, in two stages), stages 1 and 2 meet on rank 1 and hand over in memory
         ("gpt2", "zbv", 2, 2, False), ("tied_mlp", "dualpipev", 2, 2, False)]


@pytest.mark.parametrize(("model", "kind", "v", "world", "recompute"), CASES,
                         ids=[f"{m}-{k}-v{v}-{w}ranks" + ("-recompute" if r else "")
                              for m, k, v, w, r in CASES])
def test_loss_output_and_every_gradient_match(model: str, kind: str, v: int, world: int,
                                              recompute: bool) -> None:
    with tempfile.TemporaryDirectory() as out:
        proc = _spawn("numerics", world, model, kind, v, out, recompute)
        assert proc.returncode == 0, proc.stderr[-3000:]
        reports = {p.name: p.read_text().splitlines() for p in Path(out).iterdir()}
    assert sorted(reports) == [f"rank{r}.txt" for r in range(world)]
    total = 0
    for name, lines in reports.items():
        assert lines[0].startswith("params "), lines
        total += int(lines[0].split()[1])
        assert lines[1:] == [], f"{name}: {lines[1:]}"  # loss, output and every grad matched
    assert total > 0


@pytest.mark.parametrize(("kind", "v"), [("1f1b", 1), ("interleaved_1f1b", 2)])
def test_a_killed_rank_makes_the_others_exit_naming_it(kind: str, v: int) -> None:
    # separate processes (not mp.spawn, which would terminate the survivors for us)
    port, world, victim, timeout_s = _free_port(), 2, 1, 8.0
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        from tests.distributed.worker import dies
        dies(int(sys.argv[1]), {world}, {port}, {victim}, {timeout_s}, {kind!r}, {v})
    """)
    start = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-c", script, str(r)], cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for r in range(world)]
    results = [p.communicate(timeout=300) for p in procs]
    elapsed = time.monotonic() - start  # two interpreters' start-up and compile included
    assert procs[victim].returncode == 17
    survivor_err = results[0][1]
    assert procs[0].returncode != 0
    assert "PipelineFailure" in survivor_err, survivor_err[-3000:]
    stages = "[1]" if v == 1 else "[1, 3]"
    assert f"rank 1 (pp 1, dp 0, tp 0; stages {stages}) died or stopped responding" in survivor_err, \
        survivor_err[-3000:]
    assert elapsed < 240, f"took {elapsed:.0f} s with a {timeout_s} s timeout"  # not minutes


def _reports(out: str, world: int) -> dict[str, list[str]]:
    reports = {p.name: p.read_text().splitlines() for p in Path(out).iterdir()}
    assert sorted(reports) == [f"rank{r}.txt" for r in range(world)]
    return reports


def test_a_meta_model_materialises_only_each_ranks_stages_from_a_checkpoint(tmp_path: Path) -> None:
    import autopart
    from autopart.core.capture import capture
    from tests.plans import even_positions, manual_plan
    from tests.zoo import ZOO

    model, args, target, loss_fn = ZOO["gpt2"]()
    captured = capture(model, tuple(a[:2] for a in args))
    plan = manual_plan(captured, even_positions(captured, 2), 4, 8, schedule_kind="1f1b")
    plan.save(tmp_path / "plan.json")
    autopart.compile(model, args, loss_fn=loss_fn, plan=plan).save(tmp_path / "ckpt")
    every = {name for name, _ in model.named_parameters()}
    with tempfile.TemporaryDirectory() as out:
        proc = _spawn("from_meta", 2, str(tmp_path / "ckpt"), str(tmp_path / "plan.json"), out)
        assert proc.returncode == 0, proc.stderr[-3000:]
        reports = _reports(out, 2)
    owned = [set(reports[f"rank{r}.txt"][0].split()) for r in range(2)]
    for r in range(2):
        assert reports[f"rank{r}.txt"][1:] == [], reports[f"rank{r}.txt"][1:]
        assert owned[r] < every  # a strict subset: the rest never left the meta device
    assert owned[0] | owned[1] == every
    # only the tied embedding / lm_head weight lives on both ranks
    assert owned[0] & owned[1] == {"transformer.wte.weight"}


def test_pipeline_times_data_parallel_gradients_equal_the_full_batch() -> None:
    with tempfile.TemporaryDirectory() as out:
        proc = _spawn("pp_dp", 4, out)
        assert proc.returncode == 0, proc.stderr[-3000:]
        reports = _reports(out, 4)
    for name, lines in reports.items():
        assert lines[0].startswith("params ") and int(lines[0].split()[1]) > 0, lines
        assert lines[1:] == [], f"{name}: {lines[1:]}"


def test_fuse_is_honoured_by_the_distributed_backend() -> None:
    with tempfile.TemporaryDirectory() as out:
        proc = _spawn("fused", 2, out, timeout=400)
        assert proc.returncode == 0, proc.stderr[-3000:]
        reports = _reports(out, 2)
    for name, lines in reports.items():
        assert lines[0].startswith("params ") and int(lines[0].split()[1]) > 0, lines
        assert lines[1:] == [], f"{name}: {lines[1:]}"  # torch.compile'd stages, same numbers


@pytest.mark.parametrize(("kind", "v"), [("1f1b", 1), ("interleaved_1f1b", 2)])
def test_a_hung_rank_is_named_by_the_others_and_told_to_exit(kind: str, v: int) -> None:
    port, world, victim, step_timeout_s = _free_port(), 2, 1, 6.0
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        from tests.distributed.worker import hangs
        hangs(int(sys.argv[1]), {world}, {port}, {victim}, {kind!r}, {v}, {step_timeout_s})
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script, str(r)], cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for r in range(world)]
    results = [p.communicate(timeout=180) for p in procs]
    healthy_err, victim_err = results[0][1], results[victim][1]
    assert procs[0].returncode == 0, healthy_err[-3000:]
    line = next(x for x in healthy_err.splitlines() if "PipelineFailure" in x or "after " in x)
    stages = "[1]" if v == 1 else "[1, 3]"
    assert f"rank 1 (pp 1, dp 0, tp 0; stages {stages}) hangs in action " in line, line
    assert "it was told to exit" in line, line
    elapsed = float(line.split("after ")[1].split(" s:")[0])
    assert elapsed < step_timeout_s + 30, line  # named within the timeout + 30 s (busy CI)
    assert procs[victim].returncode == 75, victim_err[-3000:]  # HUNG_EXIT_CODE
    assert "exits: it hangs in action" in victim_err, victim_err[-3000:]


@pytest.mark.parametrize(("kind", "v", "world"), [("1f1b", 1, 2), ("zero_bubble", 1, 2),
                                                  ("interleaved_1f1b", 2, 2)])
def test_a_real_step_traces_every_action_of_every_rank_in_order(kind: str, v: int,
                                                                world: int) -> None:
    import json

    from autopart.core.schedule import build_schedule
    from autopart.core.trace import Trace

    with tempfile.TemporaryDirectory() as out:
        proc = _spawn("traced", world, kind, v, out)
        assert proc.returncode == 0, proc.stderr[-3000:]
        data = json.loads((Path(out) / "trace.json").read_text())
        peaks = (Path(out) / "peaks.txt").read_text().split()
    trace = Trace.from_chrome(data)  # valid trace-event JSON
    assert {e["pid"] for e in data["traceEvents"] if e["ph"] == "X"} == set(range(world))
    expected = build_schedule(kind, world, 4, v)
    for r in range(world):
        # every action of the schedule once per microbatch, per rank, in the schedule's order
        assert trace.actions(r) == [str(a) for a in expected[r]]
    assert sum(e.name == "loss" for e in trace.events) == 4
    assert all(int(x) > 0 for x in peaks[:world])

@pytest.mark.parametrize("affinity", ["1", "0"])
def test_cpu_ranks_run_their_steps_on_their_own_cores(affinity: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import json
    import os

    allowed = tuple(sorted(os.sched_getaffinity(0)))
    if len(allowed) < 2:
        pytest.skip("needs two cores")
    monkeypatch.setenv("AUTOPART_CPU_AFFINITY", affinity)
    with tempfile.TemporaryDirectory() as out:
        proc = _spawn("pinned", 2, out)
        assert proc.returncode == 0, proc.stderr[-3000:]
        ranks = [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(2)]
    for r in ranks:
        assert r["before"] == r["after"] == [list(allowed)]  # given back after each step
        # 4 microbatches x 2 steps on the first stage, and torch's shape inference once
        assert len(r["during"]) == 9
    if affinity == "0":
        assert [r["cpu_cores"] for r in ranks] == [None, None]
        assert all(d == [list(allowed)] for r in ranks for d in r["during"])
        return
    half = (len(allowed) + 1) // 2
    assert ranks[0]["cpu_cores"] == list(allowed[:half])
    assert ranks[1]["cpu_cores"] == list(allowed[half:])
    for r in ranks:  # every thread of the process, gloo's included, during the step
        assert all(d == [r["cpu_cores"]] for d in r["during"])


CLIP_CASES = [("gpt2", "2.0", 2, 2), ("tied_mlp", "2.0", 4, 4), ("gpt2", "inf", 2, 2),
              ("gpt2", "2.0", 4, 2)]


@pytest.mark.parametrize(("model", "norm_type", "world", "pp"), CLIP_CASES,
                         ids=[f"{m}-norm{n}-{w}ranks-pp{p}" for m, n, w, p in CLIP_CASES])
def test_clip_grad_norm_is_the_whole_models_norm(model: str, norm_type: str, world: int,
                                                 pp: int) -> None:
    # tied weights (gpt2's wte/lm_head, tied_mlp) are counted once; with pp x dp
    # (world 4, pp 2) the data-parallel replicas are not counted twice
    with tempfile.TemporaryDirectory() as out:
        proc = _spawn("clip_norm", world, model, norm_type, pp, out)
        assert proc.returncode == 0, proc.stderr[-3000:]
        reports = _reports(out, world)
    for name, lines in reports.items():
        assert lines[0].startswith("params ") and int(lines[0].split()[1]) > 0, lines
        assert lines[1:] == [], f"{name}: {lines[1:]}"


def test_a_torchrun_script_that_never_calls_init_process_group_runs() -> None:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                f"--master-port={_free_port()}", "--max-restarts=0"]
    proc = subprocess.run([*torchrun, str(ROOT / "tests/distributed/torchrun_no_init.py")],
                          cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 0 ok loss" in proc.stdout and "rank 1 ok loss" in proc.stdout, proc.stdout
    said = [x for x in proc.stderr.splitlines() if "initialised the default process group" in x]
    assert len(said) == 1 and "gloo, 2 ranks" in said[0], proc.stderr[-3000:]  # once, rank 0


def test_an_explicit_group_wins_and_partial_torchrun_variables_are_named(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import autopart
    from autopart.runtime.distributed import launch

    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    assert launch.init_from_env() is False  # not under torchrun: nothing to do
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(autopart.PlanError, match="MASTER_ADDR, MASTER_PORT are not"):
        launch.init_from_env()
    import torch.distributed as dist
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    monkeypatch.setenv("WORLD_SIZE", "1")
    dist.init_process_group("gloo", rank=0, world_size=1)  # the program's own group
    try:
        assert launch.init_from_env() is False and dist.get_world_size() == 1
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("mode", ["autocast", "bf16"])
def test_bf16_on_two_ranks_matches_the_plain_model_run_the_same_way(mode: str) -> None:
    # tolerances justified in tests/precision.py
    with tempfile.TemporaryDirectory() as out:
        proc = _spawn("mixed_precision", 2, mode, out)
        assert proc.returncode == 0, proc.stderr[-3000:]
        reports = _reports(out, 2)
    for name, lines in reports.items():
        assert lines[0].startswith("ok "), f"{name}: {lines}"


@pytest.mark.parametrize(("kind", "v"), [("1f1b", 1), ("interleaved_1f1b", 2)])
def test_a_stage_whose_only_input_is_the_token_ids_trains(kind: str, v: int) -> None:
    """torch's shape inference runs a stage on ``torch.empty`` inputs; uninitialised token
    ids were out-of-range indices for the next rank's embedding (an IndexError)."""
    with tempfile.TemporaryDirectory() as out:
        proc = _spawn("integer_cut", 2, kind, v, out)
        assert proc.returncode == 0, proc.stderr[-3000:]
        reports = {p.name: p.read_text().splitlines() for p in Path(out).iterdir()}
    for name, lines in sorted(reports.items()):
        assert lines[0].startswith("cut "), lines
        assert lines[1:] == [], f"{name}: {lines[1:]}"  # loss and every gradient matched


@pytest.mark.parametrize("kind", ["zero_bubble", "1f1b"])
def test_a_stage_output_the_stage_saves_survives_a_split_backward(kind: str) -> None:
    """torch's ``stage_backward_input`` detaches every stage output in place; a stage that
    saved one of them (a linear's input it also sends on) crashed in its ``W`` with 'Trying
    to use a saved tensor that has been detached in-place'."""
    with tempfile.TemporaryDirectory() as out:
        proc = _spawn("reused_output", 3, kind, out)
        assert proc.returncode == 0, proc.stderr[-3000:]
        reports = {p.name: p.read_text().splitlines() for p in Path(out).iterdir()}
    for name, lines in sorted(reports.items()):
        assert lines[0] == "cuts [1, 4]: [['linear'], ['linear_1', 'linear_2']]", lines
        assert lines[1:] == [], f"{name}: {lines[1:]}"  # loss and every gradient matched
