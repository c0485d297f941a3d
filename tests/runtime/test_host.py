"""Tests of the CPU allocator setting: what it sets, when it does nothing, and that it works."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import autopart.runtime.host as host

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

# A step's pattern: 24 activations of 1-4 MiB and one 48 MiB block (glibc maps blocks over
# 32 MiB afresh whatever its threshold), 108 MiB held, then freed; print the minor page
# faults that 10 more such steps take.
_FAULTS = """
import resource, sys, torch
from autopart.runtime.host import tune_cpu_allocator
if sys.argv[1] == "tuned":
    assert tune_cpu_allocator()
def step():
    held = [torch.ones((1 + i % 4) << 18) for i in range(24)]  # (256 Ki..1 Mi,) float32
    held.append(torch.ones(12 << 20))  # (12 Mi,) float32: 48 MiB
    del held
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _FAULTS, mode], capture_output=True,
                         text=True, check=True, env={"AUTOPART_MALLOC_TUNING": "1",
                                                     "PATH": "/usr/bin:/bin"})
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not GLIBC, reason="mallopt is glibc's")
def test_freed_tensor_memory_is_reused_instead_of_faulted_in_again() -> None:
    default, tuned = _faults("default"), _faults("tuned")
    # glibc hands the freed blocks back to the OS by default and faults them in again: the
    # 48 MiB block alone is 12,288 pages a step, 122,880 over the 10 (measured: 245,478 in
    # all by default; 1,792 to 12,288 tuned, as the heap settles in the first step)
    assert tuned * 4 < default
    assert tuned < 2 * (48 << 20) // 4096


@pytest.mark.skipif(not GLIBC, reason="mallopt is glibc's")
def test_tuning_says_what_it_set_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host, "_done", None)
    monkeypatch.delenv(host.MALLOC_ENV, raising=False)
    first = host.tune_cpu_allocator()
    assert first == "M_MMAP_MAX=0 M_TRIM_THRESHOLD=2147483647"
    assert host.tune_cpu_allocator() is first


@pytest.mark.parametrize("value", ["0", "off", "No", "false"])
def test_the_environment_turns_it_off(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setattr(host, "_done", None)
    monkeypatch.setenv(host.MALLOC_ENV, value)
    assert host.tune_cpu_allocator() is None


def test_nothing_is_set_off_glibc(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host, "_done", None)
    monkeypatch.delenv(host.MALLOC_ENV, raising=False)
    monkeypatch.setattr(host.platform, "libc_ver", lambda: ("musl", "1.2"))
    assert host.tune_cpu_allocator() is None


@pytest.mark.parametrize(("cores", "size", "shares"), [
    ((0, 1), 2, [(0,), (1,)]),
    ((0, 1, 2, 3), 2, [(0, 1), (2, 3)]),
    ((0, 1, 2, 3, 4), 2, [(0, 1, 2), (3, 4)]),
    ((7, 3, 5), 3, [(3,), (5,), (7,)]),
    ((0,), 2, [(), ()]),
])
def test_core_share_examples(cores: tuple[int, ...], size: int,
                             shares: list[tuple[int, ...]]) -> None:
    assert [host.core_share(cores, r, size) for r in range(size)] == shares


@given(st.sets(st.integers(0, 255), min_size=1, max_size=64), st.integers(1, 16))
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_core_shares_are_disjoint_contiguous_near_equal_and_cover_every_core(
        cores: set[int], size: int) -> None:
    shares = [host.core_share(sorted(cores), r, size) for r in range(size)]
    if len(cores) < size:
        assert shares == [()] * size
        return
    assert [c for share in shares for c in share] == sorted(cores)  # in order, each once
    assert max(map(len, shares)) - min(map(len, shares)) <= 1


def test_core_share_rejects_a_rank_outside_the_host() -> None:
    with pytest.raises(ValueError, match="local_rank=2 must be in"):
        host.core_share((0, 1), 2, 2)


@pytest.mark.skipif(not host.affinity_enabled(), reason="no per-thread affinity here")
def test_pin_threads_moves_every_thread_and_restores_each_ones_own() -> None:
    import threading

    stop = threading.Event()
    worker = threading.Thread(target=stop.wait)
    worker.start()
    try:
        before = host.thread_affinity()
        first = min(min(c) for c in before.values())
        host.pin_threads([first])
        assert set(host.thread_affinity().values()) == {frozenset({first})}
        host.pin_threads(before)
        assert host.thread_affinity() == before
    finally:
        stop.set()
        worker.join()


@pytest.mark.parametrize("value", ["0", "off", "No", "false"])
def test_affinity_can_be_turned_off(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(host.AFFINITY_ENV, value)
    assert not host.affinity_enabled()


def test_a_rank_the_os_will_not_pin_warns_and_runs_unpinned(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    import autopart.runtime.distributed.pipeline as distributed

    def refuse(cores: object) -> None:
        if not isinstance(cores, dict):
            raise OSError(22, "Invalid argument")

    monkeypatch.setattr(host, "pin_threads", refuse)  # what on_cores pins with
    rank = types.SimpleNamespace(cpu_cores=(5,), pp_rank=1)
    ran = []
    with pytest.warns(RuntimeWarning, match=r"rank 1: could not pin its threads to cores \[5\]"):
        with distributed.DistributedPipeline._on_own_cores(rank):  # type: ignore[arg-type]
            ran.append(True)
    assert ran == [True] and rank.cpu_cores is None  # the step ran; later steps do not try
