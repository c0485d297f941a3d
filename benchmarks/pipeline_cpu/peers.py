"""Measured peers: autopart against DeepSpeed's pipeline engine, torch's schedules and the
hand split, on the same model, batch, m and two gloo ranks, arms alternated step by step.

For each workload (``lm_workloads.WORKLOADS``, plus ``workloads.WORKLOADS`` when that module
is there) autopart plans for 2 CPU ranks with m fixed to the workload's, on this process
with one thread; then every launch spawns two fresh rank processes (gloo, one thread each)
that build every arm from the same seeded weights and alternate them step by step, in an
order rotated every step, with a barrier before each arm's step. A step's time is the
slowest rank's and covers ``zero_grad``, forward and backward of all m microbatches, the
tied-weight gradient reduction and the AdamW step (DeepSpeed's ``train_batch`` does all of
these itself). Arms:

- ``autopart``: the solver's plan, ``autopart.compile(..., backend="distributed")``;
- ``deepspeed_parameters`` / ``deepspeed_uniform`` / ``deepspeed_type``: DeepSpeed's
  ``PipelineModule(num_stages=2, partition_method=...)`` + ``PipelineEngine`` (micro-batch
  batch/m, gradient accumulation m, fp32, ZeRO 0, ``torch.optim.AdamW`` as client optimizer);
- ``torch_1f1b``: ``Schedule1F1B`` driving autopart's stage modules (the best
  one-stage-per-rank 1F1B plan on the same profile when autopart's plan interleaves), and
  ``torch_interleaved_1f1b``: ``ScheduleInterleaved1F1B`` on autopart's own stages when it
  interleaves;
- ``hand_split``: ``torch.distributed.pipelining.pipeline()`` split at the workload's
  ``hand_split`` (half the blocks each), ``Schedule1F1B``;
- ``single``: the unpartitioned model on rank 0, the same m microbatches with gradient
  accumulation, while rank 1 waits (as ``autopart.apps.bench.run_arms``).

Every arm's first-step loss (the initial weights) is checked against ``single``'s (rtol
1e-4), and every later step's loss too (``loss_trajectory_check``, rtol 1e-4: the arms train
alike); a failed check or an arm that cannot be built is recorded in the JSON and printed.
An arm that crashes mid-run takes its launch down (its peer rank is left waiting): the crash
is recorded with every rank's error and the launch runs again without that arm.

    .venv/bin/python benchmarks/pipeline_cpu/peers.py [--workloads a,b] [--launches 1]
        [--steps 7] [--warmup 2] [--head-vocab 32000] [--arms a,b] [--out results_peers.json]

DeepSpeed is optional (``make bench-peers-setup``); without it its arms are recorded as
failing with the reason. It compiles a small CPU extension on first use (about 35 s) into
``$TORCH_EXTENSIONS_DIR`` (default here ``~/.cache/autopart/torch_extensions``).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import socket
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils import _pytree as pytree

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

HERE = Path(__file__).resolve().parent
RANKS = 2
RTOL = 1e-4
#: every later step's loss against single's: each arm's own AdamW on its own copy drifts by
#: rounding only (about 1e-7 over 10 steps here); a different update (DeepSpeed's default
#: gradient clipping at norm 1.0 gave 1.7e-3 after 9 steps) fails it
TRAJECTORY_RTOL = 1e-4
LR = 1e-4
DS_METHODS = {"deepspeed_parameters": "parameters", "deepspeed_uniform": "uniform",
              "deepspeed_type": "type"}
#: every arm, in the order runs and tables list them (interleaved only when the plan is)
ARMS = ("autopart", *DS_METHODS, "torch_1f1b", "torch_interleaved_1f1b", "hand_split", "single")
OTHER_WORKLOADS = "benchmarks.pipeline_cpu.workloads"
HEAD_VOCAB_ENV = "AUTOPART_PEERS_HEAD_VOCAB"  # lm_workloads.HEAD_VOCAB_ENV, read at its import


def catalog() -> tuple[dict[str, Any], dict[str, Any], str | None]:
    """(default workloads, every known workload, why ``workloads.py`` is missing or None)."""
    from benchmarks.pipeline_cpu import lm_workloads

    default = dict(lm_workloads.WORKLOADS)
    note = None
    try:
        import importlib

        other = importlib.import_module(OTHER_WORKLOADS)
        default.update(other.WORKLOADS)
    except ModuleNotFoundError as exc:
        if exc.name != OTHER_WORKLOADS:
            raise  # the module is there but imports something missing: say so
        note = f"{OTHER_WORKLOADS} is not there; its rows are not run"
    return default, {**default, **lm_workloads.TINY}, note


def split(tree: Any, m: int, batch: int) -> list[Any]:
    """``m`` microbatches of ``tree``: every tensor with ``batch`` rows is cut along dim 0
    (``torch.tensor_split``), anything else repeated."""
    leaves, spec = pytree.tree_flatten(tree)
    cols = [x.tensor_split(m) if isinstance(x, torch.Tensor) and x.dim() and x.shape[0] == batch
            else [x] * m for x in leaves]
    return [pytree.tree_unflatten([c[i] for c in cols], spec) for i in range(m)]


class _FlatOutput(nn.Module):
    """``model``'s output as a tensor or a tuple of tensors (torch's ``pipeline()`` and its
    stages pass only those), flattened with ``pytree``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args: Any) -> Any:
        leaves = pytree.tree_leaves(self.model(*args))
        return leaves[0] if len(leaves) == 1 else tuple(leaves)


