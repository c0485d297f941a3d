"""tp 2 x pp 2 x dp 2 on 8 gloo ranks (forked, with torchrun's environment), ZeRO-1 and
ZeRO-3: loss, every gradient, the gradient norm and a bf16-autocast step against the plain
model (``torchrun_3d_8.py`` checks them on every rank)."""

from __future__ import annotations

from pathlib import Path

from tests.distributed.torchrun_launch import torchrun


def test_tp2_pp2_dp2_with_zero_1_and_3_is_the_plain_model(tmp_path: Path) -> None:
    proc = torchrun("tests/distributed/torchrun_3d_8.py", 8, tmp_path, forked=True)
    for rank in range(8):
        for zero in (1, 3):
            assert f"rank {rank} zero{zero} ok" in proc.stdout, proc.stdout[-3000:]
