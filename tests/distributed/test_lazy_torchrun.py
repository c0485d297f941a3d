"""The README's first example as written, under torchrun on 2 CPU ranks (tests/distributed/
torchrun_lazy.py): no example inputs and no init_process_group; rank 0 plans at the first
step and the other rank waits for its plan; a second sequence length is built once."""

from __future__ import annotations

from pathlib import Path

from tests.distributed.torchrun_launch import torchrun


def test_lazy_compile_as_written_trains_under_torchrun(tmp_path: Path) -> None:
    proc = torchrun("tests/distributed/torchrun_lazy.py", 2, tmp_path, timeout_s=500)
    for rank in (0, 1):
        for step, seq in enumerate([8, 16, 8]):
            assert f"rank {rank} step {step} seq {seq} ok loss" in proc.stdout, proc.stdout
    assert proc.stdout.count("autopart: planned at the first train_step on inputs (4, 8): "
                             "2 ranks, 2 stages") == 1, proc.stdout  # rank 0 only
    assert proc.stdout.count("new input shape (4, 16)") == 1, proc.stdout
