"""Traces and measured memory of a real step in one process."""

import copy
import json
import math
from itertools import pairwise
from typing import Any

import pytest
import torch

import autopart
from autopart.core.capture import capture
from autopart.core.errors import PlanError
from autopart.core.memory import measure_peak_bytes, resident_bytes
from autopart.core.microbatch import split_leaves
from autopart.core.schedule import build_schedule
from autopart.core.trace import Trace, TraceEvent
from autopart.solver.candidates import find_candidates
from autopart.solver.predict import plan_at
from tests.plans import even_positions, manual_plan
from tests.zoo import ZOO, gpt2


def _pipe(num_stages: int, m: int, kind: str, v: int = 1) -> tuple[Any, ...]:
    model, args, target, loss_fn = gpt2()
    reference = copy.deepcopy(model)
    captured = capture(model, tuple(split_leaves(list(args), m)[0]))
    plan = manual_plan(captured, even_positions(captured, num_stages), m, args[0].shape[0],
                       schedule_kind=kind, stages_per_rank=v)
    pipe = autopart.compile(model, args, loss_fn=loss_fn, plan=plan)
    return pipe, reference, args, target, loss_fn


@pytest.mark.parametrize("kind,v", [("1f1b", 1), ("zero_bubble", 1), ("interleaved_1f1b", 2)])
def test_trace_has_every_action_once_per_rank_in_schedule_order(kind: str, v: int,
                                                                 tmp_path: Any) -> None:
    pipe, reference, args, target, loss_fn = _pipe(4, 4, kind, v)
    loss = pipe.train_step(*args, target=target, trace=True)
    torch.testing.assert_close(loss, loss_fn(reference(*args), target), rtol=1e-5, atol=4e-5)
    trace = pipe.last_trace
    assert trace is not None and trace.source == "measured:cpu"
    p = len(pipe.plan.ranks)
    expected = build_schedule(kind, p, 4, v)
    for r in range(p):
        assert trace.actions(r) == [str(a) for a in expected[r]]
        ev = [e for e in trace.of_rank(r) if e.action is not None]
        assert all(a.end_us <= b.start_us + 1e-3 for a, b in pairwise(ev))  # no overlap
    last = pipe.plan.stages[-1].rank
    assert sum(e.name == "loss" for e in trace.of_rank(last)) == 4
    path = tmp_path / "step.json"
    trace.save(path)
    data = json.loads(path.read_text())
    slices = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in slices} == set(range(p))
    assert Trace.load(path).actions(0) == trace.actions(0)


def test_tracing_off_keeps_no_trace_and_the_same_gradients() -> None:
    pipe, reference, args, target, loss_fn = _pipe(2, 2, "1f1b")
    pipe.train_step(*args, target=target)
    assert pipe.last_trace is None
    loss_fn(reference(*args), target).backward()
    grads = dict(pipe.named_parameters())
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name].grad, p.grad, rtol=1e-5, atol=4e-5)


def test_measured_peak_counts_resident_state_and_the_step() -> None:
    pipe, _, args, target, _ = _pipe(2, 4, "gpipe")
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    pipe.train_step(*args, target=target)
    opt.step()
    opt.zero_grad()
    pipe.train_step(*args, target=target, measure_memory=True, optimizer=opt)
    peak = pipe.last_peak_memory_bytes.by_device["cpu"]
    params = resident_bytes(p for _, p in pipe.named_parameters())
    # weights + their gradients + AdamW's two moments at least; activations on top
    assert peak > 4 * params * 0.99
    pipe.train_step(*args, target=target, measure_memory=True)
    assert pipe.last_peak_memory_bytes.by_device["cpu"] < peak  # optimizer state no longer counted


def test_measure_peak_bytes_sees_a_transient_tensor() -> None:
    def step() -> float:
        x = torch.ones(1 << 20)  # 4 MiB, freed on return
        return float(x.sum())

    out, peaks = measure_peak_bytes(step, [torch.device("cpu")])
    assert out == float(1 << 20)
    assert 4 << 20 <= peaks["cpu"] < 5 << 20


def test_trace_json_errors_are_specific(tmp_path: Any) -> None:
    with pytest.raises(PlanError, match="'traceEvents' list"):
        Trace.from_chrome({"events": []})
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(PlanError, match="is not JSON"):
        Trace.load(bad)
    with pytest.raises(PlanError, match="lacks a valid pid"):
        Trace.from_chrome({"traceEvents": [{"ph": "X", "name": "0F0", "ts": 0}]})
    with pytest.raises(PlanError, match="before it starts"):
        TraceEvent(0, "0F0", 5.0, 1.0)