def tied_groups(model: nn.Module) -> list[list[str]]:
    """The fqns of each parameter that ``model`` holds under more than one name, sorted."""
    names: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    return sorted(sorted(v) for v in names.values() if len(v) > 1)


def ranked(rank: int, world: int, port: int, work: str, name: str, steps: int, warmup: int,
           arms_wanted: list[str]) -> None:
    """One rank: build every arm of workload ``name``, alternate them, write rank<r>.json."""
    from torch.distributed.pipelining import PipelineStage, pipeline
    from torch.distributed.pipelining.schedules import Schedule1F1B, ScheduleInterleaved1F1B

    import autopart
    from autopart.core.jsonio import write_text_atomic
    from autopart.core.plan import Plan
    from autopart.runtime.host import tune_cpu_allocator

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    tune_cpu_allocator()  # every arm (DeepSpeed's, torch's, one process) runs with it
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=900))
    w = catalog()[1][name]
    model, inputs, target, loss_fn = w.build()
    m = w.num_microbatches
    plan = Plan.load(Path(work, "plan.json"))
    plan_1f1b = Plan.load(Path(work, "plan_1f1b.json")) if Path(work, "plan_1f1b.json").exists() \
        else plan
    steps_of: dict[str, Any] = {}
    failed: dict[str, str] = {}
    info: dict[str, Any] = {}
    closers: list[Any] = []

    def attempt(arm: str, make: Any) -> None:
        if arm not in arms_wanted:
            return
        try:
            steps_of[arm] = make()
        except Exception as exc:  # recorded with its reason, never hidden
            failed[arm] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()

    def adamw(params: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=LR)

    # autopart: its plan and schedule

    def make_autopart() -> Any:
        pipe = autopart.compile(copy.deepcopy(model), inputs, loss_fn=loss_fn, plan=plan,
                                backend="distributed")
        closers.append(pipe.close)
        opt = adamw(pipe.parameters())

        def step() -> float:
            opt.zero_grad()
            loss = pipe.train_step(*inputs, target=target)
            opt.step()
            return float(loss)
        return step

    attempt("autopart", make_autopart)

    # DeepSpeed's pipeline engine, one engine per partition method
    ds_wanted = [a for a in DS_METHODS if a in arms_wanted]
    if ds_wanted:
        try:
            import deepspeed
            from deepspeed.pipe import PipelineModule

            deepspeed.init_distributed(dist_backend="gloo")  # reuses the default group
        except Exception as exc:
            for arm in ds_wanted:
                failed[arm] = f"deepspeed unavailable ({type(exc).__name__}: {exc}); " \
                              "install it with `make bench-peers-setup`"
            ds_wanted = []
        ds_inputs, ds_labels = w.ds_batch(inputs, target)
        microbatches = list(zip(split(ds_inputs, m, w.batch), split(ds_labels, m, w.batch),
                                strict=True))
        for arm in ds_wanted:
            method = DS_METHODS[arm]
            method = f"type:{w.ds_type_regex}" if method == "type" else method

            def make_ds(method: str = method, arm: str = arm) -> Any:
                layers = w.ds_layers(copy.deepcopy(model))
                net = PipelineModule(layers=layers, num_stages=RANKS, loss_fn=w.ds_loss_fn,
                                     partition_method=method, activation_checkpoint_interval=0)
                config = {"train_batch_size": w.batch, "train_micro_batch_size_per_gpu": w.batch // m,
                          "gradient_accumulation_steps": m, "zero_optimization": {"stage": 0},
                          # DeepSpeed clips at norm 1.0 unless told; no other arm clips
                          "gradient_clipping": 0.0,
                          "fp16": {"enabled": False}, "bf16": {"enabled": False},
                          "steps_per_print": 10**9, "wall_clock_breakdown": False}
                engine, *_ = deepspeed.initialize(model=net, optimizer=adamw(net.parameters()),
                                                  config=config)
                info[arm] = {"partition_method": method, "parts": [int(x) for x in net.parts],
                             "layers": [_layer_name(x) for x in layers]}

                def step() -> float:
                    return float(engine.train_batch(data_iter=iter(microbatches)))
                return step

            attempt(arm, make_ds)

    def torch_step(sched: Any, params: list[torch.Tensor], reduce: Any, leaves: list[Any],
                   last: bool) -> Any:
        """One step of a torch schedule; ``reduce()`` sums the tied weights' gradients."""
        opt = adamw(params)

        def step() -> float | None:
            opt.zero_grad()
            losses: list[torch.Tensor] = []
            if rank == 0:
                sched.step(*leaves, target=target if last else None,
                           losses=losses if last else None)
            else:
                sched.step(target=target, losses=losses)
            reduce()
            opt.step()
            return float(torch.stack(losses).detach().mean()) if losses else None
        return step

    def own_pipe(p: Plan) -> Any:
        """autopart's stage modules for plan ``p`` on a copy of its own (every arm trains its
        own weights)."""
        pipe = autopart.compile(copy.deepcopy(model), inputs, loss_fn=loss_fn, plan=p,
                                backend="distributed")
        closers.append(pipe.close)
        return pipe

    # torch's Schedule1F1B on autopart's stages (one stage per rank)
    def make_torch_1f1b() -> Any:
        pipe = own_pipe(plan_1f1b)
        stage = pipe.pipeline_stages[0]
        sched = Schedule1F1B(PipelineStage(stage.submod, stage.stage_index, RANKS,
                                           torch.device("cpu")), m, loss_fn=pipe.loss_of_flat)
        return torch_step(sched, list(stage.submod.parameters()), pipe.reduce_grads,
                          pipe.signature.flatten(inputs, {}), last=False)

    if plan_1f1b.stages_per_rank == 1:
        attempt("torch_1f1b", make_torch_1f1b)

    # torch's ScheduleInterleaved1F1B on autopart's stages, when its plan interleaves
    def make_interleaved() -> Any:
        pipe = own_pipe(plan)
        stages = [PipelineStage(st.submod, st.stage_index, plan.num_stages, torch.device("cpu"))
                  for st in pipe.pipeline_stages]
        sched = ScheduleInterleaved1F1B(stages, m, loss_fn=pipe.loss_of_flat)
        last_here = any(st.stage_index == plan.num_stages - 1 for st in pipe.pipeline_stages)
        return torch_step(sched, [p for st in stages for p in st.submod.parameters()],
                          pipe.reduce_grads, pipe.signature.flatten(inputs, {}), last=last_here)

    if plan.schedule_kind == "interleaved_1f1b":
        attempt("torch_interleaved_1f1b", make_interleaved)

    # the hand split: pipeline() at the workload's split points, Schedule1F1B
    def make_hand() -> Any:
        mine = copy.deepcopy(model)
        flat = _FlatOutput(mine)
        mb_inputs = split(inputs, m, w.batch)[0]
        with torch.no_grad():
            _, out_spec = pytree.tree_flatten(mine(*mb_inputs))
        spec = {f"model.{fqn}": point for fqn, point in w.hand_split(mine).items()}
        ir = pipeline(flat, mb_args=tuple(mb_inputs), split_spec=spec)
        stage = ir.build_stage(rank, torch.device("cpu"))

        def hand_loss(out: Any, tgt: Any) -> torch.Tensor:
            leaves = list(out) if isinstance(out, (tuple, list)) else [out]
            return loss_fn(pytree.tree_unflatten(leaves, out_spec), tgt)

        sched = Schedule1F1B(stage, m, loss_fn=hand_loss)
        # a weight used on both stages (GPT-2's wte / lm_head) has a copy on each: sum the
        # copies' gradients, so every copy takes the same AdamW step
        shapes = dict(mine.named_parameters(remove_duplicate=False))
        local = list(stage.submod.named_parameters(remove_duplicate=False))
        groups = []
        for fqns in tied_groups(mine):
            held = {id(p): p for n, p in local
                    if any(n == f"model.{f}" or n.endswith(f".{f}") for f in fqns)}
            groups.append((list(held.values()), shapes[fqns[0]]))

        def reduce() -> None:
            for held, like in groups:
                total = torch.zeros_like(like)
                for p in held:
                    if p.grad is not None:
                        total += p.grad
                dist.all_reduce(total)
                for p in held:
                    p.grad = total.clone()

        info["hand_split"] = {"split": sorted(w.hand_split(mine))}
        return torch_step(sched, list(stage.submod.parameters()), reduce,
                          list(pytree.tree_leaves(inputs)), last=False)

    attempt("hand_split", make_hand)

    # the unpartitioned model on rank 0, m microbatches, gradients accumulated
    def make_single() -> Any:
        plain = copy.deepcopy(model)
        opt = adamw(plain.parameters())
        mbs = list(zip(split(inputs, m, w.batch), split(target, m, w.batch), strict=True))

        def step() -> float | None:
            if rank != 0:
                return None
            opt.zero_grad()
            total = 0.0
            for xs, ys in mbs:
                loss = loss_fn(plain(*xs), ys) / m
                loss.backward()
                total += float(loss.detach())
            opt.step()
            return total
        return step

    attempt("single", make_single)

    # run only the arms every rank built
    names = [a for a in ARMS if a in steps_of or a in failed]
    built = torch.tensor([1 if a in steps_of else 0 for a in names])
    dist.all_reduce(built, op=dist.ReduceOp.MIN)
    for a, ok in zip(names, built.tolist(), strict=True):
        if not ok and a in steps_of:
            del steps_of[a]
            failed.setdefault(a, "failed on the other rank (see its entry there)")
    order = [a for a in names if a in steps_of]
    times: dict[str, list[float]] = {a: [] for a in order}
    losses: dict[str, list[float | None]] = {a: [] for a in order}
    for i in range(warmup + steps):
        k = i % len(order) if order else 0
        for arm in order[k:] + order[:k]:
            dist.barrier()
            t0 = time.perf_counter()
            try:
                loss = steps_of[arm]()
            except Exception as exc:  # name the arm for run_launch, which reruns without it
                # atomically: the launcher may kill this rank while a peer's crash is read
                write_text_atomic(Path(work, f"crash{rank}.json"), json.dumps(
                    {"arm": arm, "step": i, "error": f"{type(exc).__name__}: {exc}"}))
                raise
            elapsed = time.perf_counter() - t0
            losses[arm].append(loss)
            if i >= warmup:
                times[arm].append(elapsed)
    Path(work, f"rank{rank}.json").write_text(json.dumps(
        {"times": times, "losses": losses, "failed": failed, "info": info}))
    for close in closers:
        close()
    dist.barrier()
    dist.destroy_process_group()


