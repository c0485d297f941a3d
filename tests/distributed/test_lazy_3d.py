"""A lazy compile with tp=2 on 2 ranks with torchrun's environment refuses an optimizer
built before the first step (it would hold the model's tensors, not this rank's slices) and
trains with one built after it, on a longer sequence too (the same slices, the plain model's
losses); a ZeRO-1 lazy pipeline refuses a second shape (``torchrun_lazy_3d.py``)."""

from __future__ import annotations

from pathlib import Path

from tests.distributed.torchrun_launch import torchrun


def test_a_lazy_tp_pipeline_refuses_an_early_optimizer_and_trains_a_later_one(
        tmp_path: Path) -> None:
    proc = torchrun("tests/distributed/torchrun_lazy_3d.py", 2, tmp_path, forked=True)
    for rank in (0, 1):
        assert f"rank {rank} lazy tp ok" in proc.stdout, proc.stdout[-3000:]
