"""Real multi-process pipelines (gloo, spawned processes, no mocks) against the plain model.

Most checks here need ranks but not ranks of their own: the tests marked :func:`_batched`
run in one launch per world size (:func:`tests.distributed.spawned.run_cases`, the first
such test of a world size launches every selected one of that size), each case writing its
results into a directory of its own, which its test then reads and asserts on as a launch
of that case alone would. The tests of dying, hanging, pinned and compiled ranks, and of a
checkpoint the test process writes, launch their own."""


import re
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.distributed.spawned import ROOT, Launched, case_dir, free_port, launch, run_cases


def _spawn(fn: str, world: int, *args: object, timeout: float = 240) -> Launched:
    return launch("tests.distributed.worker", fn, world, world, free_port(), *args,
                  timeout_s=timeout)


#: per batched test, what its parameters run: ``(world, check, args)``, a check of
#: :data:`tests.distributed.worker.CASES`
Case = tuple[int, str, tuple[Any, ...]]


def _batched(case: Callable[[dict[str, Any]], Case]) -> Callable[[Any], Any]:
    """Mark a test as one case of its world size's shared launch; ``case`` maps the test's
    parameters to what it runs (its ``batched`` fixture gives the case's directory)."""
    def mark(test: Any) -> Any:
        test.batched_case = case
        return test
    return mark


def _case_of(item: pytest.Item) -> Case | None:
    case = getattr(getattr(item, "function", None), "batched_case", None)
    callspec = getattr(item, "callspec", None)
    return case(dict(callspec.params) if callspec is not None else {}) if case else None


def _key(case: Case) -> str:
    world, check, args = case
    return re.sub(r"[^A-Za-z0-9_-]", "_", "-".join([f"w{world}", check, *map(str, args)]))


class _Launches:
    """The batched cases of this module's selected tests, launched once per world size when
    the first test of that size asks; each case's outcome and directory by key."""

    def __init__(self, root: Path, planned: list[Case]) -> None:
        self.root, self.planned = root, planned
        self.outcome: dict[str, str | None] = {}
        self.dirs: dict[str, Path] = {}

    def case_dir(self, case: Case) -> Path:
        """The directory ``case`` wrote its results to (launching it, and every planned case
        of its world size not launched yet, first).

        Fails the calling test (``pytest.fail``) when the case crashed or its launch failed,
        saying why (the ranks' tracebacks, the launch's stderr), as a launch of the case alone
        exiting non-zero would have.
        """
        key = _key(case)
        if key not in self.outcome:
            world = case[0]
            todo = {_key(c): c for c in [*self.planned, case]
                    if c[0] == world and _key(c) not in self.outcome}
            root = self.root / f"launch{len(list(self.root.iterdir()))}-world{world}"
            root.mkdir()
            self.outcome.update(run_cases("tests.distributed.worker", "batch", world, root,
                                          [(k, c[1], c[2]) for k, c in todo.items()]))
            self.dirs.update({k: case_dir(root, k) for k in todo})
        failure = self.outcome[key]
        if failure is not None:
            pytest.fail(failure)
        return self.dirs[key]


@pytest.fixture(scope="module")
def _launches(request: pytest.FixtureRequest) -> Iterator[_Launches]:
    planned = [c for item in request.session.items
               if getattr(item, "module", None) is request.module
               and (c := _case_of(item)) is not None]
    with tempfile.TemporaryDirectory() as root:
        yield _Launches(Path(root), planned)


@pytest.fixture
def batched(request: pytest.FixtureRequest, _launches: _Launches) -> Callable[[], Path]:
    """This test's case's result directory, as a call (so that a failed launch fails the
    test, not its set-up)."""
    case = _case_of(request.node)
    assert case is not None, f"{request.node.name} is not marked _batched"
    return lambda: _launches.case_dir(case)


# (GPT-2 under 1F1B without recompute: every other file of tests/distributed runs it)
CASES = [("gpt2", "interleaved_1f1b", 2, 2, False),
         ("gpt2", "zero_bubble", 1, 2, False), ("bert", "1f1b", 1, 4, False),
         ("llama", "interleaved_1f1b", 2, 2, False), ("tied_mlp", "zero_bubble", 1, 4, False),
         ("gpt2", "1f1b", 1, 2, True), ("tied_mlp", "zero_bubble", 1, 2, True),
         # the V schedules: rank 0 holds the first and the last stage (GPT-2's tied wte on
         # one rank, in two stages), stages 1 and 2 meet on rank 1 and hand over in memory
         ("gpt2", "zbv", 2, 2, False), ("tied_mlp", "dualpipev", 2, 2, False)]


@pytest.mark.parametrize(("model", "kind", "v", "world", "recompute"), CASES,
                         ids=[f"{m}-{k}-v{v}-{w}ranks" + ("-recompute" if r else "")
                              for m, k, v, w, r in CASES])
