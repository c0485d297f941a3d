"""Tests of the CPU allocator setting: what it sets, when it does nothing, and that it works."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

import autopart.runtime.host as host

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

# A step's pattern: 24 activations of 1-4 MiB (60 MiB) held, then freed; print the minor
# page faults that 10 more such steps take.
_FAULTS = """
import resource, sys, torch
from autopart.runtime.host import tune_cpu_allocator
if sys.argv[1] == "tuned":
    assert tune_cpu_allocator()
def step():
    held = [torch.ones((1 + i % 4) << 18) for i in range(24)]  # (256 Ki..1 Mi,) float32
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
    # measured here: about 29,700 faults by default (glibc hands the freed blocks back to
    # the OS), about 1,800 tuned; a step's 60 MiB is 15,360 pages
    assert tuned * 4 < default
    assert tuned < (60 << 20) // 4096 // 4


@pytest.mark.skipif(not GLIBC, reason="mallopt is glibc's")
def test_tuning_says_what_it_set_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host, "_done", None)
    monkeypatch.delenv(host.MALLOC_ENV, raising=False)
    first = host.tune_cpu_allocator()
    assert first == "M_MMAP_THRESHOLD=33554432 M_TRIM_THRESHOLD=2147483647"
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
