"""Measure plans on real local ranks: step times (arms alternated), traces and peak memory.

The demo, ``autopart bench`` and ``benchmarks/fidelity`` share this: every rank is a process
spawned here (gloo, ``threads_per_rank`` threads each), builds the workload itself, compiles
every plan with the distributed backend and runs the arms one after another within each
step, in an order rotated every step, so drift in the machine's load hits every arm alike.
Step time is the slowest rank's, after a barrier. The unpartitioned arm (``"single"``)
runs on rank 0 alone with the same microbatching (gradients accumulated over m
microbatches) while the other ranks wait.
"""

from __future__ import annotations

import copy
import datetime
import importlib
import importlib.util
import json
import math
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autopart.core.errors import UsageError
from autopart.core.plan import Plan
from autopart.core.trace import Trace
from autopart.runtime.host import tune_cpu_allocator

__all__ = ["Workload", "ArmResult", "load_workload", "run_arms", "exposed_comm_rows",
           "SINGLE"]

#: (model, example inputs, target, loss_fn) for the full batch
Workload = tuple[nn.Module, tuple[Any, ...], Any, Callable[[Any, Any], torch.Tensor]]
#: the name of the unpartitioned, one-process arm
SINGLE = "single"


@dataclass
class ArmResult:
    """One arm's measurements.

    Attributes:
        steps_s: per timed step, the slowest rank's ``train_step``, seconds.
        peak_bytes: per rank, the peak of one memory-measured step (one entry for the
            single-process arm).
        losses: the loss of every step (timed ones included), to compare arms.
        trace: one traced step (None for the single-process arm or when not traced).
    """

    steps_s: list[float]
    peak_bytes: list[int]
    losses: list[float]
    trace: Trace | None = None

    @property
    def step_s(self) -> float:
        """Median step, seconds (nan for an untimed arm)."""
        return statistics.median(self.steps_s) if self.steps_s else math.nan

    @property
    def spread(self) -> float:
        """``(max - min) / median`` of the timed steps (nan for an untimed arm)."""
        if not self.steps_s:
            return math.nan
        return (max(self.steps_s) - min(self.steps_s)) / self.step_s if self.step_s else 0.0


def exposed_comm_rows(predicted_us: Sequence[float], measured: Trace | None) -> list[str]:
    """A Markdown table of exposed communication per pipeline rank: predicted (µs per rank,
    e.g. :attr:`autopart.solver.layout_predict.LayoutPrediction.exposed_comm_us` or a
    predicted trace's :meth:`Trace.exposed_comm_us`) against a traced step's
    (:meth:`Trace.exposed_comm_us`), with the traced step's collectives in flight
    (:meth:`Trace.comm_us`), ms, and the prediction's error; empty without a trace."""
    if measured is None:
        return []
    rows = ["| pipeline rank | exposed predicted ms | exposed measured ms | error "
            "| collectives in flight ms |", "|---:|---:|---:|---:|---:|"]
    for r, want in enumerate(predicted_us):
        got = measured.exposed_comm_us(r)
        error = f"{want / got - 1:+.0%}" if got > 0 else "-"
        rows.append(f"| {r} | {want / 1e3:.1f} | {got / 1e3:.1f} | {error} "
                    f"| {measured.comm_us(r) / 1e3:.1f} |")
    return rows


