"""``benchmarks/gpu/nccl_world1.py``, the GPU run's smoke test of the distributed runtime on a
torchrun world of one rank, run here on gloo (launched by torchrun itself): the process
group, placement, train_step's loss and every gradient against the plain model, and a
checkpoint saved and loaded back into the pipeline and the plain model."""

from __future__ import annotations

from pathlib import Path

from tests.distributed.torchrun_launch import torchrun


def test_a_world_of_one_rank_trains_as_the_plain_model_and_checkpoints(tmp_path: Path) -> None:
    proc = torchrun("benchmarks/gpu/nccl_world1.py", 1, tmp_path, timeout_s=300,
                    args=["--out", str(tmp_path)])
    out = proc.stdout
    assert "nccl_world1: 5 of 5 checks passed" in out, out[-3000:]
    for check in ("process group: pass: gloo, world 1", "train_step numerics: pass",
                  "checkpoint save and load: pass", "skipped on gloo"):
        assert check in out, out[-3000:]
    assert (tmp_path / "nccl_world1.json").is_file()