def _layer_name(layer: Any) -> str:
    typename = getattr(layer, "typename", None)  # LayerSpec / TiedLayerSpec
    if typename is not None:
        key = getattr(layer, "key", None)
        return f"{typename.__name__}" + (f"[tied {key}]" if key else "")
    return type(layer).__name__


def ratio_stats(times: list[float], base: list[float]) -> dict[str, Any]:
    """Paired step-by-step ``times / base``: median, bootstrap 95% CI of the median (10,000
    resamples, seed 0), min, max and the steps ``base`` won."""
    ratios = np.array([t / a for t, a in zip(times, base, strict=True)])
    rng = np.random.default_rng(0)
    boot = np.median(rng.choice(ratios, (10_000, len(ratios))), axis=1)
    return {"median": round(float(np.median(ratios)), 4),
            "median_95ci": [round(float(q), 4) for q in np.quantile(boot, [0.025, 0.975])],
            "min": round(float(ratios.min()), 4), "max": round(float(ratios.max()), 4),
            "autopart_faster_in": f"{int((ratios > 1).sum())}/{len(ratios)} steps"}


def spread(xs: list[float]) -> float:
    """``(max - min) / median``."""
    med = statistics.median(xs)
    return round((max(xs) - min(xs)) / med, 4) if med else 0.0


