"""Scale: GPT-3-175B-shaped synthetic CostGraphs (repeated transformer layers) with the full
search (8 microbatch counts, v in {1, 2, 4}, all four kinds, recompute): reproducible plans with
a certified gap of at most 5 %. The reduced graph runs in a few seconds; the full 96-layer /
64-rank case is ``slow`` (two solves) and is also what ``benchmarks/solver_scale`` times on a
captured model."""

from __future__ import annotations

import json
import math
import sys
import time

import pytest

from autopart.core.cluster import Cluster, device_preset
from autopart.core.costgraph import CostGraph, NodeCost
from autopart.solver import SolveOptions, solve

H, SEQ, VOCAB = 12288, 2048, 50257
# name, fwd µs at batch 1, output bytes / act, saved bytes / act, weight (h x h) multiple
LAYER = [("ln1", 20, 1, 1, 0), ("qkv", 900, 3, 1, 3), ("q", 5, 1, 0, 0), ("k", 5, 1, 0, 0),
         ("v", 5, 1, 0, 0), ("attn", 700, 1, 4, 0), ("proj", 300, 1, 1, 1), ("add1", 10, 1, 0, 0),
         ("ln2", 20, 1, 1, 0), ("fc", 1200, 4, 1, 4), ("gelu", 40, 4, 4, 0), ("fc2", 1200, 1, 4, 4),
         ("add2", 10, 1, 0, 0)]


