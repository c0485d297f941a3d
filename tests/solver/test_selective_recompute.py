"""The selective recompute policy priced: what a recomputing stage keeps and runs again."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from autopart.core.costgraph import CostGraph
from autopart.core.errors import PlanError
from autopart.solver import SolveOptions, solve
from autopart.solver._cost_model import CostModel
from autopart.solver.predict import plan_at, predict

DATA = Path(__file__).parent / "data"


def _mlp(build: Any) -> CostGraph:
    """x -> fc (linear, kept) -> gelu -> proj (linear, kept) -> add(x): the proj output is
    read only by the add, fc's output is saved by gelu, gelu's by proj."""
    n = build.node
    nodes = [replace(n("fc", ("x",), fwd=40.0, out=400, saved=100, params=("fc.w",),
                       param_bytes=64), op="aten.linear.default", saved_from=((1, 100),)),
             replace(n("gelu", ("fc",), fwd=10.0, out=400, saved=400), op="aten.gelu.default",
                     saved_from=((1, 400),)),
             replace(n("proj", ("gelu",), fwd=40.0, out=100, saved=400, params=("proj.w",),
                       param_bytes=64), op="aten.linear.default", saved_from=((1, 400),)),
             replace(n("add", ("proj", "x"), fwd=5.0, out=100), op="aten.add.Tensor",
                     saved_from=())]
    return build.graph(nodes, inputs={"x": 100},
                       params={"fc.w": (64, 16), "proj.w": (64, 16)})


def test_hand_worked_kept_bytes_and_recomputed_forward(build: Any) -> None:
    g = _mlp(build)
    full = CostModel(g, build.cluster(1), batch_size=8, training=True, state_factor=2.0)
    sel = CostModel(g, build.cluster(1), batch_size=8, training=True, state_factor=2.0,
                    recompute_policy="selective")
    assert full.part_us("recompute", 0, 4, 1.0) == full.part_us("fwd", 0, 4, 1.0) == 95.0
    assert sel.part_us("recompute", 0, 4, 1.0) == 15.0  # gelu and add run again, not the linears
    assert full.selective_kept_bytes(0, 4) == 0
    # kept: fc's 400 and proj's 100 bytes
    assert sel.selective_kept_bytes(0, 4) == 500
    # a stage ending at proj: proj's output leaves the stage and no node of it saves it, so
    # the runtime holds it as an output already; only fc's is kept beyond that
    assert sel.selective_kept_bytes(0, 3) == 400
    # checkpointing's own cost per node (RuntimeDescription.selective_us_per_node)
    from autopart.core.runtime_model import RuntimeDescription

    costly = CostModel(g, build.cluster(1), batch_size=8, training=True, state_factor=2.0,
                       recompute_policy="selective",
                       runtime=RuntimeDescription(selective_us_per_node=(2.0, 3.0)))
    assert costly.part_us("recompute", 0, 4, 1.0) == 15.0 + 4 * 3.0
    assert costly.recompute_fwd_extra_us(0, 4) == 4 * 2.0
    assert sel.recompute_fwd_extra_us(0, 4) == full.recompute_fwd_extra_us(0, 4) == 0.0
    with pytest.raises(PlanError, match="selective_us_per_node"):
        RuntimeDescription(selective_us_per_node=(-1.0, 0.0))
    with pytest.raises(PlanError, match="recompute_policy='some'"):
        CostModel(g, build.cluster(1), batch_size=8, training=True, state_factor=2.0,
                  recompute_policy="some")
    with pytest.raises(PlanError, match="recompute_policy='some'"):
        SolveOptions(batch_size=8, recompute_policy="some")



def test_a_kept_op_keeps_what_it_saves_of_its_own(build: Any) -> None:
    """Selective checkpointing caches every tensor a kept op returns: an attention that
    saves 60 bytes of its own beside its input (the CPU flash kernel's logsumexp) keeps
    them with its output; the last node's share of the loss's saved set is no such part."""
    n = build.node
    nodes = [replace(n("qkv", ("x",), fwd=40.0, out=300, saved=100, params=("w",),
                       param_bytes=64), op="aten.linear.default", saved_from=((1, 100),)),
             replace(n("attn", ("qkv",), fwd=30.0, out=100, saved=360),
                     op="aten.scaled_dot_product_attention.default", saved_from=((1, 300),)),
             replace(n("head", ("attn",), fwd=40.0, out=200, saved=100 + 250,
                       params=("h",), param_bytes=64), op="aten.linear.default",
                     saved_from=((1, 100),))]
    g = replace(build.graph(nodes, inputs={"x": 100}, params={"w": (64, 16), "h": (64, 16)}),
                loss_saved_bytes=250)
    sel = CostModel(g, build.cluster(1), batch_size=8, training=True, state_factor=2.0,
                    recompute_policy="selective")
    costs = sel.keep_costs(0, 3)
    assert costs[1] == 100 + 60  # its output and its own statistics
    assert costs[0] == 300  # a matmul saves nothing of its own
    # the head's output is the graph's (held as an output anyway), and the loss's 250
    # folded into the last node's saved bytes are not the head's own
    assert costs[2] == 0
    # kept: every matmul and attention, each with what it saves of its own
    assert sel.selective_kept_bytes(0, 3) == 300 + 160

def test_selective_sits_between_keeping_everything_and_full_recompute() -> None:
    """GPT-2 measured on this CPU (the golden profile): with every stage recomputing, the
    selective policy is faster than full recompute and holds less from forward to backward
    than no recompute."""
    costs = CostGraph.load(DATA / "cpu_gpt2_profile.json")
    base: dict[str, Any] = dict(batch_size=costs.batch_size, num_microbatches=2,
                                schedule_kind="1f1b", time_limit_s=60)
    from tests.solver.conftest import Build

    cluster = Build.cluster(2)
    plans = {name: solve(costs, cluster, SolveOptions(**base, **kw)) for name, kw in (
        ("none", dict(recompute=False)), ("full", dict(recompute=True)),
        ("selective", dict(recompute=True, recompute_policy="selective")))}
    assert plans["selective"].recompute_policy == "selective"
    assert plans["full"].recompute_policy == "full"
    # the same cuts priced three ways
    cuts = tuple(c.position for c in plans["none"].cuts)
    fixed = {name: plan_at(costs, cluster, SolveOptions(**base, recompute_policy=pol), cuts,
                           kind="1f1b", num_microbatches=2, recompute=rc)
             for name, pol, rc in (("none", "full", False), ("full", "full", True),
                                   ("selective", "selective", True))}
    step = {k: p.predicted_step_time_us for k, p in fixed.items()}
    peak = {k: max(r.peak_memory_bytes for r in p.ranks) for k, p in fixed.items()}
    assert step["none"] < step["selective"] < step["full"]
    # what each microbatch holds from its forward to its backward, per stage: selective
    # keeps less than keeping everything, and more than full recompute
    held = {k: predict(p, costs, cluster, SolveOptions(**base)).stage_costs.saved_bytes
            for k, p in fixed.items()}
    for s in range(len(cuts) + 1):
        assert held["full"][s] < held["selective"][s] < held["none"][s]
    # the peaks: full recompute lowest. Selective against none is not ordered on this
    # 2-layer model at m = 2: a backward that recomputes is not credited with the saved
    # tensors it frees as it goes (solver/_stage_costing._backward_extra), one that keeps
    # everything is
    assert peak["full"] < peak["selective"]
    assert peak["full"] < peak["none"]
    # a replayed plan is priced with its own policy, whatever the options say
    again = predict(fixed["selective"], costs, cluster, SolveOptions(**base))
    assert again.step_time_us == pytest.approx(step["selective"], rel=0.02)


def test_auto_keeps_the_better_policy_under_a_cap(build: Any) -> None:
    """Under a cap that makes the full-policy plan recompute, "auto" solves with all three
    policies and keeps the faster fitting plan (the op-level choice may match or beat the
    selective one); without recompute it is the full-policy plan itself.
    The chain alternates matmuls (kept by the selective policy, 40 µs) and pointwise ops
    (10 µs), each saving its 2000-byte input."""
    g = build.chain(8, saved=2000, out=2000, param_bytes=40)
    g = replace(g, nodes=tuple(
        replace(nd, op="aten.linear.default" if i % 2 == 0 else "aten.gelu.default",
                fwd_us=40.0 if i % 2 == 0 else 10.0, saved_from=((1, 2000),) if i else ())
        for i, nd in enumerate(g.nodes)))
    cluster = build.cluster(2)
    base: dict[str, Any] = dict(batch_size=8, num_microbatches=8, schedule_kind="gpipe")
    free = solve(g, cluster, SolveOptions(**base, recompute_policy="auto"))
    assert not any(st.recompute for st in free.stages) and free.recompute_policy == "full"
    peaks = {}
    for pol in ("full", "selective"):
        every = solve(g, cluster, SolveOptions(**base, recompute=True, recompute_policy=pol))
        peaks[pol] = max(r.peak_memory_bytes for r in every.ranks)
    assert peaks["full"] < peaks["selective"] < max(r.peak_memory_bytes for r in free.ranks)
    for cap, want in ((peaks["selective"], "selective"), (peaks["full"], "full")):
        plans = {pol: solve(g, cluster, SolveOptions(**base, memory_cap_bytes=cap,
                                                     recompute_policy=pol))
                 for pol in ("full", "auto", want)}
        assert any(st.recompute for st in plans["full"].stages)
        auto = plans["auto"]
        assert auto.recompute_policy in (want, "op")
        assert auto.predicted_step_time_us <= plans[want].predicted_step_time_us
        assert all(r.peak_memory_bytes <= cap for r in auto.ranks)
        assert auto.predicted_step_time_us <= plans["full"].predicted_step_time_us
