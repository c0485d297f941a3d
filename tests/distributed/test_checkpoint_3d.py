"""Checkpoints across 3D layouts: tp 2 x pp 2 -> pp 2 x dp 2 ZeRO-3 -> tp 2 x dp 2 ZeRO-1 and
the plain model, on 4 gloo ranks (forked, with torchrun's environment), continue the unpartitioned loss curve
(``torchrun_ckpt_3d.py`` checks every step)."""

from __future__ import annotations

from pathlib import Path

from tests.distributed.torchrun_launch import torchrun


def test_a_3d_checkpoint_resumes_on_other_layouts_and_in_the_plain_model(tmp_path: Path) -> None:
    proc = torchrun("tests/distributed/torchrun_ckpt_3d.py", 4, tmp_path,
                    env={"TMPDIR": str(tmp_path)}, forked=True)
    for rank in range(4):
        for label, steps in (("tp2xpp2", (0, 1)), ("pp2xdp2-zero3", (2,)),
                             ("tp2xdp2-zero1", (3, 4))):
            for k in steps:
                assert f"rank {rank} {label} step {k} ok" in proc.stdout, proc.stdout[-3000:]
    assert "rank 0 plain step 3 ok" in proc.stdout and "rank 0 plain step 4 ok" in proc.stdout


def test_an_expert_parallel_checkpoint_resumes_across_ep_layouts_and_in_the_plain_model(
        tmp_path: Path) -> None:
    proc = torchrun("tests/distributed/torchrun_ckpt_ep.py", 4, tmp_path,
                    env={"TMPDIR": str(tmp_path)}, forked=True)
    for rank in range(4):
        for label, steps in (("dp4-ep4", (0, 1)), ("pp2xdp2-ep2", (2,)), ("pp2xdp2", (3, 4))):
            for k in steps:
                assert f"rank {rank} {label} step {k} ok" in proc.stdout, proc.stdout[-3000:]
    assert "rank 0 plain step 3 ok" in proc.stdout and "rank 0 plain step 4 ok" in proc.stdout
