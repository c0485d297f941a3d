"""The zero-bubble split-cost measurement: µs per node, timed as each runtime splits, leaving the
model untouched."""

import pytest
import torch
from torch import nn

from autopart.core.capture import capture
from autopart.profiler import profile_graph
from autopart.profiler.split_cost import measure_split_backward_overhead, overhead_of, piece_cuts
from autopart.runtime.split_engines import LocalSplit, TorchPipeliningSplit
from autopart.solver import find_candidates

ENGINES = {"local": LocalSplit(), "distributed": TorchPipeliningSplit()}


@pytest.mark.parametrize("runtime", ["local", "distributed"])
def test_measured_split_cost_leaves_a_batchnorm_model_as_it_was(runtime: str) -> None:
    # "distributed" times torch.distributed.pipelining's stage_backward_input / _weight
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.GELU())
                            for _ in range(6)]).train()
    x = torch.randn(8, 16)
    captured = capture(model, (x,))
    flat = captured.flatten_inputs((x,), {})
    costs = profile_graph(captured, flat, device="cpu")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.random.get_rng_state()
    us = measure_split_backward_overhead(captured, flat, costs, "cpu",
                                         find_candidates(costs, 3).positions, ENGINES[runtime],
                                         min_pairs=1, max_pairs=2)
    assert us >= 0.0
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0, msg=k)
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.random.get_rng_state(), rng)


def _profiled(depth: int) -> tuple[object, list[torch.Tensor], object]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(depth)])
    x = torch.randn(8, 16)
    captured = capture(model, (x,))
    flat = captured.flatten_inputs((x,), {})
    return captured, flat, profile_graph(captured, flat, device="cpu")


def test_piece_is_a_share_of_the_profiled_time_a_quarter_in() -> None:
    _, _, costs = _profiled(8)
    prefix = [0.0]
    for nd in costs.nodes:  # type: ignore[attr-defined]
        prefix.append(prefix[-1] + nd.fwd_us + nd.bwd_us)
    positions = list(range(1, len(prefix) - 1))
    cuts = piece_cuts(costs, positions, start=0.25, share=0.2)  # type: ignore[arg-type]
    assert cuts is not None
    first, second = cuts
    assert first == min(positions, key=lambda q: abs(prefix[q] - 0.25 * prefix[-1]))
    assert prefix[second] - prefix[first] >= 0.2 * prefix[-1]  # holds the share ...
    assert prefix[second - 1] - prefix[first] < 0.2 * prefix[-1]  # ... and no more
    # a share larger than what follows ends the piece at the last position
    assert piece_cuts(costs, positions, start=0.9, share=0.5)[1] == positions[-1]  # type: ignore
    assert piece_cuts(costs, positions[:1]) is None  # type: ignore[arg-type]


def test_pair_counts_are_checked() -> None:
    captured, flat, costs = _profiled(2)
    with pytest.raises(ValueError, match="min_pairs <= max_pairs"):
        measure_split_backward_overhead(captured, flat, costs, "cpu", [1, 3],  # type: ignore
                                        LocalSplit(), min_pairs=3, max_pairs=2)
    with pytest.raises(ValueError, match="1 <= min_pairs"):
        measure_split_backward_overhead(captured, flat, costs, "cpu", [1, 3],  # type: ignore
                                        LocalSplit(), min_pairs=0)


@pytest.mark.parametrize(("pairs", "nodes", "per_node"), [
    ([], 10, 0.0),  # nothing timed
    ([(1000.0, 1200.0)], 0, 0.0),  # no node with a backward
    ([(1000.0, 990.0), (1000.0, 1010.0)], 10, 0.0),  # no slower than B
    # median ratio 1.2, noise 0.3 / 2 / sqrt(3) = 0.087: slower; median excess 200 µs / 10
    ([(1000.0, 1050.0), (1000.0, 1200.0), (1000.0, 1350.0)], 10, 20.0),
    # median 1.1, MAD 0.1: noise 1.253 * 1.4826 * 0.1 / sqrt(3) = 0.107: within it
    ([(1000.0, 1000.0), (1000.0, 1100.0), (1000.0, 1900.0)], 10, 0.0),
    # 15-20 % slower in seven pairs, one caught by a burst (ratio 0.4) and one at 2.5: the
    # median's noise is the MAD's (0.025 -> 0.029), not the range's (2.1 / 2 / 3 = 0.35)
    ([(1000.0, r * 1000.0) for r in (1.15, 1.16, 1.17, 1.18, 1.18, 1.19, 1.2, 0.4, 2.5)],
     10, 18.0),
    ([(2000.0, 2130.0), (2000.0, 2130.0), (2000.0, 2130.0)], 100, 1.5),  # 1.3 µs -> 1.5 grid
])
def test_overhead_of_charges_a_per_node_cost_above_the_noise(
        pairs: list[tuple[float, float]], nodes: int, per_node: float) -> None:
    assert overhead_of(pairs, nodes) == per_node


@pytest.mark.parametrize("runtime", ["local", "distributed"])
def test_measured_split_overhead_is_per_node_and_leaves_the_model_as_it_was(
        runtime: str) -> None:
    captured, flat, costs = _profiled(8)
    before = [p.detach().clone() for p in captured.graph_module.parameters()]  # type: ignore
    us = measure_split_backward_overhead(captured, flat, costs, "cpu",  # type: ignore[arg-type]
                                         find_candidates(costs, 3).positions,  # type: ignore
                                         ENGINES[runtime], min_pairs=2, max_pairs=3)
    assert us >= 0.0 and us == round(us * 2) / 2  # on the 0.5 µs grid
    after = list(captured.graph_module.parameters())  # type: ignore[attr-defined]
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