def load_workload(spec: str, config: dict[str, Any] | None = None) -> Workload:
    """Build a workload from a spec.

    Args:
        spec: ``"module:function"`` or ``"path/to/file.py:function"`` (the function returns
            ``(model, example_inputs[, target[, loss_fn]])``); or ``"hf:<ClassName>"`` for a
            transformers model built from its config class with ``config`` overrides, random
            weights, dropout off, inputs of random token ids (batch ``config["batch"]``,
            default 8, sequence ``config["seq"]``, default 128) and the next-token loss.
        config: for ``hf:`` specs, config fields (``n_layer=4``) plus ``batch`` and ``seq``.

    Raises:
        UsageError: a malformed spec, a module, file or function that does not exist, or a
            function that returns something else.
    """
    config = dict(config or {})
    if spec.startswith("hf:"):
        return _hf_workload(spec[3:], config)
    if ":" not in spec:
        raise UsageError(f"workload {spec!r}: expected 'module:function', 'file.py:function' or "
                         "'hf:<transformers class>'")
    where, name = spec.rsplit(":", 1)
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise UsageError(f"workload file {where} does not exist")
        module_spec = importlib.util.spec_from_file_location(f"_autopart_workload_{path.stem}",
                                                             path)
        assert module_spec is not None and module_spec.loader is not None
        module = importlib.util.module_from_spec(module_spec)
        sys.path.insert(0, str(path.parent.resolve()))
        module_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as exc:
            raise UsageError(f"workload module {where!r} cannot be imported ({exc})") from exc
    fn = getattr(module, name, None)
    if not callable(fn):
        raise UsageError(f"workload {spec!r}: {where} has no function {name!r}")
    got = fn(**config) if config else fn()
    if not isinstance(got, tuple) or not 2 <= len(got) <= 4 or not isinstance(got[0], nn.Module):
        raise UsageError(f"workload {spec!r} must return (model, example_inputs[, target[, "
                         f"loss_fn]]); it returned {type(got).__name__}")
    model, args = got[0], got[1] if isinstance(got[1], tuple) else (got[1],)
    target = got[2] if len(got) > 2 else None
    loss_fn = got[3] if len(got) > 3 else None
    if loss_fn is None:
        raise UsageError(f"workload {spec!r} returns no loss_fn; return (model, inputs, target, "
                         "loss_fn) to train it")
    return model, args, target, loss_fn


def _hf_workload(cls_name: str, config: dict[str, Any]) -> Workload:
    from autopart.apps.cli_profile import build_model
    from autopart.apps.demo import gpt2_loss

    batch, seq = int(config.pop("batch", 8)), int(config.pop("seq", 128))
    items = [f"{k}={json.dumps(v)}" for k, v in config.items()]
    model, (tokens,) = build_model(f"hf:{cls_name}", items, batch, seq, meta=False)
    cfg = model.config
    vocab = int(getattr(cfg, "vocab_size", 2) or 2)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if isinstance(getattr(cfg, key, None), int) and getattr(cfg, key) >= vocab:
            setattr(cfg, key, 0)
    for key in ("resid_pdrop", "embd_pdrop", "attn_pdrop", "hidden_dropout_prob",
                "attention_probs_dropout_prob", "dropout", "attention_dropout"):
        if isinstance(getattr(cfg, key, None), float):
            setattr(cfg, key, 0.0)
    for mod in model.modules():  # the modules read their rates at construction
        if isinstance(mod, nn.Dropout):
            mod.p = 0.0
    return model, (tokens,), tokens, gpt2_loss


