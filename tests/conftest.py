"""Shared fixtures: CPU only by default; GPU tests carry the requires_cuda marker."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is visible")
    for item in items:
        if "requires_cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _own_profile_cache(tmp_path_factory: pytest.TempPathFactory,
                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test profiles into an empty cache of its own, never into ~/.cache/autopart:
    compile() caches profiles by default, and a test must not see another's costs."""
    monkeypatch.setenv("AUTOPART_CACHE_DIR", str(tmp_path_factory.mktemp("autopart-cache")))
    # the machine's load is not what tests check: profiles measured while the test run
    # itself loads the machine are cached as on a quiet one (test_cache covers the rule)
    monkeypatch.setattr("autopart.profiler.cache.machine_busy", lambda: None)
    monkeypatch.setattr("autopart.profiler.profile_state.machine_busy", lambda: None)  # its numbers
