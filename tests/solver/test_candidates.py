"""Cut candidates: crossing bytes with a skip connection, invalid positions, filtering, fallback."""

from __future__ import annotations

from typing import Any

import pytest

from autopart.core.costgraph import CostGraph
from autopart.core.errors import InfeasiblePlanError, PlanError
from autopart.solver.candidates import crossing_profile, crossing_values, find_candidates


def skip_graph(build: Any, *, b_is_tensor: bool = True) -> CostGraph:
    """x -> a -> b -> c -> d(c, a) -> e: ``a`` skips over the cuts at 2 and 3.

    node:   a   b   c   d   e      (index 0..4)
    out:   10  20  30  40  50      bytes; graph input x = 100 bytes
    """
    n = build.node
    nodes = [n("a", ("x",), out=10, fwd=1, bwd=0, module="enc"),
             n("b", ("a",), out=20, fwd=2, bwd=0, tensor=b_is_tensor),
             n("c", ("b",), out=30, fwd=3, bwd=0, saved=7),
             n("d", ("c", "a"), out=40, fwd=4, bwd=0, param_bytes=64, params=("w",)),
             n("e", ("d",), out=50, fwd=5, bwd=0, module="head")]
    return build.graph(nodes, inputs={"x": 100}, params={"w": (64, 16)})


# position k -> (crossing set, bytes); hand-worked from the docstring above.
SKIP_TABLE = [
    (0, ("x",), 100),       # graph inputs that are read
    (1, ("a",), 10),
    (2, ("a", "b"), 30),    # a skips ahead
    (3, ("a", "c"), 40),
    (4, ("d",), 40),        # a's last use is d (index 3)
    (5, ("e",), 50),        # graph outputs
]


@pytest.mark.parametrize(("position", "names", "nbytes"), SKIP_TABLE)
def test_crossing_table(build: Any, position: int, names: tuple[str, ...], nbytes: int) -> None:
    g = skip_graph(build)
    crossing, valid = crossing_profile(g)
    assert crossing[position] == nbytes
    assert valid[position]
    assert crossing_values(g, position) == names


def test_crossing_values_rejects_out_of_range(build: Any) -> None:
    with pytest.raises(PlanError, match=r"position=6 is outside 0\.\.5 \(the graph has 5 nodes.*"
                                        r"pass a position in 0\.\.5"):
        crossing_values(skip_graph(build), 6)


def test_tuple_output_makes_position_invalid(build: Any) -> None:
    g = skip_graph(build, b_is_tensor=False)
    _, valid = crossing_profile(g)
    assert valid[1:5] == [True, False, True, True]
    cands = find_candidates(g, 2, window=0)
    assert 2 not in cands.positions
    assert cands.num_valid == 3


def test_filter_keeps_cheap_positions_and_segments(build: Any) -> None:
    g = skip_graph(build)
    # min over the window is 10 (position 1); 2x that is 20, so only position 1 qualifies.
    cands = find_candidates(g, 2)
    assert cands.positions == (1,)
    assert cands.crossing_bytes == (10,)
    assert not cands.fallback
    first, rest = cands.segments
    assert (first.start, first.stop, first.fwd_us, first.num_nodes) == (0, 1, 1.0, 1)
    assert (rest.start, rest.stop, rest.fwd_us, rest.saved_bytes, rest.param_bytes) == (
        1, 5, 14.0, 7, 64)
    # window 0: every position is its own local minimum.
    assert find_candidates(g, 2, window=0).positions == (1, 2, 3, 4)
    # factor 4: 40 <= 4 * 10 also qualifies.
    assert find_candidates(g, 2, crossing_factor=4.0).positions == (1, 2, 3, 4)


def test_fallback_to_all_valid_positions(build: Any) -> None:
    g = skip_graph(build)
    cands = find_candidates(g, 3)  # the filter leaves 1 candidate, 2 are needed
    assert cands.fallback
    assert cands.positions == (1, 2, 3, 4)


def test_too_many_stages_is_infeasible(build: Any) -> None:
    with pytest.raises(InfeasiblePlanError,
                       match=r"only 3 valid cut positions.*num_stages must be <= 4"):
        find_candidates(skip_graph(build, b_is_tensor=False), 5)


def test_identical_crossing_sets_keep_the_first(build: Any) -> None:
    # x -> a; z() has no inputs and an unused output; b(a). Positions 1 and 2 both carry {a}.
    n = build.node
    g = build.graph([n("a", ("x",)), n("z", ()), n("b", ("a",))])
    assert crossing_values(g, 1) == crossing_values(g, 2) == ("a",)
    assert find_candidates(g, 2, window=0).positions == (1,)


def test_thinning_spreads_evenly_in_compute(build: Any) -> None:
    # 20 nodes of 1 µs: targets at 5, 10, 15 µs of cumulative compute.
    g = build.chain(20, fwd=1.0, bwd=0.0)
    assert find_candidates(g, 2, window=0, max_candidates=3).positions == (5, 10, 15)
    # Uneven compute: the first 10 nodes cost 3 µs, the rest 1 µs (T = 40; targets 10, 20, 30).
    nodes = [build.node(f"n{i}", (f"n{i - 1}" if i else "x",), fwd=3.0 if i < 10 else 1.0,
                        bwd=0.0) for i in range(20)]
    g2 = build.graph(nodes)
    assert find_candidates(g2, 2, window=0, max_candidates=3).positions == (3, 7, 10)
    # never fewer than S - 1
    assert len(find_candidates(g, 6, window=0, max_candidates=3).positions) == 5


def test_bad_arguments_raise(build: Any) -> None:
    g = skip_graph(build)
    with pytest.raises(PlanError, match="num_stages=0"):
        find_candidates(g, 0)
    with pytest.raises(PlanError, match="crossing_factor=0.5 must be >= 1"):
        find_candidates(g, 2, crossing_factor=0.5)
