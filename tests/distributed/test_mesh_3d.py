"""The (pp, dp, tp) mesh on 8 gloo ranks (no model), and autopart.compile replaying and
choosing a pp 2 x dp 2 plan on 4 ranks with torchrun's environment, against the plain model."""

from __future__ import annotations

import json
from pathlib import Path

from tests.distributed.spawned import launch
from tests.distributed.torchrun_launch import free_port, torchrun


def test_mesh_groups_on_8_ranks(tmp_path: Path) -> None:
    world = 8
    proc = launch("tests.distributed.mesh_worker", "mesh_layout", world, world, free_port(),
                  str(tmp_path), timeout_s=300, env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    for r in range(world):
        got = json.loads((tmp_path / f"rank{r}.json").read_text())
        pp_i, dp_i, tp_i = r // 4, r // 2 % 2, r % 2  # r = (pp_i * dp + dp_i) * tp + tp_i
        assert got["3d"] == {
            "pp": [dp_i * 2 + tp_i, 4 + dp_i * 2 + tp_i],          # same (dp, tp)
            "dp": [pp_i * 4 + tp_i, pp_i * 4 + 2 + tp_i],          # same (pp, tp)
            "tp": [pp_i * 4 + dp_i * 2, pp_i * 4 + dp_i * 2 + 1],  # adjacent ranks
            "dp_rank": dp_i, "same_mesh": True}, (r, got["3d"])
        # today's user-given 2-D ("pp", "dp") mesh: pp 4 x dp 2, no tp group
        assert got["2d"] == {"pp": [r % 2 + 2 * k for k in range(4)],
                             "dp": [r - r % 2, r - r % 2 + 1], "tp": None}, (r, got["2d"])
        wrong_world, too_many, wrong_mesh = got["errors"]
        assert "tp 1 x pp 2 x dp 2 needs 4 ranks but this launch has 8" in wrong_world
        assert "--nproc-per-node=4" in wrong_world
        assert "tp 2 x pp 4 x dp 2 needs 16 ranks" in too_many, too_many
        assert "--nproc-per-node=16" in too_many, too_many
        assert "the mesh's pp dimension has 4 ranks but the plan has pp=2" in wrong_mesh


def test_compile_replays_and_chooses_a_pp2_dp2_plan_from_torchruns_environment(tmp_path: Path) -> None:
    proc = torchrun("tests/distributed/torchrun_3d.py", 4, tmp_path, timeout_s=500,
                    forked=True)
    for rank in range(4):
        for label in ("replay", "chosen"):
            assert f"rank {rank} {label} ok loss" in proc.stdout, proc.stdout
    # rank 0 alone prints the chosen layout with the plan summary
    assert proc.stdout.count("layout: tp 1 x pp 2 x dp 2, ZeRO-0 (4 ranks)") == 1, proc.stdout
