"""autopart.apps.bench.run_arms: real ranks, arms alternated; memory-only and traced arms."""

import pytest

import autopart
from autopart.apps.bench import SINGLE, load_workload, run_arms
from autopart.core.errors import UsageError

CONFIG = {"n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 256, "n_positions": 16,
          "batch": 4, "seq": 16}


@pytest.mark.slow
def test_an_untimed_arm_is_measured_for_memory_only_and_only_named_arms_are_traced() -> None:
    model, args, target, loss_fn = load_workload("hf:GPT2LMHeadModel", CONFIG)
    plan, profile = autopart.plan_model(model, args, devices=["cpu", "cpu"], loss_fn=loss_fn,
                                        num_microbatches=2, schedule_kind="1f1b")
    memory = profile.solve(optimize="memory", schedule_kind="1f1b", stages_per_rank=1)
    results = run_arms("hf:GPT2LMHeadModel", {"speed": plan, "memory": memory}, ranks=2,
                       steps=2, warmup=1, config=CONFIG, trace=["speed"], untimed=["memory"])
    assert len(results["speed"].steps_s) == 2 and len(results[SINGLE].steps_s) == 2
    assert results["memory"].steps_s == [] and len(results["memory"].losses) == 1
    assert [p > 0 for p in results["memory"].peak_bytes] == [True, True]
    assert results["speed"].trace is not None and results["memory"].trace is None
    # every arm trains the same model from the same weights: the first losses agree
    assert results["memory"].losses[0] == pytest.approx(results[SINGLE].losses[0], rel=1e-5)


def test_untimed_arms_must_be_plans() -> None:
    model, args, _, loss_fn = load_workload("hf:GPT2LMHeadModel", CONFIG)
    plan, _ = autopart.plan_model(model, args, devices=["cpu", "cpu"], loss_fn=loss_fn,
                                  num_microbatches=2, schedule_kind="1f1b")
    with pytest.raises(UsageError, match=r"untimed arms \['nope'\] are not among the plans"):
        run_arms("hf:GPT2LMHeadModel", {"speed": plan}, ranks=2, untimed=["nope"])
    with pytest.raises(UsageError, match=r"fused arms \['nope'\] are not among the plans"):
        run_arms("hf:GPT2LMHeadModel", {"speed": plan}, ranks=2, fuse=["nope"])