@_batched(lambda p: (p["world"], "numerics", (p["model"], p["kind"], p["v"], p["recompute"])))
def test_loss_output_and_every_gradient_match(model: str, kind: str, v: int, world: int,
                                              recompute: bool,
                                              batched: Callable[[], Path]) -> None:
    out = batched()
    reports = {p.name: p.read_text().splitlines() for p in out.iterdir()}
    assert sorted(reports) == [f"rank{r}.txt" for r in range(world)]
    total = 0
    for name, lines in reports.items():
        assert lines[0].startswith("params "), lines
        total += int(lines[0].split()[1])
        assert lines[1:] == [], f"{name}: {lines[1:]}"  # loss, output and every grad matched
    assert total > 0


# one schedule each (the fault paths do not depend on it; CI's time): a killed rank under
# interleaved 1F1B (two stages per rank), a hung one under 1F1B
@pytest.mark.parametrize(("kind", "v"), [("interleaved_1f1b", 2)])
def test_a_killed_rank_makes_the_others_exit_naming_it(kind: str, v: int) -> None:
    # separate processes (not mp.spawn, which would terminate the survivors for us)
    port, world, victim, timeout_s = free_port(), 2, 1, 8.0
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


def _reports(out: str | Path, world: int) -> dict[str, list[str]]:
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


@_batched(lambda p: (4, "pp_dp", ()))
def test_pipeline_times_data_parallel_gradients_equal_the_full_batch(
        batched: Callable[[], Path]) -> None:
    reports = _reports(batched(), 4)
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


@pytest.mark.parametrize(("kind", "v"), [("1f1b", 1)])
def test_a_hung_rank_is_named_by_the_others_and_told_to_exit(kind: str, v: int) -> None:
    port, world, victim, step_timeout_s = free_port(), 2, 1, 6.0
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
@_batched(lambda p: (p["world"], "traced", (p["kind"], p["v"])))
def test_a_real_step_traces_every_action_of_every_rank_in_order(
        kind: str, v: int, world: int, batched: Callable[[], Path]) -> None:
    import json

    from autopart.core.schedule import build_schedule
    from autopart.core.trace import Trace

    out = batched()
    data = json.loads((out / "trace.json").read_text())
    peaks = (out / "peaks.txt").read_text().split()
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
@_batched(lambda p: (p["world"], "clip_norm", (p["model"], p["norm_type"], p["pp"])))
def test_clip_grad_norm_is_the_whole_models_norm(model: str, norm_type: str, world: int,
                                                 pp: int, batched: Callable[[], Path]) -> None:
    # tied weights (gpt2's wte/lm_head, tied_mlp) are counted once; with pp x dp
    # (world 4, pp 2) the data-parallel replicas are not counted twice
    reports = _reports(batched(), world)
    for name, lines in reports.items():
        assert lines[0].startswith("params ") and int(lines[0].split()[1]) > 0, lines
        assert lines[1:] == [], f"{name}: {lines[1:]}"


def test_a_torchrun_script_that_never_calls_init_process_group_runs() -> None:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                f"--master-port={free_port()}", "--max-restarts=0"]
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
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setenv("WORLD_SIZE", "1")
    dist.init_process_group("gloo", rank=0, world_size=1)  # the program's own group
    try:
        assert launch.init_from_env() is False and dist.get_world_size() == 1
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("mode", ["autocast", "bf16"])
@_batched(lambda p: (2, "mixed_precision", (p["mode"],)))
def test_bf16_on_two_ranks_matches_the_plain_model_run_the_same_way(
        mode: str, batched: Callable[[], Path]) -> None:
    # tolerances justified in tests/precision.py
    reports = _reports(batched(), 2)
    for name, lines in reports.items():
        assert lines[0].startswith("ok "), f"{name}: {lines}"


@pytest.mark.parametrize(("kind", "v"), [("1f1b", 1), ("interleaved_1f1b", 2)])
@_batched(lambda p: (2, "integer_cut", (p["kind"], p["v"])))
def test_a_stage_whose_only_input_is_the_token_ids_trains(kind: str, v: int,
                                                          batched: Callable[[], Path]) -> None:
    """torch's shape inference runs a stage on ``torch.empty`` inputs; uninitialised token
    ids were out-of-range indices for the next rank's embedding (an IndexError)."""
    reports = {p.name: p.read_text().splitlines() for p in batched().iterdir()}
    for name, lines in sorted(reports.items()):
        assert lines[0].startswith("cut "), lines
        assert lines[1:] == [], f"{name}: {lines[1:]}"  # loss and every gradient matched


@pytest.mark.parametrize("kind", ["zero_bubble", "1f1b"])
@_batched(lambda p: (3, "reused_output", (p["kind"],)))
def test_a_stage_output_the_stage_saves_survives_a_split_backward(
        kind: str, batched: Callable[[], Path]) -> None:
    """torch's ``stage_backward_input`` detaches every stage output in place; a stage that
    saved one of them (a linear's input it also sends on) crashed in its ``W`` with 'Trying
    to use a saved tensor that has been detached in-place'."""
    reports = {p.name: p.read_text().splitlines() for p in batched().iterdir()}
    for name, lines in sorted(reports.items()):
        assert lines[0] == "cuts [1, 4]: [['linear'], ['linear_1', 'linear_2']]", lines
        assert lines[1:] == [], f"{name}: {lines[1:]}"  # loss and every gradient matched