def plan_workload(w: Any, work: Path) -> dict[str, Any]:
    """Plan ``w`` for 2 CPU ranks (one thread, m fixed) and save the plan(s) in ``work``."""
    import autopart

    torch.set_num_threads(1)
    model, inputs, target, loss_fn = w.build()
    # planned for the runtime the arm runs: torch's stages, one receive buffer per microbatch
    plan, profile = autopart.plan_model(copy.deepcopy(model), inputs, devices=["cpu"] * RANKS,
                                        num_microbatches=w.num_microbatches, loss_fn=loss_fn,
                                        example_target=target, backend="distributed")
    plan.save(work / "plan.json")
    out = {"plan": _describe(plan)}
    if plan.stages_per_rank > 1:
        plan_1f1b = profile.solve(schedule_kind="1f1b", stages_per_rank=1)
        plan_1f1b.save(work / "plan_1f1b.json")
        out["plan_torch_1f1b"] = _describe(plan_1f1b)
    return out


def _describe(p: Any) -> dict[str, Any]:
    return {"schedule": p.schedule_kind, "stages_per_rank": p.stages_per_rank,
            "num_microbatches": p.num_microbatches, "cuts": [c.position for c in p.cuts],
            "predicted_step_s": round(p.predicted_step_time_us / 1e6, 4)}


