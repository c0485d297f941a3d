"""cp's runtime additions measured against a control at the same per-rank shape, alternated.

Arm A: the context_parallel benchmark's Llama, 4 x 1024 tokens, cp 2 (all-gather), m 2: each
rank runs 2 microbatches of 2 x 512 tokens through the whole model, attention over the
gathered keys. Arm B: the same model at 8 x 512 tokens, dp 2, m 2: each rank runs the same
2 x 512-token microbatches with the model's own attention, no cp exchange (and a dp all-reduce
after its backward). A and B alternate (separate run_arms calls: the workloads differ),
--rounds times; per action the traced F and B durations; and the priced cp additions per
microbatch are the difference of the two arms' predicted actions.

    .venv/bin/python benchmarks/context_parallel/control.py [--rounds 4] [--steps 5]

Prints; writes nothing.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    o = ap.parse_args()
    spec = importlib.util.spec_from_file_location("cpb", Path(__file__).parent / "run.py")
    assert spec is not None and spec.loader is not None
    cpb = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cpb)
    from autopart.apps.bench import load_workload, run_arms
    from autopart.core.context import context_inputs
    from autopart.layout_planning import model_heads
    from autopart.planning import profile_model
    from autopart.solver.layout_search import solve_layout
    torch.set_num_threads(1)
    f3d = cpb.fidelity_3d()
    cfg_a, cfg_b = dict(cpb.CONFIG), dict(cpb.CONFIG, batch=8, seq=512)
    plans = {}
    for name, cfg, fixed in (("cp2", cfg_a, {**cpb.FIXED, "dp": 1, "cp": 2, **cpb.GATHER}),
                             ("dp2", cfg_b, {**cpb.FIXED, "dp": 2, "cp": 1})):
        model, args, target, loss_fn = load_workload(cpb.WORKLOAD, dict(cfg))
        heads = model_heads(model)
        inputs, kwargs, tgt = context_inputs(model, fixed["cp"], args, {}, target)
        prof = profile_model(model, inputs, example_kwargs=kwargs, devices=["cpu"] * 2,
                             loss_fn=loss_fn, example_target=tgt, backend="distributed",
                             cache=False)
        shared = f3d.world_profile(prof, 2)
        opts = shared.options(schedule_kind="1f1b", recompute=False, num_microbatches=2,
                              optimizer_state_bytes_per_param_byte=2.0)
        plans[name] = solve_layout(shared.costs, shared.cluster().devices[0], opts,
                                   cpb.layout_request_for(shared, 2, fixed, heads))
        st = plans[name].stages
        per_stage = ", ".join(f"stage {s.stage_index} F {s.predicted_fwd_us / 1e3:.1f} "
                              f"B {s.predicted_bwd_us / 1e3:.1f} ms" for s in st)
        print(f"{name} predicted per microbatch: {per_stage}; "
              f"step {plans[name].predicted_step_time_us / 1e3:.1f} ms", flush=True)
    got: dict[str, dict[str, list[float]]] = {n: {"F": [], "B": []} for n in plans}
    arms = [("cp2", cfg_a), ("dp2", cfg_b)]
    for r in range(o.rounds):
        for name, cfg in arms if r % 2 == 0 else arms[::-1]:
            res = run_arms(cpb.WORKLOAD, {name: plans[name]}, ranks=2, steps=o.steps,
                           config=dict(cfg), single=False, trace=True,
                           measure_memory=False)[name]
            assert res.trace is not None
            for e in res.trace.events:
                if e.action is not None:
                    got[name][e.action[1]].append(e.duration_us / 1e3)
            print(f"round {r} {name}: steps {[round(s * 1e3) for s in res.steps_s]} ms", flush=True)
    for name, d in got.items():
        print(f"{name} traced per microbatch: F median {statistics.median(d['F']):.1f} ms "
              f"({[round(x) for x in d['F']]}), B median {statistics.median(d['B']):.1f} ms "
              f"({[round(x) for x in d['B']]})")


if __name__ == "__main__":
    main()
