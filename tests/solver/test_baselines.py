"""Baseline partitioners: layer detection, the published algorithms on hand-worked tables, exact cuts."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from autopart.core.costgraph import CostGraph
from autopart.core.errors import PlanError
from autopart.solver.baselines import (
    BASELINE_NAMES,
    BaselineNotApplicable,
    baseline_partitions,
    deepspeed_parameters,
    pippy_equal_size,
    run_baselines,
    torchgpipe_balance_by_time,
    uniform_layers,
)
from autopart.solver.candidates import crossing_profile
from autopart.solver.model_layers import model_layers
from autopart.solver.partition_algorithms import block_partition, partition_balanced


def toy(build: Any, *, tuple_at: int | None = None) -> CostGraph:
    """emb | h.0 | h.1 | h.2 | h.3 | head: 10 nodes, each block two nodes reading one parameter.

    Node index:   0    1 2   3 4   5 6   7 8   9
    Layer:        emb  h.0   h.1   h.2   h.3   head
    fwd+bwd µs:   30   60    60    60    60    30     (per layer)
    params:       40   10    10    10    10    20     (elements, per layer)
    ``tuple_at``: that node returns a tuple (the position after it is not a valid cut).
    """
    spec = [("emb", "emb.w"), ("h.0.a", "h.0.w"), ("h.0", "h.0.w"), ("h.1.a", "h.1.w"),
            ("h.1", "h.1.w"), ("h.2.a", "h.2.w"), ("h.2", "h.2.w"), ("h.3.a", "h.3.w"),
            ("h.3", "h.3.w"), ("head", "head.w")]
    numel = {"emb.w": 40, "head.w": 20, **{f"h.{i}.w": 10 for i in range(4)}}
    nodes, prev = [], "x"
    for i, (module, param) in enumerate(spec):
        nodes.append(build.node(f"n{i}", (prev,), fwd=10.0, bwd=20.0, params=(param,),
                                module=module, tensor=i != tuple_at))
        prev = f"n{i}"
    return build.graph(nodes, params={k: (4 * v, v) for k, v in numel.items()})


# ---- layers ---------------------------------------------------------------------------------
def test_layers_of_toy(build: Any) -> None:
    got = [(ly.name, ly.start, ly.stop, ly.is_block) for ly in model_layers(toy(build))]
    assert got == [("emb", 0, 1, False), ("h.0", 1, 3, True), ("h.1", 3, 5, True),
                   ("h.2", 5, 7, True), ("h.3", 7, 9, True), ("head", 9, 10, False)]


def test_layers_descend_into_nested_blocks_and_ignore_small_sequentials(build: Any) -> None:
    # HF ResNet shape: stages.i.layers.j are the blocks; classifier.0/1 (Flatten, Linear) are not.
    paths = ["embedder.conv", "embedder.pool",
             "stages.0.layers.0.layer.0.conv", "stages.0.layers.0.layer.1.conv", "stages.0.layers.0",
             "stages.0.layers.1.layer.0.conv", "stages.0.layers.1.layer.1.conv", "stages.0.layers.1",
             "stages.1.layers.0.layer.0.conv", "stages.1.layers.0.shortcut", "stages.1.layers.0",
             "pooler", "classifier.0", "classifier.1"]
    nodes, prev = [], "x"
    for i, p in enumerate(paths):
        nodes.append(build.node(f"n{i}", (prev,), module=p))
        prev = f"n{i}"
    got = [(ly.name, ly.start, ly.stop, ly.is_block) for ly in model_layers(build.graph(nodes))]
    assert got == [("embedder.conv", 0, 2, False), ("stages.0.layers.0", 2, 5, True),
                   ("stages.0.layers.1", 5, 8, True), ("stages.1.layers.0", 8, 11, True),
                   ("pooler", 11, 14, False)]


def test_layers_fall_back_to_top_level_modules(build: Any) -> None:
    paths = ["fc1", "fc1", "act", "fc2.inner", "fc2", ""]
    nodes, prev = [], "x"
    for i, p in enumerate(paths):
        nodes.append(build.node(f"n{i}", (prev,), module=p))
        prev = f"n{i}"
    got = [(ly.name, ly.start, ly.stop, ly.is_block) for ly in model_layers(build.graph(nodes))]
    assert got == [("fc1", 0, 2, False), ("act", 2, 3, False), ("fc2.inner", 3, 5, False),
                   ("(top level)", 5, 6, False)]
    # torchtitan's rule then counts those four layers: 2 stages of 2 -> cut before fc2.
    assert uniform_layers(build.graph(nodes), 2) == (3,)


# ---- the published algorithms -----------------------------------------------------------------
@pytest.mark.parametrize("weights,parts,expected", [
    ([40, 10, 10, 10, 10, 20], 2, [0, 2, 6]),     # 50 | 50
    ([40, 10, 10, 10, 10, 20], 3, [0, 1, 4, 6]),  # 40 | 30 | 30 (spread 10)
    ([1, 2], 3, [0, 1, 2, 2]),                    # n <= parts: DeepSpeed's partition_uniform
    ([5, 5, 5, 5], 1, [0, 4]),
])
def test_partition_balanced_table(weights: list[int], parts: int, expected: list[int]) -> None:
    assert partition_balanced(weights, parts) == expected


@pytest.mark.parametrize("sequence,parts,expected", [
    ([0, 0, 0, 0, 10, 10, 10, 10], 2, [6, 8]),   # q < p: first items of block 1 move into block 0
    ([10, 10, 10, 10, 0, 0, 0, 0], 2, [2, 8]),   # p < q: last items of block 0 move into block 1
    ([3, 3, 3], 3, [1, 2, 3]),
    ([7], 1, [1]),
])
def test_block_partition_table(sequence: list[int], parts: int, expected: list[int]) -> None:
    assert block_partition(sequence, parts) == expected


def test_block_partition_errors() -> None:
    with pytest.raises(PlanError, match=r"partitions=0 must be >= 1; ask for at least one"):
        block_partition([1, 2], 0)
    with pytest.raises(PlanError, match=r"partitions=3 but the sequence has only 2 items .* "
                                        r"use at most 2 partitions"):
        block_partition([1, 2], 3)


# ---- exact cuts on the toy graph ------------------------------------------------------------
@pytest.mark.parametrize("stages,expected", [(2, (5,)), (3, (3, 7)), (4, (3, 5, 7))])
def test_uniform_layers_exact(build: Any, stages: int, expected: tuple[int, ...]) -> None:
    # 4 blocks: S=2 -> 2+2; S=3 -> 1, 2, 1 (torchtitan gives the extra block to a middle stage).
    assert uniform_layers(toy(build), stages) == expected


@pytest.mark.parametrize("stages,expected", [(2, (3,)), (3, (1, 7)), (4, (1, 5, 9))])
def test_deepspeed_parameters_exact(build: Any, stages: int, expected: tuple[int, ...]) -> None:
    # Layer weights 40, 10, 10, 10, 10, 20: S=2 -> 50|50; S=3 -> 40|30|30 (spread 10);
    # S=4 -> 40|20|20|20 (spread 20, better than 40|10|20|30).
    assert deepspeed_parameters(toy(build), stages) == expected


@pytest.mark.parametrize("stages,expected", [(2, (3,)), (3, (1, 7)), (4, (1, 5, 9))])
def test_pippy_equal_size_exact(build: Any, stages: int, expected: tuple[int, ...]) -> None:
    # Total 100 elements. S=2: threshold 50, emb + h.0 fill it, the split comes before h.1.
    # S=3: threshold 33; emb (40) alone is over it, so a stage ends after it; h.0..h.2 = 30,
    # h.3 would make 40 -> split before node 7. S=4: threshold 25 -> after emb, before 5 and 9.
    assert pippy_equal_size(toy(build), stages) == expected


def test_pippy_carries_shared_parameters_into_the_new_stage(build: Any) -> None:
    # A, B, C have 30 elements each; S=3 -> threshold 30. n1 reads A and B: 30 + 30 > 30, so a
    # stage starts at n1 holding A and B (60). n2 reads only B, already counted: 60 + 0 > 30
    # still splits (PiPPy's accumulate = repeated + new); n3 then splits again for C.
    reads = [("A",), ("A", "B"), ("B",), ("C",)]
    nodes, prev = [], "x"
    for i, ps in enumerate(reads):
        nodes.append(build.node(f"n{i}", (prev,), params=ps, module=f"m{i}"))
        prev = f"n{i}"
    graph = build.graph(nodes, params={p: (120, 30) for p in "ABC"})
    assert pippy_equal_size(graph, 3) == (1, 2)
    assert pippy_equal_size(graph, 4) == (1, 2, 3)


@pytest.mark.parametrize("stages,expected", [(2, (5,)), (3, (3, 7))])
def test_torchgpipe_balance_by_time_exact(build: Any, stages: int, expected: tuple[int, ...]) -> None:
    # Layer times 30, 60, 60, 60, 60, 30 normalise to 0, 1, 1, 1, 1, 0; the initial blocks of
    # n // k layers already satisfy max <= min + 1, so torchgpipe stops there.
    assert torchgpipe_balance_by_time(toy(build), stages) == expected


def test_invalid_positions_move_forward_or_merge(build: Any) -> None:
    graph = toy(build, tuple_at=4)  # node 4 returns a tuple: position 5 (start of h.2) is invalid
    assert not crossing_profile(graph)[1][5]
    assert uniform_layers(graph, 2) == (6,)  # torchtitan's cut before h.2 moves forward
    # For the layer-level algorithms h.2 joins h.1: weights 40, 10, 20, 10, 20.
    assert deepspeed_parameters(graph, 2) == (3,)
    assert deepspeed_parameters(graph, 3) == (1, 7)


# ---- skipping and the entry point -------------------------------------------------------------
def test_too_many_stages_are_skipped_with_a_reason(build: Any) -> None:
    graph = toy(build)
    with pytest.raises(BaselineNotApplicable, match=r"uniform_layers: 5 stages need at least 5 layers, "
                                                     r"but the graph has 4"):
        uniform_layers(graph, 5)
    with pytest.raises(BaselineNotApplicable, match=r"7 stages need at least 7 layers that can start"):
        deepspeed_parameters(graph, 7)
    with pytest.raises(BaselineNotApplicable, match=r"greedy walk made \d+ stages, not 9"):
        pippy_equal_size(graph, 9)
    results = {b.name: b for b in run_baselines(graph, 5)}
    assert list(results) == list(BASELINE_NAMES)
    assert results["uniform_layers"].cuts is None and "at least 5 layers" in results["uniform_layers"].reason
    assert [name for name, _ in baseline_partitions(graph, 5)] == [
        n for n in BASELINE_NAMES if results[n].cuts is not None]
    assert "deepspeed_parameters" in dict(baseline_partitions(graph, 5))


def test_baseline_partitions_shape(build: Any) -> None:
    graph = toy(build)
    assert baseline_partitions(graph, 3) == [("uniform_layers", (3, 7)), ("deepspeed_parameters", (1, 7)),
                                             ("pippy_equal_size", (1, 7)),
                                             ("torchgpipe_balance_by_time", (3, 7))]
    assert baseline_partitions(graph, 1) == [(name, ()) for name in BASELINE_NAMES]
    with pytest.raises(PlanError, match=r"num_stages=0; it must be >= 1"):
        baseline_partitions(graph, 0)


@pytest.mark.parametrize("length,stages", [(20, 2), (20, 5), (33, 8)])
def test_cuts_are_valid_ascending_and_complete(build: Any, length: int, stages: int) -> None:
    graph = build.chain(length, param_bytes=64)
    _, valid = crossing_profile(graph)
    found = baseline_partitions(graph, stages)
    assert [name for name, _ in found] == list(BASELINE_NAMES)
    for _, cuts in found:
        assert len(cuts) == stages - 1
        assert all(a < b for a, b in itertools.pairwise(cuts))
        assert all(1 <= c < length and valid[c] for c in cuts)
