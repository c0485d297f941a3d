"""The plan's per-rank peak memory against a real 2-rank step (gloo, spawned processes).

The contract (issue 11): a predicted peak is never below the measured one (an
under-prediction is an out-of-memory error in production) and at most 15 % above it.
"""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("transformers")

#: GPT-2-like, 4 layers of n_embd 128, vocabulary 2048, a batch of 16 x 32 tokens, built by
#: autopart.apps.bench.load_workload (random weights, dropout off, the next-token loss)
WORKLOAD = "hf:GPT2LMHeadModel"
CONFIG = {"n_layer": 4, "n_embd": 128, "n_head": 4, "vocab_size": 2048, "n_positions": 32,
          "batch": 16, "seq": 32}


@pytest.mark.parametrize(("kind", "v"), [("interleaved_1f1b", 2), ("zero_bubble", 1)])
def test_predicted_peaks_bound_a_real_steps_from_above_within_15_percent(kind: str,
                                                                         v: int) -> None:
    """Cuts right after an attention kernel, whose output is strided (sent as a dense copy,
    copied back into its layout by the next stage) and saved by the kernel itself, and
    after a residual add, whose output no node of its stage saves: before the cost model
    counted those, the fidelity GPT-2's last rank came out 0.33 % under its measured peak."""
    from autopart.apps.bench import load_workload, run_arms
    from autopart.planning import profile_model
    from autopart.solver.predict import plan_at

    model, args, target, loss_fn = load_workload(WORKLOAD, dict(CONFIG))
    profile = profile_model(model, args, devices=["cpu", "cpu"], num_microbatches=4,
                            split_cost=False, loss_fn=loss_fn, example_target=target,
                            low_batch=False)
    nodes = profile.costs.nodes
    attention = [i for i, nd in enumerate(nodes) if "scaled_dot_product" in nd.op]
    adds = [i for i, nd in enumerate(nodes) if nd.op == "aten.add.Tensor"]
    assert nodes[attention[0]].strided_output_bytes > 0
    cuts = sorted({attention[0] + 1, adds[len(adds) // 2] + 1, attention[-1] + 1}
                  if v == 2 else {attention[1] + 1})
    # the distributed runtime runs it: torch's stages hold one receive buffer per microbatch,
    # and each rank is a process whose optimizer steps its own copy of a tied parameter
    held = dataclasses.replace(profile.runtime, receive_buffers_per_microbatch=True,
                               ranks_are_processes=True, ranks_per_core=1.0)
    opts = profile.options(schedule_kind=kind, stages_per_rank=v, num_microbatches=4,
                           runtime=held)
    plan = plan_at(profile.costs, profile.cluster(), opts, cuts, kind=kind,
                   num_microbatches=4, stages_per_rank=v)
    got = run_arms(WORKLOAD, {"plan": plan}, ranks=2, warmup=1, single=False, trace=False,
                   untimed=["plan"], config=dict(CONFIG))["plan"]
    predicted = [r.peak_memory_bytes for r in plan.ranks]
    for rank, (pred, meas) in enumerate(zip(predicted, got.peak_bytes, strict=True)):
        assert meas <= pred <= 1.15 * meas, (rank, pred, meas, cuts)
