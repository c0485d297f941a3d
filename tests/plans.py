"""Hand-written plans for tests: cuts at given positions, no profiling or solving."""

from __future__ import annotations

from autopart.capture import CapturedGraph, op_nodes
from autopart.plan import Cut, Plan, RankPlan, SolverReport, StagePlan


def manual_plan(captured: CapturedGraph, positions: list[int], num_microbatches: int,
                batch_size: int) -> Plan:
    """A plan with cuts at ``positions`` (op-node indices) and zero predictions."""
    names = [n.name for n in op_nodes(captured.graph_module.graph)]
    num_stages = len(positions) + 1
    stages = tuple(StagePlan(s, s, "cpu", "", "", 0, ("", ""), 0, 0, 0.0, 0.0, 0.0, 0)
                   for s in range(num_stages))
    return Plan(graph_fingerprint=captured.fingerprint, cluster_fingerprint=f"{num_stages}xcpu",
                cost_source="manual", library_versions={}, optimize="speed",
                batch_size=batch_size, num_microbatches=num_microbatches, schedule_kind="gpipe",
                cuts=tuple(Cut(p, names[p - 1], names[p], 0) for p in positions),
                stages=stages, ranks=tuple(RankPlan(s, "cpu", (s,), 0) for s in range(num_stages)),
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