def gpt3_shaped(layers: int, views_per_layer: int = 18) -> CostGraph:
    """Embedding (tied with the head), ``layers`` transformer layers of GPT-3 175B's sizes
    (13 ops + ``views_per_layer`` cheap views each: 31 nodes a layer by default), final norm
    and LM head; bf16 bytes, batch 1."""
    act = 2 * SEQ * H
    nodes: list[NodeCost] = []
    params: dict[str, int] = {"wte": 2 * VOCAB * H}

    def add(name: str, inputs: list[str], fwd: float, out: int, saved: int,
            ps: tuple[str, ...] = (), pbytes: int = 0, module: str = "") -> None:
        nodes.append(NodeCost(name=name, op="aten.x", module_path=module, fwd_us=fwd,
                              bwd_input_us=fwd, bwd_weight_us=fwd, flops=0, bytes_accessed=0,
                              output_bytes=out, saved_bytes=saved, param_bytes=pbytes,
                              inputs=tuple(inputs), params=ps))

    add("emb", ["x"], 50.0, act, 0, ("wte",), params["wte"], "wte")
    prev = "emb"
    for layer in range(layers):
        mod = f"h.{layer}"
        res = prev
        for nm, fwd, out, saved, weight in LAYER:
            name = f"{mod}.{nm}"
            ins = {"q": [f"{mod}.qkv"], "k": [f"{mod}.qkv"], "v": [f"{mod}.qkv"],
                   "attn": [f"{mod}.q", f"{mod}.k", f"{mod}.v"], "add1": [prev, res],
                   "add2": [prev, f"{mod}.add1"]}.get(nm, [prev])
            ps: tuple[str, ...] = ()
            if weight:
                params[f"{name}.w"] = weight * H * H * 2
                ps = (f"{name}.w",)
            add(name, ins, float(fwd), out * act, saved * act, ps,
                params[ps[0]] if ps else 0, name)
            prev = name
        for j in range(views_per_layer):
            add(f"{mod}.view{j}", [prev], 1.0, act, 0, (), 0, mod)
            prev = f"{mod}.view{j}"
    add("lnf", [prev], 20.0, act, act)
    add("head", ["lnf"], 1500.0, 2 * SEQ * VOCAB, act, ("wte",), 0, "lm_head")
    return CostGraph(nodes=tuple(nodes), graph_inputs={"x": 8 * SEQ}, graph_outputs=("head",),
                     param_sizes=params, param_numel={k: v // 2 for k, v in params.items()},
                     trainable=frozenset(params), source="analytical:h100-sxm",
                     bwd_source="estimated", batch_size=1,
                     fingerprint=f"gpt3-175b-shaped-{layers}")


def _solve_twice(layers: int, ranks: int, counts: tuple[int, ...],
                 deterministic_time: float = 2.0) -> tuple[object, float]:
    costs = gpt3_shaped(layers)
    cluster = Cluster.uniform(device_preset("h100-sxm"), [f"cuda:{i}" for i in range(ranks)])
    options = SolveOptions(batch_size=1536, microbatch_candidates=counts,
                           deterministic_time=deterministic_time,
                           # the deterministic limit ends each CP-SAT solve, never the wall
                           # clock (a busy machine must not change the plan)
                           time_limit_s=600.0, library_versions={"autopart": "test"})
    texts, plan, slowest = [], None, 0.0
    for _ in range(2):
        t0 = time.perf_counter()
        plan = solve(costs, cluster, options)
        slowest = max(slowest, time.perf_counter() - t0)
        d = plan.to_dict()
        d["solver"]["wall_s"] = 0.0
        texts.append(json.dumps(d, sort_keys=True))
    assert texts[0] == texts[1]
    return plan, slowest


def _check(plan: object, layers: int, ranks: int) -> None:
    assert len(plan.cuts) == ranks * plan.stages_per_rank - 1  # type: ignore[attr-defined]
    sol = plan.solver  # type: ignore[attr-defined]
    assert sol.status in ("OPTIMAL", "FEASIBLE")
    assert math.isfinite(sol.gap) and 0.0 <= sol.gap <= 0.05  # issue 11: at most 5 %
    assert 0.0 < sol.bound <= sol.objective
    lb = plan.lower_bounds  # type: ignore[attr-defined]
    assert lb.step_time_ratio >= 1.0
    assert all(r.peak_memory_bytes <= 80 * 10**9 for r in plan.ranks)  # type: ignore[attr-defined]


@pytest.mark.parametrize("banded", [False, True])
def test_reduced_gpt3_shape_is_reproducible_with_a_small_certified_gap(
        banded: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # 12 layers (~380 nodes) onto 8 ranks, full search over 8 m, v, kinds and recompute, with
    # short CP-SAT solves; banded=True takes the big-problem path that the 175B shape takes.
    # The threshold search proved the chosen (kind, v, m) answer optimal on both paths (CP-SAT
    # alone proved the same objective optimal before it existed). 43,888,765.0 µs until ZB-H1
    # was charged the gradients it keeps from I to W: that plan no longer fitted, and 1F1B at
    # m=128 (44,224,221.0, OPTIMAL) was chosen. Since an answer over a rank's cap on the exact
    # costs is searched again with that rank's chain cap lowered (solver/_refinement.
    # _tightened), ZB-H1 at m=128 finds cuts that fit: predicted 43.912 s against 1F1B's
    # 43.953 s, at 60.7 GB against 72.5. Its chain objective is no longer proven optimal: the
    # bound is the first search's, 0.72 % below it.
    if banded:
        monkeypatch.setattr(sys.modules["autopart.solver._refinement"], "_BAND_ABOVE", 0)
    plan, _ = _solve_twice(12, 8, (8, 16, 24, 32, 48, 64, 96, 128), deterministic_time=0.2)
    _check(plan, 12, 8)
    sol = plan.solver  # type: ignore[attr-defined]
    assert (sol.name, sol.status) == ("dp+threshold-bound", "FEASIBLE")
    assert plan.schedule_kind == "zero_bubble"  # type: ignore[attr-defined]
    assert sol.objective == pytest.approx(44206998.6, abs=1.0)
    assert sol.gap == pytest.approx(0.0072, abs=1e-4)


@pytest.mark.slow
def test_gpt3_175b_shape_on_64_ranks_is_solved_reproducibly() -> None:
    # Issue 4's scale target: 96 layers (2,979 nodes) onto 64 H100s, the full search. Its
    # wall time (under a minute) is benchmarks/solver_scale's to show, not a test's verdict.
    plan, _ = _solve_twice(96, 64, (32, 64, 96, 128, 192, 256, 384, 512))
    _check(plan, 96, 64)
