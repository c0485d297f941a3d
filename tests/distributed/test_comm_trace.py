"""A traced 3D step records every rank's collectives on a comm lane of its own: ZeRO-0's
bucketed all-reduce (one slice per bucket), FSDP2's all-gathers and reduce-scatters (per
unit), the collectives after the step, and the time each rank's thread was blocked on them
(exposed), on 4 real gloo processes (pp2 x dp2). Counts and containment only: no verdict
depends on timing."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import pytest

from autopart.core.trace import Trace
from tests.distributed.spawned import free_port, launch

M = 2  # microbatches of the worker's plans

CASES = [(0, False), (1, False), (3, True)]



@pytest.fixture(scope="module")
def traces() -> dict[str, Any]:
    """Every case's trace (dp replica 0's pipeline) and FSDP units per pp rank, from one
    launch of 4 ranks."""
    with tempfile.TemporaryDirectory() as out:
        proc = launch("tests.distributed.comm_trace_worker", "traced", 4, 4, free_port(),
                      CASES, out, timeout_s=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return {p.stem: json.loads(p.read_text()) for p in Path(out).glob("*.json")}


def _comm(trace: Trace, rank: int, kind: str) -> list[str]:
    return [e.name for e in trace.of_rank(rank) if e.lane == "comm" and e.kind == kind]


def _check_lanes(data: dict[str, Any]) -> Trace:
    """Shared by every case: the Chrome JSON names a compute and a comm thread per rank,
    round-trips with its lanes, each rank's exposed slices lie inside its comm slices (so
    exposed <= comm), and one ``reduce grads`` collective closes each rank's step."""
    chrome = data["trace"]
    threads = {(e["pid"], e["args"]["name"]) for e in chrome["traceEvents"]
               if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {(r, n) for r in (0, 1) for n in ("compute", "comm")} <= threads
    trace = Trace.from_chrome(chrome)
    again = Trace.from_chrome(trace.to_chrome())
    assert sorted(again.events, key=repr) == sorted(trace.events, key=repr)
    for r in range(trace.num_ranks):
        comm = [e for e in trace.of_rank(r) if e.lane == "comm"]
        exposed = [e for e in trace.of_rank(r) if e.kind == "exposed"]
        assert exposed and all(e.lane == "compute" for e in exposed)
        for e in exposed:  # each inside the collective it waited for
            assert any(c.start_us - 1e-3 <= e.start_us and e.end_us <= c.end_us + 1e-3
                       and c.name == e.name.removeprefix("exposed ") for c in comm), e
        assert 0 < trace.exposed_comm_us(r) <= trace.comm_us(r) + 1e-3
        assert _comm(trace, r, "reduce") == ["reduce grads"]
        assert trace.comm_by_rank()[r] == (trace.comm_us(r), trace.exposed_comm_us(r))
    return trace


def test_zero0_traces_one_all_reduce_per_bucket_and_its_wait(traces: dict[str, Any]) -> None:
    trace = _check_lanes(traces["zero0"])
    for r in (0, 1):  # one stage per rank, smaller than a bucket: one bucket each
        assert _comm(trace, r, "all_reduce") == [f"all_reduce bucket 0 stage {r}"]
        assert [e.name for e in trace.of_rank(r) if e.kind == "exposed"] == [
            f"exposed all_reduce bucket 0 stage {r}", "exposed reduce grads"]
        assert not _comm(trace, r, "all_gather") and not _comm(trace, r, "reduce_scatter")
        bucket = next(e for e in trace.of_rank(r) if e.lane == "comm" and e.kind == "all_reduce")
        last_backward = max(e.start_us for e in trace.of_rank(r) if e.action is not None
                            and e.action[1] == "B")
        assert bucket.start_us >= last_backward  # launched in the stage's last backward


@pytest.mark.parametrize(("case", "scatters_per_unit"), [("zero1", 1), ("zero3_layers", M)])
def test_fsdp_traces_each_units_collectives_all_exposed_on_cpu(
        traces: dict[str, Any], case: str, scatters_per_unit: int) -> None:
    # ZeRO-1 (one unit per stage): one reduce-scatter per stage and step; ZeRO-3 per layer:
    # one per unit and microbatch; every unit all-gathers at least once; on CPU every FSDP
    # collective is synchronous, so each is exposed whole
    data = traces[case]
    trace = _check_lanes(data)
    for r, units in enumerate(data["units"]):
        scatters = _comm(trace, r, "reduce_scatter")
        assert sorted(scatters) == sorted(f"reduce_scatter {u}" for u in units
                                          for _ in range(scatters_per_unit))
        gathers = set(_comm(trace, r, "all_gather"))
        assert gathers == {f"all_gather {u}" for u in units}
        exposed = sorted(e.name for e in trace.of_rank(r) if e.kind == "exposed")
        fsdp = sorted(f"exposed {n}" for n in _comm(trace, r, "all_gather") + scatters)
        assert exposed == sorted([*fsdp, "exposed reduce grads"])
        assert not _comm(trace, r, "all_reduce")