#: how many of the 2-stage GPT-2's candidate cuts the memory sweep runs, first to last
_SWEEP_CUTS = 6


@pytest.fixture(scope="module")
def gpt2_two_cpu_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, ...]:
    """GPT-2 profiled once for two CPU ranks at m = 4, and the cut positions of the sweep:
    ``_SWEEP_CUTS`` of the solver's candidates, evenly spread from the first to the last
    (they follow from the graph, not from the timings)."""
    with pytest.MonkeyPatch.context() as mp:  # a cache of its own, as every test has
        mp.setenv("AUTOPART_CACHE_DIR", str(tmp_path_factory.mktemp("autopart-cache")))
        mp.setattr("autopart.profiler.cache.machine_busy", lambda: None)
        model, args, target, loss_fn = ZOO["gpt2"]()
        _, profile = autopart.plan_model(model, args, devices=["cpu", "cpu"],
                                         num_microbatches=4, schedule="1f1b",
                                         loss_fn=loss_fn, example_target=target)
    cands = find_candidates(profile.costs, 2).positions
    cuts = sorted({cands[round(k * (len(cands) - 1) / (_SWEEP_CUTS - 1))]
                   for k in range(_SWEEP_CUTS)})
    return model, args, target, loss_fn, profile, cuts


def _shared_replica_bytes(costs: Any, positions: tuple[int, ...], state_factor: float) -> int:
    """What the plan counts more than one device holds, bytes: a parameter read by several
    stages counts on each (a replica per rank, with its gradient and optimizer state), but
    one process's stages on one device share one tensor (:mod:`autopart.codegen.params`)."""
    bounds = [0, *positions, len(costs.nodes)]
    extra = 0
    for name, nbytes in costs.param_sizes.items():
        readers = sum(any(name in nd.params for nd in costs.nodes[a:z])
                      for a, z in pairwise(bounds))
        held = math.ceil(nbytes * (2 + state_factor)) if name in costs.trainable else nbytes
        extra += max(readers - 1, 0) * held
    return extra


@pytest.mark.parametrize("kind", ["1f1b", "zero_bubble"])
def test_predicted_peak_memory_bounds_the_measured(kind: str, gpt2_two_cpu_ranks: Any) -> None:
    """One process, two CPU stages of GPT-2, m = 4, at every cut of the sweep: the cost
    model's peaks for that cut (summed over its ranks, less the tied replicas the one
    device shares) against the measured peak of a step with AdamW state: at most 15 %
    above (issue 11), and not below but for 2 %. The plans are built at fixed cuts, so the
    verdict does not depend on the timings the profile measured. One process runs both
    stages, so the measured peak is the two stages' live memory at one moment, against the
    sum of their own peaks."""
    model, args, target, loss_fn, profile, cuts = gpt2_two_cpu_ranks
    options = profile.options(schedule_kind=kind, num_microbatches=4)
    rows = []
    for cut in cuts:
        plan = plan_at(profile.costs, profile.cluster(), options, (cut,), kind=kind,
                       num_microbatches=4)
        pipe = autopart.compile(model, args, loss_fn=loss_fn, plan=plan)
        opt = torch.optim.AdamW(pipe.parameters())
        pipe.train_step(*args, target=target)
        opt.step()
        opt.zero_grad()
        pipe.train_step(*args, target=target, measure_memory=True, optimizer=opt)
        predicted = (sum(r.peak_memory_bytes for r in plan.ranks)
                     - _shared_replica_bytes(profile.costs, (cut,),
                                             options.optimizer_state_bytes_per_param_byte))
        measured = pipe.last_peak_memory_bytes.by_device["cpu"]
        rows.append((cut, predicted, measured, round(predicted / measured, 3)))
        for param in model.parameters():  # the next cut's pipeline starts from none
            param.grad = None
    assert all(0.98 * m <= p <= 1.15 * m for _, p, m, _ in rows), (
        "(cut, predicted, measured, ratio): " + repr(rows))