def run_launch(w: Any, work: Path, steps: int, warmup: int, arms: list[str]) -> dict[str, Any]:
    """One launch of workload ``w``: two fresh rank processes; their merged measurements."""
    for f in [*work.glob("rank*.json"), *work.glob("crash*.json")]:
        f.unlink()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.perf_counter()
    try:
        mp.start_processes(ranked, args=(RANKS, port, str(work), w.name, steps, warmup, arms),
                           nprocs=RANKS, join=True, start_method="spawn")
    except Exception as exc:  # a rank crashed: keep the reason, go on with the next run
        text = str(exc).strip()  # the rank's traceback
        print(text, file=sys.stderr)
        got = {"error": f"{type(exc).__name__}: {text.splitlines()[-1]}",
               "traceback": text.splitlines()[-30:], "wall_s": round(time.perf_counter() - t0, 1)}
        files = sorted(work.glob("crash*.json"))
        crashes = [json.loads(f.read_text()) for f in files]
        if crashes:  # the first rank to fail names the arm; the others fail waiting on it
            got["crashed_arm"] = crashes[0]["arm"]
            got["crash"] = [f"rank {f.stem[5:]}: {c['arm']} at step {c['step']}: {c['error']}"
                            for f, c in zip(files, crashes, strict=True)]
        return got
    per_rank = [json.loads(Path(work, f"rank{r}.json").read_text()) for r in range(RANKS)]
    failed = {a: r for d in per_rank for a, r in d["failed"].items()}
    info = {k: v for d in reversed(per_rank) for k, v in d["info"].items()}
    step_times = {a: [max(d["times"][a][i] for d in per_rank) for i in range(steps)]
                  for a in per_rank[0]["times"]}
    # every step's loss (warm-up included), from the rank that knows it
    loss_of = {a: [next((d["losses"][a][i] for d in per_rank if d["losses"][a][i] is not None),
                        None) for i in range(warmup + steps)] for a in step_times}
    first_loss = {a: v[0] for a, v in loss_of.items()}
    m = w.num_microbatches
    ideal = m * RANKS / (m + RANKS - 1)
    single = step_times.get("single")
    ref_loss = first_loss.get("single")
    arms_out: dict[str, Any] = {}
    for arm, times in step_times.items():
        med = statistics.median(times)
        row: dict[str, Any] = {"step_s": round(med, 4), "spread": spread(times),
                               "steps_s": [round(t, 4) for t in times],
                               "first_loss": first_loss[arm]}
        if single is not None and arm != "single":
            speed = statistics.median(single) / med
            row.update(speedup=round(speed, 4), fraction_of_ideal=round(speed / ideal, 4))
        if ref_loss is not None and first_loss[arm] is not None:
            ok = abs(first_loss[arm] - ref_loss) <= RTOL * abs(ref_loss)
            row["loss_check"] = "pass" if ok else (
                f"FAIL: first loss {first_loss[arm]:.6f} vs single {ref_loss:.6f}")
        if "single" in loss_of and None not in loss_of[arm] + loss_of["single"]:
            # later steps drift apart by rounding only (each arm its own AdamW on its copy)
            diff = max(abs(a - b) / abs(b) for a, b in zip(loss_of[arm], loss_of["single"],
                                                           strict=True))
            row["max_loss_rel_diff"] = float(diff)
            row["loss_trajectory_check"] = "pass" if diff <= TRAJECTORY_RTOL else (
                f"FAIL: a loss {diff:.1e} (relative) away from single's")
        if arm != "autopart" and "autopart" in step_times:
            row["time_over_autopart"] = ratio_stats(times, step_times["autopart"])
        if arm in info:
            row.update(info[arm])
        arms_out[arm] = row
    return {"arms": arms_out, "failed": failed, "wall_s": round(time.perf_counter() - t0, 1)}


