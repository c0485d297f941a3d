"""Tensor parallelism in real gloo processes (no mocks): tp = 2 alone and tp = 2 x pp = 2 on tiny
GPT-2 (tied wte / lm_head), Llama (grouped-query attention) and BERT, sharded as
``find_tensor_parallel`` finds in each profile (BERT: sibling-module pairs), against the plain
model."""

import pytest

from tests.distributed.spawned import rank_problems

pytest.importorskip("transformers")


@pytest.mark.parametrize(("world", "sequence_parallel", "recompute_policy"),
                         [(2, False, None), (4, False, None), (2, True, None),
                          (4, True, "selective")],
                         ids=["tp2", "tp2xpp2", "tp2-sp", "tp2xpp2-sp-selective"])
def test_loss_every_gradient_state_and_norm_match_the_plain_model(
        world: int, sequence_parallel: bool, recompute_policy: str | None) -> None:
    # one spawn runs the three models; each rank writes the checks it saw fail. The last
    # case recomputes every stage selectively: its backward gathers sequence parallelism's
    # token-split values again and keeps the reduce-scatters' outputs
    problems = rank_problems("tests.distributed.tp_worker", "tp_numerics", world,
                             sequence_parallel, recompute_policy)
    assert problems == {r: [] for r in range(world)}