def test_comm_lanes_round_trip_and_overlapping_collectives_get_threads_of_their_own() -> None:
    # rank 0: a forward holding an all-gather it waited for whole, then two buckets in
    # flight at once (the second waited for from 60 to 70); rank 1: nothing on its comm lane
    events = (TraceEvent(0, "0F0", 0, 30), TraceEvent(0, "all_gather h.0", 5, 15, "comm"),
              TraceEvent(0, "exposed all_gather h.0", 5, 15),
              TraceEvent(0, "all_reduce bucket 0 stage 0", 40, 70, "comm"),
              TraceEvent(0, "all_reduce bucket 1 stage 0", 50, 80, "comm"),
              TraceEvent(0, "reduce", 60, 90), TraceEvent(0, "exposed all_reduce bucket 1 "
                                                             "stage 0", 60, 70),
              TraceEvent(1, "1F0", 30, 50), TraceEvent(1, "reduce", 60, 62))
    trace = Trace(events, "measured:cpu")
    assert trace.comm_us(0) == 10 + 40  # 5..15, 40..80
    assert trace.exposed_comm_us(0) == 20  # the "reduce" around them is not counted
    assert trace.comm_by_rank() == {0: (50.0, 20.0), 1: (0.0, 0.0)}
    assert trace.busy_us(0) == 30 and trace.actions(0) == ["0F0"]
    assert {e.lane for e in trace.lane("compute").events} == {"compute"}
    chrome = trace.to_chrome()
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in chrome["traceEvents"]
             if e["name"] == "thread_name"}
    assert names == {(0, 0): "compute", (1, 0): "compute", (0, 1): "comm", (0, 2): "comm 2"}
    tid = {e["name"]: e["tid"] for e in chrome["traceEvents"] if e["ph"] == "X" and e["pid"] == 0}
    # the second bucket overlaps the first without nesting in it: a second comm thread
    assert (tid["all_gather h.0"], tid["all_reduce bucket 0 stage 0"],
            tid["all_reduce bucket 1 stage 0"], tid["exposed all_gather h.0"]) == (1, 1, 2, 0)
    back = Trace.from_chrome(json.loads(json.dumps(chrome)))
    assert sorted(back.events, key=repr) == sorted(events, key=repr)
    # a trace written before the comm lane (one thread per rank, no names) reads as compute
    old = {"traceEvents": [{"ph": "X", "name": "0F0", "pid": 0, "tid": 0, "ts": 0, "dur": 5}]}
    assert Trace.from_chrome(old).events == (TraceEvent(0, "0F0", 0, 5),)
    with pytest.raises(PlanError, match="lanes are"):
        TraceEvent(0, "all_gather h.0", 0, 1, "network")


def test_the_recorder_times_a_collective_from_issue_to_completion_and_its_wait() -> None:
    # a work whose future completes at once: the collective ends when it completed, and the
    # wait that began after that is charged nothing beyond the completion
    from autopart.runtime.tracing import ActionRecorder, CollectiveTimer

    class Work:
        def __init__(self) -> None:
            self.future: torch.futures.Future[None] = torch.futures.Future()

        def get_future(self) -> torch.futures.Future[None]:
            return self.future

        def wait(self) -> bool:
            return True

    timer = CollectiveTimer()
    work = Work()
    assert timer.issued("all_reduce bucket 0 stage 0", work) is None  # off: nothing kept
    timer.wait(None, work)
    recorder = ActionRecorder(lambda s: 0)
    recorder.start()
    timer.attach(recorder, 3, torch.device("cpu"))
    slot = timer.issued("all_reduce bucket 0 stage 0", work)
    work.future.set_result(None)
    timer.wait(slot, work)
    assert timer.blocking("reduce grads", lambda: 7) == 7
    timer.attach(None, 3, torch.device("cpu"))
    got = {(e.name, e.lane): e for e in recorder.events()}
    assert set(got) == {("all_reduce bucket 0 stage 0", "comm"),
                        ("exposed all_reduce bucket 0 stage 0", "compute"),
                        ("reduce grads", "comm"), ("exposed reduce grads", "compute")}
    assert {e.rank for e in got.values()} == {3}
    bucket = got[("all_reduce bucket 0 stage 0", "comm")]
    waited = got[("exposed all_reduce bucket 0 stage 0", "compute")]
    assert waited.duration_us == 0 and waited.end_us == bucket.end_us
    trace = Trace(tuple(recorder.events()), "measured:cpu")
    assert trace.exposed_comm_us(3) <= trace.comm_us(3)
    # on a CUDA device the timer stays off (its collectives are not timed)
    timer.attach(recorder, 3, torch.device("cuda", 0))
    assert timer.recorder is None
