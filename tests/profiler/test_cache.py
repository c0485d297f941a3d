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
from autopart.profiler.cache import (
    cache_dir,
    cache_enabled,
    cached_profile,
    load_cached,
    load_measure,
    profile_key,
    store,
    store_measure,
)
from autopart.profiler.cache import machine_busy as real_machine_busy


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


def test_measured_cpu_key_names_the_cpu_and_its_threads() -> None:
    x = torch.randn(2, 4)
    captured = capture(nn.Sequential(nn.Linear(4, 4)), (x,))
    measured = profile_key(captured.fingerprint, "cpu", [x], dtype="float32", training=True,
                           method="measured")
    assert measured["device"].startswith("cpu:")
    assert measured["device"].endswith(f":threads={torch.get_num_threads()}")
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(old + 1)
        assert profile_key(captured.fingerprint, "cpu", [x], dtype="float32", training=True,
                           method="measured") != measured  # op times depend on threads
    finally:
        torch.set_num_threads(old)
    # an analytical profile of the cpu preset does not depend on this machine
    assert profile_key(captured.fingerprint, "cpu", [x], dtype="float32", training=True,
                       method="analytical")["device"] == "cpu"


def test_measures_live_with_their_profile(tmp_path: Path) -> None:
    x = torch.randn(2, 4)
    captured = capture(nn.Sequential(nn.Linear(4, 4)), (x,))
    costs = profile_analytical(captured, [x], PRESETS["l4"])
    key = profile_key(captured.fingerprint, "l4", [x], dtype="float32", training=True,
                      method="analytical")
    assert store_measure(key, "split_backward_factor", 1.25, tmp_path) is None  # no profile
    assert load_measure(key, "split_backward_factor", tmp_path) is None
    path = store(key, costs, tmp_path)
    assert load_measure(key, "split_backward_factor", tmp_path) is None
    assert store_measure(key, "split_backward_factor", 1.25, tmp_path) == path
    assert load_measure(key, "split_backward_factor", tmp_path) == 1.25
    assert load_cached(key, tmp_path) == costs  # the profile is still there
    assert load_measure({**key, "dtype": "bfloat16"}, "split_backward_factor", tmp_path) is None
    data = json.loads(path.read_text())
    data["measures"]["split_backward_factor"] = "1.25"  # not a number: never used
    path.write_text(json.dumps(data))
    assert load_measure(key, "split_backward_factor", tmp_path) is None
    store(key, costs, tmp_path)  # a new profile drops what was measured on the old one
    assert load_measure(key, "split_backward_factor", tmp_path) is None


@pytest.mark.parametrize(("value", "enabled"), [(None, True), ("1", True), ("0", False),
                                                 ("off", False), ("False", False)])
def test_cache_enabled_by_default(monkeypatch: pytest.MonkeyPatch, value: str | None,
                                  enabled: bool) -> None:
    if value is None:
        monkeypatch.delenv("AUTOPART_CACHE", raising=False)
    else:
        monkeypatch.setenv("AUTOPART_CACHE", value)
    assert cache_enabled() is enabled


def test_a_cpu_profile_measured_on_a_busy_machine_is_used_but_not_cached(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import autopart.profiler.cache as cache

    x = torch.randn(2, 4)
    captured = capture(nn.Sequential(nn.Linear(4, 4)), (x,))
    costs = profile_analytical(captured, [x], PRESETS["l4"])
    key = profile_key(captured.fingerprint, "cpu", [x], dtype="float32", training=True,
                      method="measured:test")
    monkeypatch.setattr(cache, "machine_busy", lambda: "load average 9.0 on 2 CPUs")
    with pytest.warns(RuntimeWarning, match=r"busy \(load average 9.0 on 2 CPUs\).* not cached"):
        got, hit = cached_profile(key, lambda: costs, tmp_path)
    assert got == costs and not hit and load_cached(key, tmp_path) is None
    monkeypatch.setattr(cache, "machine_busy", lambda: None)
    cached_profile(key, lambda: costs, tmp_path)
    assert load_cached(key, tmp_path) == costs


def test_machine_busy_compares_the_load_average_with_the_cpus(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import autopart.profiler.cache as cache

    monkeypatch.setattr(cache.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(cache.os, "getloadavg", lambda: (1.5, 0.0, 0.0))
    assert real_machine_busy() is None  # the fixtures replace cache.machine_busy
    monkeypatch.setattr(cache.os, "getloadavg", lambda: (4.2, 0.0, 0.0))
    assert real_machine_busy() == "load average 4.2 on 2 CPUs"


def test_a_session_number_is_cached_by_the_load_its_caller_judged(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import autopart.profiler.profile_state as profile_state
    from autopart.profiler.profile_state import Session

    x = torch.randn(2, 4)
    captured = capture(nn.Sequential(nn.Linear(4, 4)), (x,))
    key = profile_key(captured.fingerprint, "cpu", [x], dtype="float32", training=True,
                      method="measured:test")
    store(key, profile_analytical(captured, [x], PRESETS["l4"]))  # $AUTOPART_CACHE_DIR
    session = Session.__new__(Session)  # only what store() reads
    session.device, session.use_cache, session.key, session._warned_busy = "cpu", True, key, False
    monkeypatch.setattr(profile_state, "machine_busy", lambda: "load average 3.5 on 2 CPUs")
    with pytest.warns(RuntimeWarning, match="not cached"):
        session.store("asked_now", 1.5)
    session.store("judged_before", 2.5, busy=None)
    session.store("busy_before", 3.5, busy="load average 4.0 on 2 CPUs")
    assert load_measure(key, "asked_now") is None and load_measure(key, "busy_before") is None
    assert load_measure(key, "judged_before") == 2.5