def run_arms(workload: str, plans: dict[str, Plan], *, ranks: int, steps: int = 7,
             warmup: int = 2, config: dict[str, Any] | None = None, single: bool = True,
             threads_per_rank: int = 1, trace: bool | Collection[str] = True,
             measure_memory: bool = True, untimed: Collection[str] = (),
             save_plan_to: str | os.PathLike[str] | None = None,
             on_step: Callable[[int, int], None] | None = None,
             fuse: Collection[str] = (),
             overlap_pairs: Mapping[str, bool] | None = None) -> dict[str, ArmResult]:
    """Run every plan (and the unpartitioned model) on ``ranks`` local processes.

    Args:
        workload: a :func:`load_workload` spec every rank builds (the same seed everywhere).
        plans: arm name -> plan for ``ranks`` ranks (tp x pp x dp of them).
        ranks: processes to spawn (gloo on CPU).
        steps: timed steps per arm (default 7); ``warmup``: untimed steps first (default 2;
            AdamW's state exists after the first).
        config: :func:`load_workload` config.
        single: also run the unpartitioned model on rank 0 (arm :data:`SINGLE`), with the
            microbatch count of the first plan.
        threads_per_rank: ``torch.set_num_threads`` in every rank (default 1).
        trace: one traced step per plan arm (True), none (False) or the named arms';
            ``measure_memory``: one memory-measured step per arm (AdamW state held).
        untimed: arms measured for memory only: they run one step with the warm-up (AdamW's
            state then exists), no timed step and no trace; their ``steps_s`` is empty.
        save_plan_to: write the first plan there and every rank's stage sources beside it
            (``DistributedPipeline.save_plan``).
        on_step: called in this process as ``on_step(done, total)`` while steps run.
        fuse: arms whose stages run compiled (``autopart.compile(..., fuse=True)``; the
            first warm-up step compiles them).
        overlap_pairs: arm -> whether its DualPipe-V pairs run at once where the plan's
            layout allows it (``DistributedPipeline.overlap_pairs``; default: the
            runtime's, off on CPU ranks).

    Returns:
        Arm name -> :class:`ArmResult`.

    Raises:
        UsageError: no plans, or a plan for another rank count.
    """
    import torch.multiprocessing as mp

    if not plans:
        raise UsageError("run_arms needs at least one plan")
    overlap_pairs = dict(overlap_pairs or {})
    for what, named in (("untimed", untimed), ("fused", fuse),
                        ("overlap_pairs", overlap_pairs)):
        unknown = sorted(set(named) - set(plans))
        if unknown:
            raise UsageError(f"{what} arms {unknown} are not among the plans {list(plans)}")
    traced = list(plans) if trace is True else [] if trace is False else list(trace)
    for name, plan in plans.items():
        if plan.num_gpus != ranks:  # tp x pp x dp: a 3D plan's mesh spans them all
            raise UsageError(f"plan {name!r} is for {plan.num_gpus} ranks, not {ranks}")
    with tempfile.TemporaryDirectory(prefix="autopart-bench-") as work:
        for i, plan in enumerate(plans.values()):
            plan.save(Path(work, f"plan_{i}.json"))
        spec = {"workload": workload, "config": config or {}, "names": list(plans),
                "steps": steps, "warmup": warmup, "single": single,
                "threads": threads_per_rank, "trace": traced, "memory": measure_memory,
                "untimed": sorted(untimed), "fuse": sorted(fuse),
                "overlap_pairs": overlap_pairs,
                "save": None if save_plan_to is None else str(Path(save_plan_to).resolve())}
        Path(work, "spec.json").write_text(json.dumps(spec))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        # c10 warns once per process (CPUAllocator.cpp) when a step whose peak memory is
        # measured frees a block allocated before it, as every training step does; the rank
        # processes started here read TORCH_CPP_LOG_LEVEL when they import torch, so they
        # log C++ errors only, unless the user set the level
        quiet = "TORCH_CPP_LOG_LEVEL" not in os.environ
        if quiet:
            os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"
        try:
            ctx = mp.start_processes(_rank_main, args=(ranks, port, work), nprocs=ranks,
                                     join=False, start_method="spawn")
        finally:
            if quiet:
                del os.environ["TORCH_CPP_LOG_LEVEL"]
        timed = len(plans) - len(set(untimed)) + int(single)
        total = timed * (steps + warmup) + len(set(untimed))
        while not ctx.join(timeout=0.5):
            if on_step is not None:
                done = len(list(Path(work).glob("step_*")))
                on_step(min(done, total), total)
        return _read(work, list(plans) + ([SINGLE] if single else []))


def _read(work: str, names: list[str]) -> dict[str, ArmResult]:
    data = json.loads(Path(work, "result.json").read_text())
    out = {}
    for name in names:
        row = data[name]
        tr = Path(work, f"trace_{names.index(name)}.json")
        out[name] = ArmResult(row["steps_s"], row["peaks"], row["losses"],
                              Trace.load(tr) if tr.exists() else None)
    return out


