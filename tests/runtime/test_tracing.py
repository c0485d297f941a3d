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
