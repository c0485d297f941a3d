"""ZeRO-1/2/3 (FSDP2) composed with the pipeline: pp2 x dp2 on 4 real gloo processes, against
the plain model (float32, rtol 1e-5, atol 4e-5), with plans fixed by hand."""

import tempfile
from pathlib import Path

from tests.distributed.spawned import free_port, launch


def _run(cases: list[tuple[object, ...]], timeout: float = 300) -> dict[str, list[str]]:
    """Every case on one pp2 x dp2 mesh of 4 spawned ranks; each rank's problems."""
    with tempfile.TemporaryDirectory() as out:
        proc = launch("tests.distributed.zero_worker", "numerics", 4, 4, free_port(), cases,
                      out, timeout_s=timeout)
        assert proc.returncode == 0, proc.stderr[-3000:]
        reports = {p.name: p.read_text().splitlines() for p in Path(out).iterdir()}
    assert sorted(reports) == [f"rank{r}.txt" for r in range(4)]
    return reports


def test_zero_1_2_3_gradients_clip_and_step_equal_the_plain_models() -> None:
    # per (ZeRO stage, model), on 1F1B (ZeRO-2 in the next test): inference output; loss;
    # every parameter a DTensor shard whose gathered gradient is the global batch's;
    # reduce-scatters once per step (ZeRO-1) or per microbatch (2, 3); parameters resharded
    # after forward for ZeRO-3 only; clip_grad_norm_ (the norm and the clipped gradients);
    # one AdamW step on pipe.parameters(); state_dict whole under the original FQNs;
    # load_state_dict back
    # one FSDP unit per layer (Plan.zero_layer_units), each unit's reduce-scatters counted:
    # ZeRO-3 on GPT-2 (tied wte on both pp ranks), Llama with every stage recomputing, BERT;
    # ZeRO-2 on GPT-2; ZeRO-1 on GPT-2 and on interleaved Llama (two stages per rank)
    cases = [(1, "gpt2", "1f1b", 1), (1, "llama", "1f1b", 1), (1, "bert", "1f1b", 1),
             (3, "gpt2", "1f1b", 1), (3, "llama", "1f1b", 1), (3, "bert", "1f1b", 1),
             (3, "gpt2", "1f1b", 1, True), (3, "llama", "1f1b", 1, True, True),
             (3, "bert", "1f1b", 1, True), (2, "gpt2", "1f1b", 1, True),
             (1, "gpt2", "1f1b", 1, True), (1, "llama", "interleaved_1f1b", 2, True)]
    for name, lines in _run(cases).items():
        assert lines[0] == "done", lines
        assert lines[1:] == [], f"{name}: {lines[1:]}"


def test_split_backwards_the_grad_scaler_and_what_is_refused() -> None:
    # ZB-V (I before W, two stages per rank handing over in memory) on Llama under
    # ZeRO-3 and ZB-H1 on GPT-2 under ZeRO-2: the same checks; torch's AMP recipe with a
    # GradScaler under ZeRO-3, and an inf on one rank skips the step on all; PlanErrors for
    # a tied parameter two stages of one rank share, no dp group and a dp size mismatch
    cases = [(3, "llama", "zbv", 2), (2, "gpt2", "zero_bubble", 1), ("scaled", 3, "gpt2"),
             ("refusals",)]
    for name, lines in _run(cases).items():
        assert lines[0] == "done", lines
        assert lines[1:] == [], f"{name}: {lines[1:]}"
