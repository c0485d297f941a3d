"""Dead and hung ranks of 3D plans are named: a rank that dies or hangs inside a tensor-parallel
collective or a data-parallel gradient reduction (real gloo processes, tiny GPT-2, fixed plans)
makes the others fail the step with a ``PipelineFailure`` naming it by global rank and (pp, dp,
tp) coordinates; a hung one is told to exit. Verdicts are on who is named and on exit codes,
never on time."""

import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
KILLED, HUNG_EXIT, SURVIVED_FAILING, SUCCEEDED = 17, 75, 3, 5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(layout: str, world: int, victim: int, how: str,
            step_timeout_s: float) -> list[tuple[int, str]]:
    """Separate processes (not mp.spawn, which would end the survivors for us); each rank's
    exit code and stderr."""
    port = _free_port()
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        from tests.distributed.faults_worker import fails
        fails(int(sys.argv[1]), {world}, {port}, {layout!r}, {victim}, {how!r},
              {step_timeout_s})
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script, str(r)], cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
             for r in range(world)]
    try:
        results = [p.communicate(timeout=400) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [(p.returncode, err) for p, (_, err) in zip(procs, results, strict=True)]


def _failure(err: str) -> str:
    lines = [x for x in err.splitlines() if x.startswith("failure: ")]
    assert lines, err[-3000:]
    return lines[0]


# one collective each (CI's time): a rank killed inside ZeRO-0's gradient all-reduce, and
# one hung beside a tp all-reduce (below); the other two pairings ran until 2026-12-03
@pytest.mark.parametrize(("layout", "who"), [("zero0", "rank 1 (pp 0, dp 1, tp 0; stages [0])")],
                         ids=["dp2-zero0"])
def test_a_rank_killed_inside_a_tp_or_dp_collective_is_named(layout: str, who: str) -> None:
    # tp2: rank 0 waits in the stage's tp all-reduce; dp2: in ZeRO-0's gradient all-reduce
    # after the step (ZeRO 1-3's FSDP2 collectives run inside the step, as tp's do)
    (code0, err0), (code1, err1) = _launch(layout, 2, 1, "dies", 30.0)
    assert code1 == KILLED, err1[-3000:]
    assert code0 == SURVIVED_FAILING, err0[-3000:]
    line = _failure(err0)
    assert f"{who} died or stopped responding" in line, line


@pytest.mark.parametrize(("layout", "world"), [("tp", 4)], ids=["tp2xpp2"])
def test_a_rank_hung_beside_a_tp_or_dp_collective_is_named_and_told_to_exit(
        layout: str, world: int) -> None:
    # rank 1 hangs in its forward; its tp peer (rank 0) waits for it in a tp all-reduce inside
    # the same action, and ranks 2 and 3 (pp 1) wait for both in a receive; with dp2, its
    # replica waits in the gradient all-reduce. Every other rank names rank 1 only (rank 0,
    # which waits in a collective, is not hung) and rank 1's heartbeat thread ends it.
    step_timeout_s = 8.0
    results = _launch(layout, world, 1, "hangs", step_timeout_s)
    code1, err1 = results[1]
    assert code1 == HUNG_EXIT, err1[-3000:]
    assert "exits: it hangs in action 0F1" in err1, err1[-3000:]
    coords = "pp 0, dp 0, tp 1" if layout == "tp" else "pp 0, dp 1, tp 0"
    for r, (code, err) in enumerate(results):
        if r == 1:
            continue
        assert code == SURVIVED_FAILING, f"rank {r}: {err[-3000:]}"
        line = _failure(err)
        assert f"rank 1 ({coords}; stages [0]) hangs in action 0F1" in line, line
        assert "died or stopped responding" not in line, line
        assert line.count(" hangs in action ") == 1, line  # nobody else is called hung
