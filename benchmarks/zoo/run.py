"""The zoo: every architecture in transformers' auto mappings through autopart, tiny and random.

For each model type of :data:`benchmarks.zoo.models.FAMILIES` (each type once) a child
process builds the tiny model (``models.build``) and records, step by step:

- ``eager``: the model runs forward on its inputs (batch 4);
- ``export``: ``torch.export.export(model, (), kwargs, strict=False)`` captures it;
- ``compile_2`` / ``compile_4``: ``autopart.compile`` into 2 (and, with at least 40 op
  nodes, 4) stages, 2 microbatches, schedule 1F1B, CP-SAT limit 1 s;
- ``match_2`` / ``match_4``: one ``train_step`` of the pipeline against the unpartitioned
  model: relative error ``||a - b|| / ||b||`` of the loss, of every parameter's gradient
  and of every floating buffer (max over them), passing at <= 1e-5 (fp32), against the
  unpartitioned model run by hand on the same 2 microbatches in order, each loss scaled by
  1/2 (so BatchNorm's running statistics must end equal too). A gradient smaller than 1e-3
  of the whole gradient's norm is measured against that (analytically zero ones, such as
  attention key biases, are rounding noise). Also recorded: the error against one
  full-batch step (``full_batch_rel_err``; not for BatchNorm models, whose statistics
  depend on the microbatch) and whether loss, gradients and buffers are bit-identical to
  the by-hand run (``bitwise_2`` / ``bitwise_4``; not required);
- seconds per step, and the first line of the first error with its type.

The first step that fails ends the model's run. Each model runs in a forked child process
with one thread and a wall-clock limit (``--timeout``, default 300 s); results stream to
``results.jsonl`` and are summed into ``results.json`` and ``results.md`` (counts per family).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/zoo/run.py [--quick] [--only TYPE ...]
        [--jobs 2] [--timeout 300] [--out benchmarks/zoo]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import re
import sys
import time
import traceback
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.zoo.models import BATCH, FAMILIES, Built, Entry, build, entries  # noqa: E402

TOLERANCE = 1e-5
"""Largest relative error ``||pipeline - reference|| / ||reference||`` that matches (fp32)."""
MICROBATCHES = 2
FOUR_STAGE_MIN_NODES = 40
"""Op nodes from which a model is also split into 4 stages."""
QUICK = ("gpt2", "llama", "bert", "t5", "whisper", "vit", "resnet", "wav2vec2", "bart",
         "convnext", "mistral", "roberta")
"""Model types of ``--quick``."""
STEPS = ("eager", "export", "compile_2", "match_2", "compile_4", "match_4")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"[:400]


FLOOR = 1e-3
"""A gradient whose norm is below ``FLOOR`` x the whole gradient's norm is compared against
that instead of its own norm (see :func:`_rel`)."""


def _rel(a: torch.Tensor, b: torch.Tensor, floor: float = 0.0) -> float:
    """``||a - b|| / max(||b||, floor)`` in float64 (``||a - b||`` when both are 0).

    The floor keeps analytically zero gradients, such as an attention key's bias (softmax
    ignores a constant added to every score), from dividing rounding noise by rounding noise.
    """
    a, b = a.detach().double(), b.detach().double()
    denom = max(float(b.norm()), floor)
    diff = float((a - b).norm())
    return diff / denom if denom > 0 else diff


def _has_batchnorm(model: torch.nn.Module) -> bool:
    return any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())


def _split(kwargs: dict[str, torch.Tensor], target: torch.Tensor, m: int,
           ) -> list[tuple[dict[str, torch.Tensor], torch.Tensor]]:
    parts = {k: v.chunk(m) for k, v in kwargs.items()}
    return [({k: parts[k][i] for k in kwargs}, t) for i, t in enumerate(target.chunk(m))]


def _reference(built: Built, microbatched: bool) -> tuple[torch.Tensor, dict[str, Any],
                                                            dict[str, torch.Tensor]]:
    """Loss, parameter gradients and buffers of the unpartitioned model after one step."""
    model = copy.deepcopy(built.model)
    if microbatched:
        losses = []
        for kw, t in _split(built.kwargs, built.target, MICROBATCHES):
            loss = built.loss_fn(model(**kw), t) / MICROBATCHES
            loss.backward()
            losses.append(loss.detach())
        total = torch.stack(losses).sum()
    else:
        total = built.loss_fn(model(**built.kwargs), built.target)
        total.backward()
        total = total.detach()
    grads = {n: p.grad for n, p in model.named_parameters()}
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    return total, grads, buffers


def _errors(loss: torch.Tensor, grads: dict[str, torch.Tensor | None],
            buffers: dict[str, torch.Tensor], ref: Any) -> tuple[dict[str, float], list[str]]:
    """Relative errors of loss, every gradient and every floating buffer against ``ref``."""
    ref_loss, ref_grads, ref_buffers = ref
    errors = {"loss": _rel(loss, ref_loss)}
    whole = float(torch.sqrt(sum(((g.double() ** 2).sum() for g in ref_grads.values()
                                  if g is not None), torch.zeros((), dtype=torch.float64))))
    missing: list[str] = []
    for name, grad in grads.items():
        want = ref_grads.get(name)
        if want is None and grad is None:
            continue
        if want is None or grad is None:
            missing.append(name)
            continue
        errors[f"grad:{name}"] = _rel(grad, want, FLOOR * whole)
    for name, b in buffers.items():
        if name in ref_buffers and b.is_floating_point():
            errors[f"buffer:{name}"] = _rel(b, ref_buffers[name])
    return errors, missing


def _check(pipe: Any, built: Built, full: Any, by_hand: Any, batchnorm: bool,
           ) -> dict[str, Any]:
    """One train step of ``pipe`` against the references; the errors found.

    ``max_rel_err`` is against the same microbatches run by hand (the pass criterion);
    ``full_batch_rel_err`` against one full-batch step (None with BatchNorm, whose
    statistics differ per microbatch).
    """
    loss = pipe.train_step(**built.kwargs, target=built.target)
    grads = {n: p.grad for n, p in pipe.named_parameters()}
    buffers = {n: b for n, b in pipe.named_buffers()}
    hand, missing = _errors(loss, grads, buffers, by_hand)
    worst = max(hand, key=hand.__getitem__)
    out: dict[str, Any] = {"max_rel_err": hand[worst], "worst": worst,
                           "missing_grads": missing, "checked": len(hand),
                           "full_batch_rel_err": None, "full_batch_worst": None}
    out["bitwise"] = not missing and torch.equal(loss, by_hand[0]) and all(
        torch.equal(g, by_hand[1][n]) for n, g in grads.items() if g is not None) and all(
        torch.equal(b, by_hand[2][n]) for n, b in buffers.items() if n in by_hand[2])
    if not batchnorm:
        full_err, _ = _errors(loss, grads, {}, full)
        w = max(full_err, key=full_err.__getitem__)
        out["full_batch_rel_err"], out["full_batch_worst"] = full_err[w], w
    return out


def run_one(entry: Entry, stage_counts: tuple[int, ...] = (2, 4),
            on_step: Any = None) -> dict[str, Any]:
    """Every step of the sweep for one model; see the module docstring.

    ``stage_counts``: the stage counts to compile into (4 only with
    :data:`FOUR_STAGE_MIN_NODES` op nodes or more); ``on_step(name)`` is called as each
    step starts. Returns the model's record.
    """
    import autopart
    from autopart.core.capture import op_nodes

    rec: dict[str, Any] = {"family": entry.family, "model_type": entry.model_type,
                           "class": entry.class_name, "seconds": {}}

    def step(name: str, fn: Any) -> Any:
        if on_step is not None:
            on_step(name)
        t0 = time.perf_counter()
        try:
            return fn()
        except Exception as exc:
            rec["failed_at"] = name
            rec["error"] = _first_line(exc)
            rec["error_type"] = type(exc).__name__
            rec["error_from_autopart"] = isinstance(exc, _autopart_errors())
            rec["traceback_tail"] = traceback.format_exc().strip().splitlines()[-6:]
            raise _Stop from exc
        finally:
            rec["seconds"][name] = round(time.perf_counter() - t0, 3)

    try:
        built = step("eager", lambda: build(entry))
        rec["eager"] = True
        rec["num_params"] = built.num_params
        try:
            ep = step("export", lambda: _export(built, rec))
        except _Stop:
            rec["autopart_error"] = _autopart_capture_error(built)
            raise
        rec["export"] = True
        n_ops = len(op_nodes(ep.module().graph))
        rec["op_nodes"] = n_ops
        batchnorm = _has_batchnorm(built.model)
        rec["batchnorm"] = batchnorm
        full = _reference(built, microbatched=False)
        by_hand = _reference(built, microbatched=True)
        for stages in stage_counts:
            if stages == 4 and n_ops < FOUR_STAGE_MIN_NODES:
                break
            model = copy.deepcopy(built.model)
            pipe = step(f"compile_{stages}", lambda s=stages, mdl=model: autopart.compile(
                mdl, (), example_kwargs=built.kwargs, loss_fn=built.loss_fn, num_stages=s,
                num_microbatches=MICROBATCHES, schedule="1f1b", time_limit_s=1.0))
            rec[f"compile_{stages}"] = True
            got = step(f"match_{stages}", lambda p=pipe: _check(p, built, full, by_hand,
                                                               batchnorm))
            rec[f"match_{stages}_detail"] = got
            rec[f"bitwise_{stages}"] = got["bitwise"]
            rec[f"match_{stages}"] = got["max_rel_err"] <= TOLERANCE and not got["missing_grads"]
            if not rec[f"match_{stages}"]:
                rec["failed_at"] = f"match_{stages}"
                rec["error"] = (f"numerics: {got['worst']} relative error "
                                f"{got['max_rel_err']:.3g} > {TOLERANCE}; missing gradients "
                                f"{got['missing_grads'][:3]}")
                break
    except _Stop:
        pass
    return rec


class _Stop(Exception):
    """A step failed; the record says which."""


EXPORT_TOLERANCE = 1e-3
"""Largest relative gradient error of the exported program against the model for the
capture to count as faithful (loose: it catches a dropped backward, not rounding)."""


class ExportMismatch(Exception):
    """The exported program computes other gradients than the model (a dropped backward)."""


def _export(built: Built, rec: dict[str, Any]) -> Any:
    """``torch.export.export(model, (), kwargs, strict=False)``, checked for gradients.

    The exported program (``ep.module()``) and the model each take one forward and
    backward on the full batch; ``export_grad_rel_err`` (recorded) is the largest relative
    error of the loss and of every parameter's gradient (with the :data:`FLOOR` of
    :func:`_errors`). Above :data:`EXPORT_TOLERANCE` the capture is not the model (a custom
    ``torch.autograd.Function``'s backward is dropped by export, for one) and the export
    step fails with :class:`ExportMismatch`: autopart starts from that capture and refuses
    it, so such a model counts as not captured. Gradients come from ``torch.autograd.grad``
    on copies, so the model's ``.grad`` stays unset. Where the program itself cannot be
    differentiated (its in-place ops, e.g. SEW-D's, trip autograd's version check), the
    check is skipped and recorded as ``export_grad_check``.
    """
    ep = torch.export.export(built.model, (), built.kwargs, strict=False)

    def loss_and_grads(model: torch.nn.Module) -> tuple[torch.Tensor, dict[str, Any]]:
        params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            loss = built.loss_fn(model(**built.kwargs), built.target)
        got = torch.autograd.grad(loss, [p for _, p in params], allow_unused=True)
        return loss.detach(), {n: g for (n, _), g in zip(params, got, strict=True)}

    want = loss_and_grads(copy.deepcopy(built.model))
    try:
        loss, grads = loss_and_grads(copy.deepcopy(ep).module())
    except Exception as exc:  # the unlifted program keeps in-place ops autograd may refuse
        rec["export_grad_check"] = f"not checked: {_first_line(exc)}"
        return ep
    errors, missing = _errors(loss, {n: grads.get(n) for n in want[1]}, {}, (*want, {}))
    worst = max(errors, key=errors.__getitem__)
    rec["export_grad_rel_err"] = errors[worst]
    if errors[worst] > EXPORT_TOLERANCE or missing:
        raise ExportMismatch(
            f"the exported program's gradients differ from the model's: {worst} relative "
            f"error {errors[worst]:.3g} > {EXPORT_TOLERANCE}; missing gradients {missing[:3]}")
    return ep


def _autopart_capture_error(built: Built) -> str | None:
    """What autopart's capture says of a model whose export failed (its first 3 lines), or
    None where autopart captures it anyway."""
    from autopart.core.capture import capture

    try:
        capture(copy.deepcopy(built.model), (), built.kwargs)
    except Exception as exc:
        text = re.sub(r"\S*site-packages/", "", str(exc))  # paths from the package root
        lines = [ln for ln in text.strip().splitlines() if ln.strip()]
        fix = [ln.strip() for ln in lines if ln.strip().startswith("fix:")]
        return f"{type(exc).__name__}: " + " / ".join(
            [ln.strip() for ln in lines[:3]] + fix[:1])[:1000]
    return None


def _autopart_errors() -> tuple[type[BaseException], ...]:
    from autopart.core.errors import AutopartError
    return (AutopartError,)


# ---- the sweep ---------------------------------------------------------------------
def _child_main(entry: Entry, conn: Any, stage_counts: tuple[int, ...]) -> None:
    import warnings
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    try:
        rec = run_one(entry, stage_counts, on_step=lambda name: conn.send(name))
        rec["stage_counts"] = list(stage_counts)
    except BaseException as exc:  # the record must come back whatever happened
        rec = {"family": entry.family, "model_type": entry.model_type,
               "class": entry.class_name, "failed_at": "crash", "error": _first_line(exc)}
    conn.send(json.dumps(rec, default=str))
    conn.close()


def _child(entry: Entry, timeout_s: float, stage_counts: tuple[int, ...]) -> dict[str, Any]:
    """Run one model in a forked child process (one thread); a crash or timeout is a record.

    The parent has imported torch, transformers and autopart (and run no op), so each fork
    starts without paying for the imports again.
    """
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child_main, args=(entry, send, stage_counts), daemon=True)
    t0 = time.perf_counter()
    base = {"family": entry.family, "model_type": entry.model_type, "class": entry.class_name}
    proc.start()
    send.close()
    rec: dict[str, Any] | None = None
    current = "start"
    while rec is None and recv.poll(max(0.0, timeout_s - (time.perf_counter() - t0))):
        try:
            msg = recv.recv()
        except EOFError:
            break
        if msg.startswith("{"):
            rec = json.loads(msg)
        else:
            current = msg  # the step now running
    proc.join(5.0)
    if proc.is_alive():
        proc.kill()
        proc.join()
    wall = round(time.perf_counter() - t0, 1)
    if rec is None:
        if time.perf_counter() - t0 >= timeout_s:
            return {**base, "failed_at": "timeout", "timeout_step": current,
                    "error": f"timed out after {timeout_s:.0f} s in step {current}",
                    "wall_s": wall}
        return {**base, "failed_at": "crash", "error": f"child exited {proc.exitcode}",
                "wall_s": wall}
    rec["wall_s"] = wall
    return rec


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts per family: tried, eager ok, export ok, compile ok, numerics ok."""
    per: dict[str, Counter[str]] = {}
    for r in records:
        c = per.setdefault(r["family"], Counter())
        c["tried"] += 1
        c["eager_ok"] += bool(r.get("eager"))
        c["export_ok"] += bool(r.get("export"))
        compiled = bool(r.get("compile_2")) and (r.get("compile_4", True)
                                                 or r.get("failed_at") != "compile_4")
        c["compile_ok"] += bool(r.get("export")) and compiled and \
            r.get("failed_at") not in ("compile_2", "compile_4", "timeout", "crash")
        c["match_ok"] += bool(r.get("match_2")) and r.get("match_4", True) is not False and \
            r.get("failed_at") not in ("compile_4", "match_4", "timeout", "crash")
        c["four_stages"] += bool(r.get("compile_4"))
    total: Counter[str] = Counter()
    for c in per.values():
        total.update(c)
    return {"per_family": {f: dict(c) for f, c in per.items()}, "total": dict(total)}


def _markdown(result: dict[str, Any]) -> str:
    s = result["summary"]
    cols = ("tried", "eager_ok", "export_ok", "compile_ok", "match_ok", "four_stages")
    lines = ["# zoo results", "", f"Machine: {result['machine']}; python {result['python']}, "
             f"torch {result['torch']}, transformers {result['transformers']}. "
             f"Command: `{result['command']}`; {result['wall_s']:.0f} s wall."
             + ("" if len(result.get("commands", [])) < 2 else " Records from the invocations "
                + ", ".join(f"`{c}`" for c in result["commands"]) + " (later ones replace "
                "earlier records of the same model type)."), "",
             "| family | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for fam in list(FAMILIES) + ["total"]:
        c = s["total"] if fam == "total" else s["per_family"].get(fam)
        if c is None:
            continue
        lines.append(f"| {fam} | " + " | ".join(str(c.get(k, 0)) for k in cols) + " |")
    gate = [r for r in result["models"] if r.get("export")]
    lines += ["", f"Of {len(gate)} models that run eagerly and export, "
              f"{sum(1 for r in gate if r.get('match_2') and r.get('match_4', True))} compile "
              "and match (2 stages, and 4 where they have "
              f"{FOUR_STAGE_MIN_NODES}+ op nodes).", "",
              "## Failures by step", ""]
    by_step = Counter(r.get("failed_at", "none") for r in result["models"])
    lines += [f"- {k}: {v}" for k, v in sorted(by_step.items())]
    refused = [r for r in result["models"] if r.get("failed_at") == "export"]
    if refused:
        lines += ["", "## Export failures, as autopart reports them", "",
                  "What `autopart.compile` says of each model that torch.export does not "
                  "capture faithfully (its capture's first lines and the fix).", "",
                  "| model type | export error | autopart |", "|---|---|---|"]
        for r in sorted(refused, key=lambda r: r["model_type"]):
            cells = [(r.get(k) or "-").replace("|", "\\|").replace("\n", " ")
                     for k in ("error", "autopart_error")]
            lines.append(f"| {r['model_type']} | {cells[0][:160]} | {cells[1]} |")
    lines += ["", "## Every model", "",
              "| family | model type | eager | export | 2 stages | 4 stages | max rel err | "
              "s | error |", "|---|---|---|---|---|---|---|---|---|"]

    def mark(r: dict[str, Any], s_: int) -> str:
        if r.get(f"match_{s_}"):
            return "ok" + (" (bitwise)" if r.get(f"bitwise_{s_}") else "")
        if r.get(f"compile_{s_}"):
            return "MISMATCH"
        return "fail" if r.get("failed_at") in (f"compile_{s_}",) else "-"

    for r in sorted(result["models"], key=lambda r: (r["family"], r["model_type"])):
        errs = [r.get(f"match_{k}_detail", {}).get("max_rel_err") for k in (2, 4)]
        err = max((e for e in errs if e is not None), default=None)
        text = (r.get("error") or "").replace("|", "\\|").replace("\n", " ")[:160]
        lines.append(
            f"| {r['family']} | {r['model_type']} | {'ok' if r.get('eager') else 'fail'} | "
            f"{'ok' if r.get('export') else ('fail' if r.get('eager') else '-')} | "
            f"{mark(r, 2)} | {mark(r, 4)} | {'' if err is None else f'{err:.1e}'} | "
            f"{r.get('wall_s', '')} | {text} |")
    return "\n".join(lines) + "\n"


def _round_robin(todo: list[Entry]) -> list[Entry]:
    """One model of each family in turn, so that a sweep cut short by ``--budget`` still
    covers every family."""
    queues: dict[str, list[Entry]] = {}
    for e in todo:
        queues.setdefault(e.family, []).append(e)
    out: list[Entry] = []
    while any(queues.values()):
        for q in queues.values():
            if q:
                out.append(q.pop(0))
    return out


def _prepare(repeats: int) -> None:
    """Set the profiler's repeats and warm every lazy import up once, before the forks.

    ``autopart.compile`` profiles with ``warmup=1, repeats=3``; the sweep wants the
    partition and its numerics, not the timings, so it profiles with ``warmup=0`` and
    ``repeats`` timed calls per node. A 3-layer MLP compiled here imports and initialises
    everything compile touches (OR-Tools, the runtime), which each forked child would
    otherwise pay for again.
    """
    import functools

    import autopart
    import autopart.profiler.session as planning
    from autopart.profiler import profile_graph

    planning.profile_graph = functools.partial(profile_graph, warmup=0, repeats=repeats)
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8),
                              torch.nn.Tanh(), torch.nn.Linear(8, 2))
    x = torch.randn(4, 8)
    pipe = autopart.compile(mlp, (x,), loss_fn=lambda o, t: torch.nn.functional.mse_loss(o, t),
                            num_stages=2, num_microbatches=2, schedule="1f1b",
                            time_limit_s=1.0)
    pipe.train_step(x, target=torch.zeros(4, 2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    ap.add_argument("--only", nargs="+", help="model types or class names to run")
    ap.add_argument("--jobs", type=int, default=1, help="models run at once (default 1)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per model")
    ap.add_argument("--out", type=Path, default=HERE, help="folder for results.*")
    ap.add_argument("--profile-repeats", type=int, default=1,
                    help="timed calls per node when profiling (autopart's default is 3 after "
                         "1 warm-up; the sweep checks correctness, not timings: 1, no warm-up)")
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 4],
                    help="stage counts to compile into (default 2 4; 4 only with "
                         f"{FOUR_STAGE_MIN_NODES}+ op nodes)")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds after which no new model starts (the rest is listed as "
                         "not run); default: no limit")
    ap.add_argument("--resume", action="store_true",
                    help="keep the models already in results.jsonl and run the rest (with "
                         "--only: run those again, replacing their records)")
    ap.add_argument("--retry", action="store_true",
                    help="with --resume: run again the models that timed out or crashed")
    a = ap.parse_args()
    os.environ.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
                       "TOKENIZERS_PARALLELISM": "false", "TRANSFORMERS_VERBOSITY": "error"})
    torch.set_num_threads(1)
    import transformers  # imported once here, before the forks

    from autopart.core.jsonio import write_text_atomic
    _prepare(a.profile_repeats)

    todo = entries()
    only = list(QUICK) if a.quick else a.only
    if only:
        todo = [e for e in todo if e.model_type in only or e.class_name in only]
    a.out.mkdir(parents=True, exist_ok=True)
    stream = a.out / "results.jsonl"
    done: dict[str, dict[str, Any]] = {}
    retry: set[str] = set()
    if a.resume and stream.is_file():
        for line in stream.read_text().splitlines():  # a later record of a type wins
            r = json.loads(line)
            done[r["model_type"]] = r
            if a.retry and r.get("failed_at") in ("timeout", "crash"):
                retry.add(r["model_type"])
            else:
                retry.discard(r["model_type"])
        retry.update(e.model_type for e in todo if only)  # named with --only: run again
    elif stream.exists():
        stream.unlink()
    todo = _round_robin([e for e in todo if e.model_type not in done or e.model_type in retry])
    t0 = time.perf_counter()
    print(f"{len(todo)} models to run, {len(done)} kept", flush=True)
    with ThreadPoolExecutor(max_workers=a.jobs) as pool, stream.open("a") as fh:
        def run(e: Entry) -> dict[str, Any] | None:
            if a.budget is not None and time.perf_counter() - t0 > a.budget:
                return None
            return _child(e, a.timeout, tuple(a.stages))

        for i, rec in enumerate(pool.map(run, todo)):
            if rec is None:
                continue
            done[rec["model_type"]] = rec
            fh.write(json.dumps(rec, default=str) + "\n")
            fh.flush()
            status = "ok" if rec.get("match_2") and not rec.get("failed_at") else \
                rec.get("failed_at", "?")
            print(f"[{i + 1}/{len(todo)}] {rec['family']}/{rec['model_type']}: {status} "
                  f"{rec.get('wall_s', '')} s {rec.get('error', '')[:120]}", flush=True)
    records = sorted(done.values(), key=lambda r: (r["family"], r["model_type"]))
    command = " ".join(["benchmarks/zoo/run.py", *sys.argv[1:]])
    commands = [command]
    if a.resume and (a.out / "results.json").is_file():  # the invocations whose records stay
        before = json.loads((a.out / "results.json").read_text())
        commands = before.get("commands", [before.get("command")]) + commands
    result = {
        "command": command, "commands": [c for c in commands if c],
        "machine": f"{platform.machine()}, {os.cpu_count()} cores (shared), one thread per model",
        "python": platform.python_version(), "torch": torch.__version__,
        "transformers": transformers.__version__, "batch": BATCH,
        "microbatches": MICROBATCHES, "tolerance": TOLERANCE,
        "wall_s": round(time.perf_counter() - t0, 1), "summary": summarize(records),
        "not_run": [e.model_type for e in entries() if e.model_type not in done],
        "models": records,
    }
    write_text_atomic(a.out / "results.json", json.dumps(result, indent=1, default=str) + "\n")
    write_text_atomic(a.out / "results.md", _markdown(result))
    print(json.dumps(result["summary"]["total"]))


if __name__ == "__main__":
    main()
