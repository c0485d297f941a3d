"""Tests of the profile cache: location, keys, stale keys never reused, atomic JSON files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from autopart.core.capture import capture
from autopart.core.cluster import PRESETS
from autopart.profiler import profile_analytical
from autopart.profiler.cache import cache_dir, cached_profile, load_cached, profile_key, store


def test_cache_dir_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("AUTOPART_CACHE_DIR", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c"
    monkeypatch.delenv("AUTOPART_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert cache_dir() == tmp_path / "x" / "autopart"


def test_store_load_and_stale_keys(tmp_path: Path) -> None:
    x = torch.randn(2, 4)
    captured = capture(nn.Sequential(nn.Linear(4, 4)), (x,))
    costs = profile_analytical(captured, [x], PRESETS["l4"])
    key = profile_key(captured.fingerprint, "l4", [x], dtype="float32", training=True,
                      method="analytical")
    assert load_cached(key, tmp_path) is None
    path = store(key, costs, tmp_path)
    assert load_cached(key, tmp_path) == costs
    assert json.loads(path.read_text())["key"]["versions"]["torch"] == torch.__version__
    for change in ({"device": "h100-sxm"}, {"dtype": "bfloat16"}, {"inputs": [[[3, 4], "x"]]},
                   {"versions": {"torch": "0.0"}}):
        assert load_cached({**key, **change}, tmp_path) is None
    # A file whose stored key differs (e.g. written by another version) is never reused.
    data = json.loads(path.read_text())
    data["key"]["versions"] = {"torch": "0.0"}
    path.write_text(json.dumps(data))
    assert load_cached(key, tmp_path) is None
    calls: list[int] = []
    got, hit = cached_profile(key, lambda: calls.append(1) or costs, tmp_path)
    assert not hit and calls == [1] and got == costs
    got, hit = cached_profile(key, lambda: calls.append(1) or costs, tmp_path)
    assert hit and calls == [1]
    assert not list(tmp_path.glob(".*.tmp"))
