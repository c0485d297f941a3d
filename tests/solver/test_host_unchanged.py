"""A CPU profile (no host issue times) gives byte-identical plans with the host-time cost model.

``data/cpu_gpt2_profile.json`` is a 2-layer GPT-2 (``tests/profiler/_models.small_gpt2``)
profiled on the CPU (torch 2.13.0+cpu). ``data/cpu_gpt2_plans.json`` holds the plans that the
solver of commit e3ac8a6, from before host issue times existed, made of it under
:func:`golden_plans` (solver wall time and library versions left out). Regenerate both only
when a change to the CPU cost model is meant::

    PYTHONPATH=. .venv/bin/python -c \
        "from tests.solver.test_host_unchanged import write_golden; write_golden()"

Regenerated once since, on 2026-11-27, when the one-process runtime's replica of a tied
parameter stopped being charged optimizer state (``solver/_memory_model.state_of``): only
the ``local`` cases changed (their peaks, and the memory-optimised zero-bubble plan); the
``distributed`` cases were still e3ac8a6's, byte for byte. Regenerated again on
2026-11-30, when a stage's backward was credited with the saved tensors it has freed before
its largest working set, torch's stages stopped being charged output-gradient buffers for
outputs that carry no gradient, and a strided output sent as a copy stopped being counted
twice: peaks of both runtimes changed (no more than 8 %), and two memory-optimised plans.
Regenerated on 2026-12-02, when CP-SAT stopped refining an answer the threshold search had
already brought within its 0.1 % gap (``solver/_refinement._refine``): one plan's solver
report (its bound, status and name: CP-SAT had proved the same answer optimal), nothing else.
Regenerated on 2026-12-03, when a recomputing stage's backward was credited with the saved
tensors it has freed (and charged the recomputation's own working set), and the memory
target's polish compared every rank's peak, largest first, and a recomputation was priced
up to the stage's last saved tensor (torch's early stop): the recomputing stages' peaks and
steps, and the memory-optimised zero-bubble plan (m 4, largest peak 1293056 bytes, was
1305600 at m 2); every other plan byte for byte.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from autopart.core.cluster import Cluster, DeviceSpec
from autopart.core.costgraph import CostGraph
from autopart.core.runtime_model import RuntimeDescription
from autopart.solver import SolveOptions, solve

DATA = Path(__file__).parent / "data"


def _cluster(ranks: int) -> Cluster:
    spec = DeviceSpec("test-cpu", 8 * 2**30, 1e11, 2e10, 5e9, 20.0, "made up for tests",
                      op_overhead_us=2.0)
    return Cluster.uniform(spec, [f"cpu{i}" for i in range(ranks)])


def _runtimes() -> dict[str, RuntimeDescription]:
    """The local runtime's costs and the distributed runtime's (a cost per transfer, a
    split backward, receive buffers per microbatch), built as the commit before host times
    could (no ``issue_threads``: each keeps its default)."""
    return {"local": RuntimeDescription(name="local"),
            "distributed": RuntimeDescription(
                name="distributed", receive_buffers_per_microbatch=True,
                transfer_overhead_us=35.0, split_backward_points=((1.0, 3.0), (4.0, 6.0)),
                ranks_are_processes=True)}


#: (ranks, runtime, optimize, schedule kind: None lets the solver choose)
CASES = ((2, "local", "speed", None), (2, "distributed", "speed", "zero_bubble"),
         (2, "distributed", "memory", None), (4, "local", "speed", None),
         (4, "distributed", "speed", None), (4, "local", "memory", "zero_bubble"))


def golden_plans(costs: CostGraph) -> dict[str, Any]:
    """Plans of ``costs`` for :data:`CASES`, as plain dicts. CP-SAT stops at its
    deterministic time, never at the (generous) wall-clock limit, however busy the machine."""
    out: dict[str, Any] = {}
    for ranks, rt_name, optimize, kind in CASES:
        opts = SolveOptions(batch_size=costs.batch_size, optimize=optimize, schedule_kind=kind,
                            runtime=_runtimes()[rt_name], time_limit_s=600)
        d = solve(costs, _cluster(ranks), opts).to_dict()
        d["solver"].pop("wall_s")
        d.pop("library_versions")
        # plan fields added since (False here: no dp, no tp), not a cost-model change
        assert d.pop("overlap_grad_reduce") is False
        assert d.pop("zero_layer_units") is False
        assert d.pop("sequence_parallel") is False
        assert d.pop("recompute_policy") == "full"
        assert d.pop("ep") == 1
        assert d.pop("cp") == 1
        assert d.pop("cp_attention") == "all_gather"
        assert not any(st.pop("recompute_kept") for st in d["stages"])
        out[f"{ranks}/{rt_name}/{optimize}/{kind}"] = d
    return out


def write_golden() -> None:
    """Write ``data/cpu_gpt2_plans.json`` from the profile (see the module docstring)."""
    costs = CostGraph.load(DATA / "cpu_gpt2_profile.json")
    (DATA / "cpu_gpt2_plans.json").write_text(
        json.dumps(golden_plans(costs), sort_keys=True, indent=1) + "\n", encoding="utf-8")


def test_cpu_profile_plans_are_byte_identical_to_the_plans_before_host_times() -> None:
    costs = CostGraph.load(DATA / "cpu_gpt2_profile.json")
    assert not costs.has_host_times and costs.source == "measured:cpu"
    want = (DATA / "cpu_gpt2_plans.json").read_text(encoding="utf-8")
    got = json.dumps(golden_plans(costs), sort_keys=True, indent=1) + "\n"
    assert got == want


def test_the_cpu_profile_round_trips_byte_for_byte_without_host_fields() -> None:
    text = (DATA / "cpu_gpt2_profile.json").read_text(encoding="utf-8")
    costs = CostGraph.from_dict(json.loads(text))
    assert "host_fwd_us" not in text
    assert json.loads(text) == json.loads(json.dumps(costs.to_dict()))
