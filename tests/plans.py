"""Hand-written plans for tests: cuts at given positions, no profiling or solving."""

from __future__ import annotations

from typing import Any

from autopart import PipelinedModule
from autopart.codegen import build_stages
from autopart.core.capture import CapturedGraph, op_nodes
from autopart.core.plan import Cut, Plan, RankPlan, SolverReport, StagePlan
from autopart.core.schedule import stage_ranks
from autopart.core.signature import InputSignature


def manual_plan(captured: CapturedGraph, positions: list[int], num_microbatches: int,
                batch_size: int, *, schedule_kind: str = "gpipe", stages_per_rank: int = 1,
                recompute: bool = False) -> Plan:
    """A plan with cuts at ``positions`` (op-node indices) and zero predictions.

    ``p = stages / stages_per_rank`` ranks; stages are placed as ``schedule_kind`` places them
    (stage ``s`` on rank ``s % p``, or in a V for ``zbv`` / ``dualpipev``: ``stage_ranks``).
    """
    names = [n.name for n in op_nodes(captured.graph_module.graph)]
    num_stages = len(positions) + 1
    p = num_stages // stages_per_rank
    rank_of = stage_ranks(schedule_kind, p, stages_per_rank)
    stages = tuple(StagePlan(s, rank_of[s], "cpu", "", "", 0, ("", ""), 0, 0, 0.0, 0.0, 0.0, 0,
                             recompute=recompute)
                   for s in range(num_stages))
    return Plan(graph_fingerprint=captured.fingerprint, cluster_fingerprint=f"{num_stages}xcpu",
                cost_source="manual", library_versions={}, optimize="speed",
                batch_size=batch_size, num_microbatches=num_microbatches,
                schedule_kind=schedule_kind, stages_per_rank=stages_per_rank,
                cuts=tuple(Cut(k, names[k - 1], names[k], 0) for k in positions),
                stages=stages,
                ranks=tuple(RankPlan(r, "cpu", tuple(s for s in range(num_stages)
                                                     if rank_of[s] == r), 0)
                            for r in range(p)),
                predicted_step_time_us=0.0, bubble_fraction=0.0,
                solver=SolverReport("MANUAL", 0.0, 0.0, 0.0, 0.0, name="manual"))


def even_positions(captured: CapturedGraph, num_stages: int) -> list[int]:
    """Cut positions that split the op nodes into equal counts, nudged off non-tensor values."""
    from autopart.codegen.split import crossing_names

    nodes = op_nodes(captured.graph_module.graph)
    by_name = {n.name: n for n in captured.graph_module.graph.nodes}
    n = len(nodes)
    out: list[int] = []
    for s in range(1, num_stages):
        p = s * n // num_stages
        while True:
            names = crossing_names(captured, [p])[0]
            import torch

            if all(by_name[x].op == "placeholder" or isinstance(by_name[x].meta.get("val"),
                                                                torch.Tensor) for x in names):
                break
            p += 1
        out.append(p)
    return out


def local_pipeline(model: Any, captured: CapturedGraph, plan: Plan, devices: list[str], *,
                   loss_fn: Any = None, fuse: bool = False) -> PipelinedModule:
    """A one-process pipeline of ``plan`` on ``devices`` (one per rank), built the way
    ``autopart.compile`` builds it, without profiling or solving."""
    stages = build_stages(captured, plan, devices, fuse=fuse)
    return PipelinedModule(model, stages, InputSignature.of(captured), loss_fn=loss_fn)
