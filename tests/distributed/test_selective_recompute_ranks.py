"""A plan's ``"selective"`` and ``"op"`` recompute policies on real ranks (gloo, spawned
processes): every stage recomputes selectively and the step matches the plain model."""

import tempfile
from pathlib import Path

from tests.distributed.test_multiprocess import _spawn


def _assert_two_ranks_match(model: str, kind: str, policy: str) -> None:
    """``tests.distributed.worker.numerics`` on 2 ranks, every stage recomputing under
    ``policy``: each rank reports its parameter count and no problem."""
    with tempfile.TemporaryDirectory() as out:
        proc = _spawn("numerics", 2, model, kind, 1, out, True, policy)
        assert proc.returncode == 0, proc.stderr[-3000:]
        reports = {p.name: p.read_text().splitlines() for p in Path(out).iterdir()}
    assert sorted(reports) == ["rank0.txt", "rank1.txt"]
    for name, lines in reports.items():
        assert lines[0].startswith("params ") and int(lines[0].split()[1]) > 0, lines
        assert lines[1:] == [], f"{name}: {lines[1:]}"


def test_selective_recompute_on_two_ranks_matches_the_plain_model() -> None:
    """GPT-2 on 2 ranks (pp 2, 1F1B), every stage recomputing under ``"selective"``: the
    loss, the output and every gradient match the unpartitioned model, each stage runs its
    forward twice per microbatch and each rank's stages run the plan's policy
    (``tests.distributed.worker.numerics``)."""
    _assert_two_ranks_match("gpt2", "1f1b", "selective")


def test_op_recompute_on_two_ranks_matches_the_plain_model() -> None:
    """Llama (grouped-query attention) on 2 ranks under ZB-H1, every stage recomputing under
    ``"op"`` and keeping every second keepable node (its recomputing stages run a whole
    ``B``): the loss, the output and every gradient match the unpartitioned model, and the
    distributed stages' sources (with their kept nodes marked) are the one-process
    pipeline's."""
    _assert_two_ranks_match("llama", "zero_bubble", "op")
