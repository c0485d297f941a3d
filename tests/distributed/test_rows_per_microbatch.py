"""One row per microbatch on every replica (two on one dp and one tp layout), for every
4-rank layout the distributed runtime runs (pp 2 x dp 2 with ZeRO 0-3, tp 2 x pp 2, tp 2 x
dp 2, ZeRO-0's overlapped reduction on pp 2 x dp 2, tp 2 x dp 2 and ZB-V, and a plan rank 0
chooses at one row per microbatch): the global batch's loss on every rank and every gradient
against the plain model (``torchrun_rows.py`` checks them on every rank)."""

from __future__ import annotations

from pathlib import Path

from tests.distributed.torchrun_launch import torchrun

LABELS = [f"pp2xdp2 zero{zero} rows1" for zero in range(4)] + [
    f"{layout} rows1" for layout in ("pp2xdp2 overlap", "tp2xpp2", "tp2xdp2", "tp2xdp2 overlap")
] + ["pp2xdp2 zero0 rows2", "tp2xdp2 overlap rows2", "zbv overlap rows1", "chosen rows1"]


def test_every_layout_trains_at_one_and_two_rows_per_microbatch(tmp_path: Path) -> None:
    proc = torchrun("tests/distributed/torchrun_rows.py", 4, tmp_path, timeout_s=600,
                    forked=True)
    assert "FAILED" not in proc.stdout, proc.stdout[-4000:]
    for rank in range(4):
        for label in LABELS:
            assert f"rank {rank} {label} ok" in proc.stdout, (rank, label, proc.stdout[-4000:])