def summarize(launches: list[dict[str, Any]]) -> dict[str, Any]:
    """Per arm over the launches that ran it: the median of the launch medians, their spread,
    and the paired ratio to autopart pooled over every step of every launch."""
    ok = [launch for launch in launches if "arms" in launch]
    out: dict[str, Any] = {}
    for arm in ARMS:
        rows = [launch["arms"][arm] for launch in ok if arm in launch["arms"]]
        if not rows:
            continue
        meds = [r["step_s"] for r in rows]
        s: dict[str, Any] = {"step_s": round(statistics.median(meds), 4),
                             "step_s_per_launch": meds, "spread_over_launches": spread(meds),
                             "loss_check": "pass" if all(r.get("loss_check") == "pass"
                                                         for r in rows) else
                             "; ".join(str(r.get("loss_check", "not checked")) for r in rows)}
        drift = [r["max_loss_rel_diff"] for r in rows if "max_loss_rel_diff" in r]
        if drift:
            s["max_loss_rel_diff"] = max(drift)
            s["loss_trajectory_check"] = "pass" if max(drift) <= TRAJECTORY_RTOL else "FAIL"
        fracs = [r["fraction_of_ideal"] for r in rows if "fraction_of_ideal" in r]
        if fracs:
            s["fraction_of_ideal"] = round(statistics.median(fracs), 4)
        if arm != "autopart":
            times = [t for launch in ok if arm in launch["arms"] and "autopart" in launch["arms"]
                     for t in launch["arms"][arm]["steps_s"]]
            base = [t for launch in ok if arm in launch["arms"] and "autopart" in launch["arms"]
                    for t in launch["arms"]["autopart"]["steps_s"]]
            if times:
                s["time_over_autopart"] = ratio_stats(times, base)
        for key in ("parts", "partition_method", "split"):
            if key in rows[0]:
                s[key] = rows[0][key]
        out[arm] = s
    return out