def _rank_main(rank: int, world: int, port: int, work: str) -> None:
    import autopart
    from autopart.core.microbatch import split_leaves

    spec = json.loads(Path(work, "spec.json").read_text())
    torch.set_num_threads(spec["threads"])
    tune_cpu_allocator()  # every arm (the unpartitioned one too) runs with the same allocator
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=900))
    model, args, target, loss_fn = load_workload(spec["workload"], spec["config"])
    arms: list[tuple[str, Any, Any]] = []
    first_m = 1
    for i, name in enumerate(spec["names"]):
        plan = Plan.load(Path(work, f"plan_{i}.json"))
        first_m = first_m if i else plan.num_microbatches
        pipe = autopart.compile(copy.deepcopy(model), args, loss_fn=loss_fn, plan=plan,
                                backend="distributed", fuse=name in spec["fuse"])
        if name in spec["overlap_pairs"]:
            pipe.overlap_pairs = spec["overlap_pairs"][name]  # type: ignore[union-attr]
        # a rank whose stages hold no parameter (a cut after the input's reshape) still
        # steps: AdamW over one empty group, as torch refuses an empty parameter list
        arms.append((name, pipe, torch.optim.AdamW([{"params": list(pipe.parameters())}],
                                                   lr=1e-5)))
        if i == 0 and spec["save"]:
            pipe.save_plan(spec["save"])
    if spec["single"]:
        plain = copy.deepcopy(model)
        m = first_m
        mb_args = [list(x) for x in zip(*[split_leaves([a], m) for a in args], strict=True)]
        mb_targets = split_leaves([target], m)

        class _Single:
            def train_step(self, *_: Any, target: Any = None, **__: Any) -> torch.Tensor:
                total = torch.zeros(())
                if rank == 0:
                    for xs, ys in zip(mb_args, mb_targets, strict=True):
                        loss = loss_fn(plain(*[x[0] for x in xs]), ys[0]) / m
                        loss.backward()
                        total += loss.detach()
                return total

        arms.append((SINGLE, _Single(), torch.optim.AdamW(plain.parameters(), lr=1e-5)))
    results: dict[str, dict[str, Any]] = {n: {"steps_s": [], "losses": [], "peaks": []}
                                          for n, _, _ in arms}
    counter = 0
    untimed = set(spec["untimed"])
    for i in range(spec["warmup"] + spec["steps"]):
        for k in range(len(arms)):
            name, pipe, opt = arms[(i + k) % len(arms)]
            if name in untimed and i:
                continue  # one step, for the optimizer's state before the memory step
            opt.zero_grad()
            dist.barrier()
            t0 = time.perf_counter()
            loss = pipe.train_step(*args, target=target)
            elapsed = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            opt.step()
            results[name]["losses"].append(float(loss))
            if i >= spec["warmup"] and name not in untimed:
                results[name]["steps_s"].append(float(elapsed))
            counter += 1
            if rank == 0:
                Path(work, f"step_{counter}").touch()
    for idx, (name, pipe, opt) in enumerate(arms):
        opt.zero_grad()
        if name == SINGLE:
            if spec["memory"] and rank == 0:
                from autopart.core.memory import measure_peak_bytes, optimizer_tensors

                held = [t for p in plain.parameters() for t in (p, p.grad) if t is not None]
                held += list(plain.buffers()) + optimizer_tensors(opt)
                _, peaks = measure_peak_bytes(pipe.train_step, [torch.device("cpu")], held)
                results[name]["peaks"] = [peaks["cpu"]]
            dist.barrier()
            continue
        if name in spec["trace"] and name not in untimed:
            pipe.train_step(*args, target=target, trace=True)
            opt.zero_grad()
            if rank == 0:
                pipe.last_trace.save(Path(work, f"trace_{idx}.json"))
        if spec["memory"]:
            pipe.train_step(*args, target=target, measure_memory=True, optimizer=opt)
            results[name]["peaks"] = list(pipe.last_peak_memory_bytes.by_rank.values())
        pipe.close()
    if rank == 0:
        Path(work, "result.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()
