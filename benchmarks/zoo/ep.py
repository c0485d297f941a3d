"""The zoo's mixtures of experts at ep = 2: each MoE model on 2 gloo ranks (dp = 2, experts
split over the 2 replicas, pp = 1), one step against the plain model.

For each model type whose tiny config has experts (``num_local_experts``, ``num_experts``,
``n_routed_experts`` or ``moe_num_experts`` above 1, on the config or its text config),
two forked processes join a gloo group and each:

1. builds the tiny model (``models.build``: seed 0, the same weights on both ranks; 4
   experts, top-2; :data:`EP_OVERRIDES` where the zoo's 2-layer config keeps every layer
   dense) and captures it at the microbatch (its replica's 2 of the 4 rows). A model with
   no experts module even so (none named ``experts``, no class named ``...Expert(s)`` or
   ``...MoE``) is recorded as ``dense``;
2. builds its one stage with its ep rank's 2 experts per MoE layer (``build_stages(...,
   ep=)``, ``autopart/codegen/expert_parallel.py``): a :class:`~autopart.PlanError` (an
   experts module the pass cannot read, named with the op) is recorded as ``refused`` with
   its first line;
3. runs one ``train_step`` of the global batch (each replica its rows, one microbatch; the
   tokens dispatched to the experts' ranks and back with all-to-all) and compares, on rank
   0, the global loss, every parameter's gradient (the experts' gathered over ep) and
   every floating buffer with the unpartitioned model run by hand on the same two halves
   (:data:`benchmarks.zoo.run.TOLERANCE` = 1e-5 relative, fp32).

``status`` is ``match``, ``mismatch``, ``refused``, ``dense``, ``failed`` (another error; its type
and first line) or ``timeout``. Results go to ``results_ep2.json`` and ``results_ep2.md``
(``--out``), with the command and the machine.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/zoo/ep.py [--only TYPE ...] [--timeout 240]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import json
import os
import platform
import re
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.zoo.models import (  # noqa: E402
    BATCH,
    OVERRIDES,
    Entry,
    entries,
    tiny_config,
)
from benchmarks.zoo.run import TOLERANCE  # noqa: E402
from benchmarks.zoo.tp import _plan, full_grads, rank_main, run_ranks  # noqa: E402

__all__ = ["EP", "EP_OVERRIDES", "experts_of", "main", "markdown", "run_ep_one"]

EP = 2
"""Expert-parallel degree of the arm (= dp: 2 gloo ranks, one replica each)."""
_EXPERT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
#: Config fields that make the zoo's 2-layer tiny models MoE: their defaults keep the first
#: layers dense (DeepSeek's ``first_k_dense_replace = 3``), MoE off (Doge), or a sparse
#: layer every fourth (NLLB-MoE), which 2 layers never reach. Applied on top of
#: ``models.OVERRIDES`` for this arm only.
EP_OVERRIDES: dict[str, dict[str, Any]] = {
    "bailing_hybrid": {"first_k_dense_replace": 0, "mlp_layer_types": ["sparse", "sparse"]},
    "beam": {"mlp_layer_types": ["sparse", "sparse"]},
    "deepseek_v3": {"first_k_dense_replace": 0},
    "deepseek_v32": {"first_k_dense_replace": 0, "mlp_layer_types": ["sparse", "sparse"]},
    "glm_moe_dsa": {"first_k_dense_replace": 0, "mlp_layer_types": ["sparse", "sparse"]},
    "doge": {"is_moe": True},
    "flint": {"mlp_only_layers": []},
    "nllb-moe": {"encoder_sparse_step": 1, "decoder_sparse_step": 1},
    "switch_transformers": {"num_sparse_encoder_layers": 2, "num_sparse_decoder_layers": 2},
}


def experts_of(cfg: Any) -> int | None:
    """The experts per MoE layer of a config (or of its text config), else None."""
    for c in (cfg, getattr(cfg, "text_config", None)):
        for name in _EXPERT_FIELDS:
            value = getattr(c, name, None) if c is not None else None
            if isinstance(value, int) and value > 1:
                return value
    return None


def _step(built: Any, captured: Any) -> tuple[Any, dict[str, Any], dict[str, torch.Tensor],
                                              int]:
    """One train step of this rank's replica: (the global loss, full gradients, buffers,
    the expert tensors split); raises PlanError where the experts cannot be split."""

    from autopart import DistributedPipeline
    from autopart.codegen import TensorParallelRank, build_stages
    from autopart.core.signature import InputSignature
    from autopart.runtime.distributed.mesh import mesh_groups

    plan = dataclasses.replace(_plan(captured, BATCH, {}), tp=1, num_microbatches=1, dp=EP,
                               ep=EP)
    groups = mesh_groups(plan)
    stages = build_stages(captured, plan, ["cpu"], ranks={0},
                          ep=TensorParallelRank.of_group(groups.ep_group))
    pipe = DistributedPipeline(copy.deepcopy(built.model), stages,
                               InputSignature.of(captured), torch.device("cpu"),
                               loss_fn=built.loss_fn, pp_group=groups.pp_group,
                               dp_group=groups.dp_group, ep_group=groups.ep_group,
                               edp_group=groups.edp_group)
    loss = pipe.train_step(**built.kwargs, target=built.target)
    grads = full_grads(pipe, stages.ep_shards, groups.ep_group, EP)
    buffers = {n: b for n, b in pipe.named_buffers()}
    pipe.close()
    return loss, grads, buffers, len(stages.ep_shards)


def _ep_arm(built: Any, rec: dict[str, Any]) -> tuple[Any, Any, Any] | None:
    """This rank's step of ``built`` at ep = 2, its figures in ``rec``; None when ``rec``
    is complete without one (a dense tiny model)."""
    from autopart.core.capture import capture

    rec["experts"] = experts_of(built.model.config)
    if not any(name.rsplit(".", 1)[-1] == "experts" or
               re.search(r"(experts?|moe)$", type(m).__name__, re.IGNORECASE)
               for name, m in built.model.named_modules()):
        rec.update(status="dense", error="the tiny config builds no experts module")
        return None
    kwargs = {k: v[: v.shape[0] // EP] for k, v in built.kwargs.items()}
    captured = capture(copy.deepcopy(built.model), (), kwargs)
    loss, grads, buffers, rec["split"] = _step(built, captured)
    return loss, grads, buffers


def run_ep_one(entry: Entry, timeout_s: float = 240.0) -> dict[str, Any]:
    """Run ``entry`` at dp = ep = 2 in two forked processes (one thread each); its record."""
    return run_ranks(entry, functools.partial(rank_main, world=EP, arm=_ep_arm), EP, timeout_s)


def markdown(result: dict[str, Any]) -> str:
    """The results as a Markdown page: counts by status, then one row per model."""
    counts = Counter(r["status"] for r in result["models"])
    lines = ["# zoo MoE models at ep = 2", "",
             f"Machine: {result['machine']}; python {result['python']}, torch "
             f"{result['torch']}, transformers {result['transformers']}. Command: "
             f"`{result['command']}`; {result['wall_s']:.0f} s wall"
             + "".join(f"; earlier records from `{c}`" for c in result.get("earlier_commands", []))
             + ". dp = ep = 2 gloo ranks, "
             "pp = 1, one microbatch per replica; global loss, every gradient (experts "
             f"gathered over ep) and buffer within {TOLERANCE:g} (relative, fp32) of the "
             "plain model run by hand on the same halves.", "",
             "| status | models |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in sorted(counts.items())]
    lines += ["", "experts: per MoE layer (tiny config); split: expert tensors split over ep "
              "on a rank.", "",
              "| family | model type | experts | split | status | max rel err | s | reason |",
              "|---|---|---|---|---|---|---|---|"]
    for r in sorted(result["models"], key=lambda r: (r["family"], r["model_type"])):
        err = r.get("max_rel_err")
        why = (r.get("error") or "").replace("|", "\\|").replace("\n", " ")[:240]
        lines.append(f"| {r['family']} | {r['model_type']} | {r.get('experts', '')} | "
                     f"{r.get('split', '')} | {r['status']} | "
                     f"{'' if err is None else f'{err:.1e}'} | {r.get('wall_s', '')} | {why} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", help="model types to run (default: every MoE type)")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per model")
    ap.add_argument("--out", type=Path, default=HERE, help="folder for results_ep2.*")
    ap.add_argument("--resume", action="store_true",
                    help="keep the records in --out of the model types not run this time")
    a = ap.parse_args()
    os.environ.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
                       "TOKENIZERS_PARALLELISM": "false", "TRANSFORMERS_VERBOSITY": "error"})
    torch.set_num_threads(1)
    import transformers

    import autopart.codegen  # noqa: F401  (imported once, before the forks)
    import autopart.runtime.distributed.pipeline  # noqa: F401
    from autopart.core.jsonio import write_text_atomic

    for model_type, fields in EP_OVERRIDES.items():  # inherited by the forked ranks
        OVERRIDES[model_type] = {**OVERRIDES.get(model_type, {}), **fields}
    todo: list[Entry] = []
    seen: set[str] = set()
    for e in entries():
        if e.model_type in seen or (a.only and e.model_type not in a.only):
            continue
        try:
            moe = experts_of(tiny_config(e.model_type)) is not None
        except Exception:  # noqa: BLE001 - a config the zoo cannot build is not run here
            moe = False
        if moe:
            seen.add(e.model_type)
            todo.append(e)
    t0 = time.perf_counter()
    records = []
    for i, entry in enumerate(todo):
        rec = run_ep_one(entry, a.timeout)
        records.append(rec)
        print(f"[{i + 1}/{len(todo)}] {entry.family}/{entry.model_type}: {rec['status']} "
              f"{rec.get('wall_s')} s {rec.get('error', '')[:160]}", flush=True)
    command = " ".join(["benchmarks/zoo/ep.py", *sys.argv[1:]])
    earlier: list[str] = []
    if a.resume and (a.out / "results_ep2.json").exists():
        old = json.loads((a.out / "results_ep2.json").read_text())
        ran = {r["model_type"] for r in records}
        records = [r for r in old["models"] if r["model_type"] not in ran] + records
        earlier = old.get("earlier_commands", []) + [old["command"]]
    result = {"command": command, "earlier_commands": earlier,
              "machine": f"{platform.machine()}, {os.cpu_count()} cores (shared), one thread "
                         "per rank", "python": platform.python_version(),
              "torch": torch.__version__, "transformers": transformers.__version__,
              "ep": EP, "tolerance": TOLERANCE, "wall_s": round(time.perf_counter() - t0, 1),
              "counts": dict(Counter(r["status"] for r in records)), "models": records}
    a.out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(a.out / "results_ep2.json", json.dumps(result, indent=1, default=str) + "\n")
    write_text_atomic(a.out / "results_ep2.md", markdown(result))
    print(json.dumps(result["counts"]))


if __name__ == "__main__":
    main()
