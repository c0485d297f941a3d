"""Expert parallelism in real gloo processes (no mocks): tiny Mixtral, Qwen3-MoE,
DeepSeek-V3 (shared expert, grouped routing) and GPT-OSS (experts stored transposed, with
biases) with their experts split over ep of the dp
replicas (ep = dp, ep < dp with expert-data-parallel replicas, ep x pp), against the plain
model on the global batch: the loss on every rank, every gradient, the whole state dict,
reloading it and the gradient norm; with ZeRO 1 and 3 (one FSDP unit per stage or per
layer) sharding the dense parameters while ep splits the experts; and under DualPipe-V,
each forward-backward pair run at once on two threads so that one's all-to-alls wait while
the other computes (each V chunk on an ep group of its own)."""

import pytest

from tests.distributed.spawned import rank_problems

pytest.importorskip("transformers")


@pytest.mark.parametrize(("world", "pp", "ep", "names", "zero", "units", "kind"), [
    (2, 1, 2, ["mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss"], 0, False, "1f1b"),
    (4, 2, 2, ["qwen3_moe", "gpt_oss"], 0, False, "1f1b"),
    (4, 1, 4, ["deepseek_v3"], 0, False, "1f1b"),
    (4, 1, 2, ["mixtral"], 1, True, "1f1b"),
    (4, 2, 2, ["deepseek_v3"], 3, True, "1f1b"),
    (4, 2, 2, ["mixtral", "deepseek_v3"], 0, False, "dualpipev"),
    (4, 2, 2, ["qwen3_moe"], 1, False, "dualpipev"),
], ids=["dp2-ep2", "pp2xdp2-ep2", "dp4-ep4", "dp4-ep2-zero1-layers", "pp2xdp2-ep2-zero3-layers",
        "dualpipev-pp2xdp2-ep2-overlapped", "dualpipev-pp2xdp2-ep2-zero1-overlapped"])
def test_loss_every_gradient_state_and_norm_match_the_plain_model(
        world: int, pp: int, ep: int, names: list[str], zero: int, units: bool,
        kind: str) -> None:
    problems = rank_problems("tests.distributed.ep_worker", "ep_numerics", world, pp, ep, names,
                             zero, units, kind)
    assert problems == {r: [] for r in range(world)}