def _version(dist_name: str) -> str:
    try:
        return importlib.metadata.version(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def markdown(report: dict[str, Any]) -> str:
    """``results_peers.md``: one table per workload."""
    lines = ["# Measured peers (`benchmarks/pipeline_cpu/peers.py`)", "",
             f"{report['machine']}; Python {report['python']}, torch {report['torch']}, "
             f"transformers {report['transformers']}, deepspeed {report['deepspeed']}, ortools "
             f"{report['ortools']}; {report['ranks']} gloo ranks x 1 thread; {report['launches']} "
             f"launch(es) x {report['steps']} timed steps ({report['warmup']} warm-up), arms "
             f"alternated; recorded {report['date']}.", "", f"`{report['command']}`", ""]
    for name, wl in report["workloads"].items():
        plan = wl["plan"]
        lines += [f"## {name}", "", wl["description"] + f"; m = {wl['num_microbatches']}, ideal "
                  f"speed-up {wl['ideal_speedup']}.", "",
                  f"autopart's plan: {plan['schedule']}, v = {plan['stages_per_rank']}, cuts "
                  f"{plan['cuts']}, predicted {plan['predicted_step_s']:.3f} s.", ""]
        for i, launch in enumerate(wl["launches"]):
            if "error" in launch:
                lines.append(f"- launch {i}: **failed**: {launch['error']}")
            for arm, why in launch.get("failed", {}).items():
                lines.append(f"- launch {i}: arm `{arm}` **failed**: {why}")
        lines += ["", "| arm | step s (median of launches) | per launch | spread over launches "
                  "| fraction of ideal | time / autopart [95% CI] | loss vs single: first step / "
                  "every step | partition |",
                  "|---|---:|---|---:|---:|---|---|---|"]
        for arm, s in wl["summary"].items():
            ratio = s.get("time_over_autopart")
            ratio_txt = (f"{ratio['median']:.3f} [{ratio['median_95ci'][0]:.3f}, "
                         f"{ratio['median_95ci'][1]:.3f}]") if ratio else "—"
            part = (f"{s.get('partition_method', '')} parts {s['parts']}" if "parts" in s
                    else f"cuts {plan['cuts']}" if arm == "autopart"
                    else f"split {s['split']}" if "split" in s else "")
            frac = f"{s['fraction_of_ideal']:.3f}" if "fraction_of_ideal" in s else "—"
            lines.append(f"| {arm} | {s['step_s']:.3f} | "
                         f"{' / '.join(f'{x:.3f}' for x in s['step_s_per_launch'])} | "
                         f"{s['spread_over_launches']:.1%} | {frac} | {ratio_txt} | "
                         f"{s['loss_check']} / {s.get('loss_trajectory_check', '—')} | {part} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default=None,
                        help="comma-separated names (default: every workload of "
                             "lm_workloads.WORKLOADS and workloads.WORKLOADS)")
    parser.add_argument("--launches", type=int, default=1, help="fresh process pairs per workload")
    parser.add_argument("--steps", type=int, default=7, help="timed steps per arm and launch")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--head-vocab", type=int, default=None,
                        help="gpt2_head_heavy's vocabulary (default 32000)")
    parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated arms to run")
    parser.add_argument("--out", type=Path, default=HERE / "results_peers.json",
                        help="JSON results; the Markdown table goes beside it (.md)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.launches < 1 or args.warmup < 0:
        parser.error("--steps and --launches must be at least 1, --warmup at least 0")
    if args.head_vocab is not None:  # before lm_workloads is imported (here and in the ranks)
        os.environ[HEAD_VOCAB_ENV] = str(args.head_vocab)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR",
                          str(Path.home() / ".cache" / "autopart" / "torch_extensions"))
    default, known, note = catalog()
    names = args.workloads.split(",") if args.workloads else list(default)
    unknown = [n for n in names if n not in known]
    if unknown:
        parser.error(f"unknown workload(s) {unknown}; known: {sorted(known)}"
                     + (f" ({note})" if note else ""))
    arms = args.arms.split(",")
    if bad := [a for a in arms if a not in ARMS]:
        parser.error(f"unknown arm(s) {bad}; arms: {list(ARMS)}")
    if note:
        print(f"note: {note}", file=sys.stderr)
    import ortools

    report: dict[str, Any] = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.node()}",
        "python": platform.python_version(), "torch": torch.__version__,
        "transformers": _version("transformers"), "deepspeed": _version("deepspeed"),
        "ortools": ortools.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": shlex.join(["python", "benchmarks/pipeline_cpu/peers.py",
                               *(sys.argv[1:] if argv is None else argv)]),
        "ranks": RANKS, "threads_per_rank": 1, "steps": args.steps, "warmup": args.warmup,
        "launches": args.launches, "loss_rtol": RTOL, "workloads": {}}
    with tempfile.TemporaryDirectory(prefix="autopart-peers-") as tmp:
        works = {}
        for name in names:  # plan once; every launch runs the same plans
            w = known[name]
            work = Path(tmp, name)
            work.mkdir()
            m = w.num_microbatches
            print(f"[{name}] planning for {RANKS} ranks, m = {m} ...", flush=True)
            report["workloads"][name] = {
                "description": w.description, "batch": w.batch, "num_microbatches": m,
                "ideal_speedup": round(m * RANKS / (m + RANKS - 1), 4), **plan_workload(w, work),
                "launches": []}
            works[name] = (w, work)
        for launch in range(args.launches):
            for name, (w, work) in works.items():
                print(f"[{name}] launch {launch + 1}/{args.launches} ...", flush=True)
                got = run_launch(w, work, args.steps, args.warmup, arms)
                # an arm that crashes mid-run takes the launch down: record why, then run the
                # launch again without it, so that the other arms are still measured
                crashed: dict[str, Any] = {}
                while got.get("crashed_arm") in arms and len(arms) > 1:
                    arm = got["crashed_arm"]
                    crashed[arm] = {"error": got["error"], "crash": got["crash"],
                                    "traceback": got["traceback"]}
                    print(f"[{name}] ARM CRASHED {arm}; launching again without it",
                          file=sys.stderr, flush=True)
                    got = run_launch(w, work, args.steps, args.warmup,
                                     [a for a in arms if a not in crashed])
                if crashed:
                    got["crashed"] = crashed
                    got.setdefault("failed", {}).update(
                        {a: "crashed, the launch was rerun without it: " + " | ".join(c["crash"])
                         for a, c in crashed.items()})
                report["workloads"][name]["launches"].append(got)
                for arm, why in got.get("failed", {}).items():
                    print(f"[{name}] ARM FAILED {arm}: {why}", file=sys.stderr)
                if "error" in got:
                    print(f"[{name}] LAUNCH FAILED: {got['error']}", file=sys.stderr)
                for arm, row in got.get("arms", {}).items():
                    check = row.get("loss_check", "not checked")
                    if check != "pass":
                        print(f"[{name}] LOSS CHECK {arm}: {check}", file=sys.stderr)
                    if row.get("loss_trajectory_check", "pass") != "pass":
                        print(f"[{name}] LOSS TRAJECTORY {arm}: {row['loss_trajectory_check']}",
                              file=sys.stderr)
                    print(f"[{name}]   {arm:24s} {row['step_s']:.3f} s  {check}", flush=True)
    for wl in report["workloads"].values():
        wl["summary"] = summarize(wl["launches"])
    from autopart.core.jsonio import write_text_atomic

    write_text_atomic(args.out, json.dumps(report, indent=2) + "\n")
    write_text_atomic(args.out.with_suffix(".md"), markdown(report) + "\n")
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}")
    return report


if __name__ == "__main__":
    main()
