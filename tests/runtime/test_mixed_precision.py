"""bf16 autocast around train_step, and bf16 weights, in the one-process runtime (tolerances
justified in tests/precision.py)."""

import pytest

from tests import precision


@pytest.mark.parametrize("mode", ["autocast", "bf16"])
def test_bf16_matches_the_plain_model_run_the_same_way(mode: str) -> None:
    reference, pipe, args, target, loss_fn = precision.models(mode, 2, "local")
    report = precision.compare(pipe, reference, args, target, loss_fn, mode)
    assert report.startswith("ok "), report
