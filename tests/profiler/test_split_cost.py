"""The zero-bubble split-cost measurement: a factor >= 1 that leaves the model untouched."""

import torch
from torch import nn

from autopart.core.capture import capture
from autopart.profiler import profile_graph
from autopart.profiler.split_cost import measure_split_backward_factor
from autopart.solver import find_candidates


def test_measured_split_factor_leaves_the_model_as_it_was() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.GELU())
                            for _ in range(6)]).train()
    x = torch.randn(8, 16)
    captured = capture(model, (x,))
    flat = captured.flatten_inputs((x,), {})
    costs = profile_graph(captured, flat, device="cpu")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.random.get_rng_state()
    factor = measure_split_backward_factor(captured, flat, costs, "cpu",
                                           find_candidates(costs, 3).positions, repeats=2)
    assert factor >= 1.0
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0, msg=k)
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.random.get_rng_state(), rng)
