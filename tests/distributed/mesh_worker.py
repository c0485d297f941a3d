"""Worker for the mesh tests (spawned with torch.multiprocessing, gloo, no model): each rank
writes the ranks of its pp, dp and tp groups and the errors it was given, as JSON."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import sys

import torch.distributed as dist

from tests.distributed.rank_exit import end_rank


def _plan(pp: int, tp: int, dp: int):  # type: ignore[no-untyped-def]
    """A plan of ``pp`` one-stage ranks and the given tp and dp; nothing but the layout is
    read by the mesh."""
    from autopart.core.plan import Cut, Plan, RankPlan, SolverReport, StagePlan

    stages = tuple(StagePlan(s, s, "cpu", "", "", 0, ("", ""), 0, 0, 0.0, 0.0, 0.0, 0)
                   for s in range(pp))
    plan = Plan(graph_fingerprint="g", cluster_fingerprint="c", cost_source="manual",
                library_versions={}, optimize="speed", batch_size=8 * dp, num_microbatches=2,
                schedule_kind="1f1b", stages_per_rank=1,
                cuts=tuple(Cut(k + 1, f"n{k}", f"n{k + 1}", 0) for k in range(pp - 1)),
                stages=stages, ranks=tuple(RankPlan(r, "cpu", (r,), 0) for r in range(pp)),
                predicted_step_time_us=0.0, bubble_fraction=0.0,
                solver=SolverReport("MANUAL", 0.0, 0.0, 0.0, 0.0, name="manual"))
    return dataclasses.replace(plan, tp=tp, dp=dp)


def _ranks(group: dist.ProcessGroup | None) -> list[int] | None:
    return None if group is None else dist.get_process_group_ranks(group)


def mesh_layout(rank: int, world: int, port: int, result_dir: str) -> None:
    """On 8 ranks: the 3-D mesh of a tp 2 x pp 2 x dp 2 plan, a user's 2-D (pp 4, dp 2) mesh
    with a pp-only plan, and the errors of plans this world cannot run."""
    sys.path.insert(0, os.getcwd())
    from torch.distributed.device_mesh import init_device_mesh

    from autopart.core.errors import PlanError
    from autopart.runtime.distributed.mesh import build_mesh, mesh_groups

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    out: dict[str, object] = {}
    groups = mesh_groups(_plan(2, 2, 2))
    out["3d"] = {"pp": _ranks(groups.pp_group), "dp": _ranks(groups.dp_group),
                 "tp": _ranks(groups.tp_group), "dp_rank": groups.dp_rank,
                 "same_mesh": build_mesh(2, 2, 2) is groups.mesh}
    user = init_device_mesh("cpu", (4, 2), mesh_dim_names=("pp", "dp"))
    groups = mesh_groups(_plan(4, 1, 1), user)
    out["2d"] = {"pp": _ranks(groups.pp_group), "dp": _ranks(groups.dp_group),
                 "tp": _ranks(groups.tp_group)}
    errors = []
    for pp, tp, dp, mesh in ((2, 1, 2, None), (4, 2, 2, None), (2, 1, 1, user)):
        try:
            mesh_groups(_plan(pp, tp, dp), mesh)
            errors.append("")
        except PlanError as exc:
            errors.append(str(exc))
    out["errors"] = errors
    with open(os.path.join(result_dir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.barrier()
    end_rank()
