"""What the selective recompute policy's checkpointing costs per node, measured."""

from __future__ import annotations

import pytest
import torch

from autopart.core.capture import capture
from autopart.profiler import profile_graph
from autopart.profiler.selective_cost import measure_selective_overhead
from autopart.solver import find_candidates
from tests.profiler._models import small_gpt2

pytest.importorskip("transformers")


def test_measured_on_a_piece_and_the_model_left_as_it_was() -> None:
    model, x = small_gpt2()
    captured = capture(model, (x,))
    costs = profile_graph(captured, [x], warmup=0, repeats=1)
    before = {k: v.clone() for k, v in captured.graph_module.state_dict().items()}
    # the solver's cut candidates, as compile passes them (which piece is timed follows the
    # measured times; any position would let it cut between an op and its tuple's readers)
    positions = list(find_candidates(costs, 3).positions)
    fwd, bwd = measure_selective_overhead(captured, [x], costs, "cpu", positions,
                                          min_pairs=2, max_pairs=3, budget_s=0.0)
    assert fwd >= 0.0 and bwd >= 0.0
    after = captured.graph_module.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in captured.graph_module.parameters())
    assert measure_selective_overhead(captured, [x], costs, "cpu", [5]) == (0.0, 0.0)
    with pytest.raises(ValueError, match="min_pairs"):
        measure_selective_overhead(captured, [x], costs, "cpu", positions, min_pairs=0)


def test_profile_model_measures_it_only_when_asked() -> None:
    from autopart.planning import profile_model

    model, x = small_gpt2()
    plain = profile_model(model, (x,), devices=["cpu"], num_microbatches=2, cache=False,
                          low_batch=False, split_cost=False)
    assert plain.runtime.selective_us_per_node == (0.0, 0.0)
    # a CPU profile says what torch.utils.checkpoint keeps beside the activations: the
    # generator's state (preserve_rng_state)
    assert plain.runtime.checkpoint_held_bytes == torch.get_rng_state().numel() > 0
    assert "selective_cost_s" not in plain.timings_s
    asked = profile_model(model, (x,), devices=["cpu"], num_microbatches=2, cache=False,
                          low_batch=False, split_cost=False, selective_cost=True)
    assert "selective_cost_s" in asked.timings_s
    assert min(asked.runtime.selective_us_per_node) >= 0.0
