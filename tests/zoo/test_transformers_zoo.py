"""A CI-sized slice of benchmarks/zoo: about 20 transformers architectures across the six
families, each built tiny from its config class with random weights, captured, split into
2 stages and trained one step against the unpartitioned model run on the same microbatches.

The full sweep (every architecture, 2 and 4 stages) is ``benchmarks/zoo/run.py``.
"""

from __future__ import annotations

import functools

import pytest

pytest.importorskip("transformers")

from benchmarks.zoo.models import CI_SUBSET, Entry, entries  # noqa: E402
from benchmarks.zoo.run import TOLERANCE, run_one  # noqa: E402

SUBSET = CI_SUBSET


@functools.cache
def _entries() -> dict[tuple[str, str], Entry]:
    return {(e.family, e.model_type): e for e in entries()}


@pytest.fixture(autouse=True)
def _one_profile_sample(monkeypatch: pytest.MonkeyPatch) -> None:
    """Profile with one timed call per node and no warm-up: the test checks the partition's
    numerics, not its timings."""
    import autopart.profiler.profile_state as planning
    from autopart.profiler import profile_graph

    monkeypatch.setattr(planning, "profile_graph",
                        functools.partial(profile_graph, warmup=0, repeats=1))


@pytest.mark.slow
@pytest.mark.parametrize(("family", "model_type"),
                         [(f, t) for f, types in SUBSET.items() for t in types],
                         ids=lambda v: v)
def test_architecture_splits_into_two_stages_and_matches(family: str, model_type: str) -> None:
    entry = _entries().get((family, model_type))
    assert entry is not None, f"{model_type} is no longer in transformers' {family} mapping"
    rec = run_one(entry, stage_counts=(2,))
    assert rec.get("eager") and rec.get("export"), rec.get("error")
    assert rec.get("compile_2"), f"{rec.get('error_type')}: {rec.get('error')}"
    detail = rec["match_2_detail"]
    assert rec["match_2"], (f"{detail['worst']}: relative error {detail['max_rel_err']:.3g} > "
                            f"{TOLERANCE}; missing gradients {detail['missing_grads']}")
