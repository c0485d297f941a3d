"""The loss's own cost on the last stage, and autopart.trace (save, load)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import autopart
from autopart.core.capture import capture
from autopart.core.errors import UsageError
from autopart.core.trace import Trace, TraceEvent
from autopart.planning import profile_model
from autopart.profiler.loss_cost import estimate_loss_cost, measure_loss_cost, with_loss_cost


class Head(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 1000)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x)))  # (batch, 1000)


def _ce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out, y)


def test_cross_entropy_saves_about_its_logits_and_lands_on_the_last_node() -> None:
    x, y = torch.randn(64, 16), torch.randint(0, 1000, (64,))
    captured = capture(Head(), (x,))
    cost = measure_loss_cost(captured, _ce, y, "cpu")
    logits = 64 * 1000 * 4
    assert logits <= cost.saved_bytes <= 3 * logits  # log-softmax (and the logits) kept
    assert cost.fwd_us > 0 and cost.bwd_us > 0 and cost.source == "measured:cpu"
    guess = estimate_loss_cost(captured)
    assert (guess.saved_bytes, guess.transient_bytes, guess.source) == (logits, 2 * logits,
                                                                        "estimated")
    profile = profile_model(Head(), (x,), devices=["cpu"], loss_fn=_ce, example_target=y,
                            low_batch=False)
    plain = profile_model(Head(), (x,), devices=["cpu"], low_batch=False)
    last, before = profile.costs.nodes[-1], plain.costs.nodes[-1]
    assert last.saved_bytes >= before.saved_bytes + logits
    assert "loss_cost_s" in profile.timings_s and "loss_cost_s" not in plain.timings_s
    # with m open, the loss is measured at two microbatches and its bytes scaled up
    two = profile_model(Head(), (x,), devices=["cpu"], loss_fn=_ce, example_target=y)
    assert two.costs.low_batch_size == 2 and "batch_points_s" in two.timings_s
    assert two.costs.nodes[-1].saved_bytes >= before.saved_bytes + logits
    folded = with_loss_cost(plain.costs, cost)
    assert folded.nodes[-1].fwd_us == pytest.approx(before.fwd_us + cost.fwd_us)
    assert folded.nodes[:-1] == plain.costs.nodes[:-1]


def test_without_a_target_the_loss_is_timed_as_a_cross_entropy_and_cached_apart(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AUTOPART_CACHE_DIR", str(tmp_path))
    x, y = torch.randn(64, 16), torch.randint(0, 1000, (64,))
    captured = capture(Head(), (x,))
    guess = estimate_loss_cost(captured, "cpu")
    logits = 64 * 1000 * 4
    assert guess.fwd_us > 0 and guess.bwd_us > 0  # timed, not left at no time
    assert guess.source == "estimated:cross-entropy:cpu"
    assert logits <= guess.saved_bytes <= 3 * logits
    assert estimate_loss_cost(captured, "meta").fwd_us == 0.0  # nothing to run on

    def lossed(target: torch.Tensor | None) -> tuple[float, set[str]]:
        prof = profile_model(Head(), (x,), devices=["cpu"], num_microbatches=2, loss_fn=_ce,
                             example_target=target)
        return prof.costs.nodes[-1].fwd_us, set(prof.from_cache)

    plain = profile_model(Head(), (x,), devices=["cpu"], num_microbatches=2).costs.nodes[-1]
    first, _ = lossed(None)
    assert first > plain.fwd_us  # the stand-in's time is on the last node
    again, hits = lossed(None)
    assert "profile" in hits and again == first  # the second launch replays it
    measured, _ = lossed(y)  # the user's loss, measured: never the stand-in's figures
    assert measured == lossed(y)[0] and measured != first


def test_save_needs_a_traced_step(tmp_path: Path) -> None:
    trace = Trace((TraceEvent(0, "0F0", 0, 10), TraceEvent(1, "1F0", 12, 20),
                   TraceEvent(1, "loss", 20, 21), TraceEvent(0, "wait", 10, 30),
                   TraceEvent(0, "0B0", 30, 50)), "measured:cpu")

    class NoTrace:
        last_trace = None

    with pytest.raises(UsageError, match=r"train_step\(\.\.\., trace=True\)"):
        autopart.trace.save(NoTrace(), tmp_path / "x.json")
    assert set(autopart.trace.load(autopart.trace.save(trace, tmp_path / "x.json")).events) == \
        set(trace.events)
