"""One-process pipeline step issued from one host thread against one thread per rank.

The same compiled pipeline (a GPT-2, one fixed plan: 1F1B, m microbatches, its stages on
``--devices``) runs training steps with ``pipe.issue_threads = 1`` (the caller's thread
issues every stage's work) and ``pipe.issue_threads = None`` (a worker thread per rank,
torchgpipe's scheme), alternating step by step so that drift in the machine's load hits both
alike. On CUDA the same plan also runs with ``cuda_graphs=True`` (one eager step, then
replays), with each issuing setting; on the CPU, one thread with one intra-op thread too.
Each round is the median of ``--steps`` steps per setting; ``--rounds`` rounds. The
losses of the two settings are compared every step (the same kernels on the same values).
The load average is printed before and after (on a shared CPU it says how far to trust the
figures).

    .venv/bin/python benchmarks/gpu/issue_threads.py --devices cpu,cpu          # CPU: small GPT-2
    .venv/bin/python benchmarks/gpu/issue_threads.py --devices cuda:0,cuda:0,cuda:0,cuda:0 --big

On the CPU each worker runs ``torch.get_num_threads() // workers`` intra-op threads (at least
1; the caller's count is restored after each step), so two CPU stages share the cores instead
of each starting a team of every core. Writes ``issue_threads.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def _sync(devices: list[str]) -> None:
    for d in set(devices):
        if torch.device(d).type == "cuda":
            torch.cuda.synchronize(d)


def run(devices: list[str], big: bool, m: int, steps: int, rounds: int,
        schedule: str) -> dict[str, Any]:
    """Time ``rounds`` x ``steps`` alternating steps of each issuing setting."""
    from transformers import GPT2Config, GPT2LMHeadModel

    import autopart
    from autopart.apps.demo import gpt2_loss

    torch.manual_seed(0)
    if big:  # fidelity_gpu.py's model: 12 x 768, vocab 32768, batch 32 x 256
        layers, hidden, vocab, batch, seq = 12, 768, 32768, 32, 256
    else:  # small enough for a 2-core CPU
        layers, hidden, vocab, batch, seq = 4, 256, 8192, 8, 128
    config = GPT2Config(n_layer=layers, n_embd=hidden, n_head=hidden // 64, vocab_size=vocab,
                        n_positions=seq, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        use_cache=False, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config).to(devices[0]).train()
    tokens = torch.randint(0, vocab, (batch, seq), device=devices[0])  # (batch, seq)
    t0 = time.perf_counter()
    plan, profile = autopart.plan_model(copy.deepcopy(model), (tokens,), loss_fn=gpt2_loss,
                                        example_target=tokens, devices=devices,
                                        num_microbatches=m, schedule_kind=schedule)
    pipe = autopart.compile(copy.deepcopy(model), (tokens,), loss_fn=gpt2_loss, plan=plan)
    compile_s = time.perf_counter() - t0
    caller = torch.get_num_threads()
    # name -> (pipeline, pipe.issue_threads, torch.set_num_threads of the caller in the step)
    settings: dict[str, tuple[Any, int | None, int]] = {
        "one_thread": (pipe, 1, caller), "thread_per_rank": (pipe, None, caller)}
    if torch.device(devices[0]).type == "cpu" and caller > 1:
        # one thread with as many intra-op threads as each worker gets: which of the two
        # changes (overlap of stages, or smaller OpenMP teams) the difference comes from
        settings["one_thread_1_intra_op"] = (pipe, 1, max(1, caller // len(devices)))
    graphed = None
    if torch.device(devices[0]).type == "cuda":  # the same plan, replayed as CUDA graphs
        graphed = autopart.compile(copy.deepcopy(model), (tokens,), loss_fn=gpt2_loss,
                                   devices=devices, plan=pipe.plan, cuda_graphs=True)
        settings["graphs_one_thread"] = (graphed, 1, caller)
        settings["graphs_thread_per_rank"] = (graphed, None, caller)
    # what the cost model predicts for each setting: the same plan priced for its issuing
    # threads and for graphs (RuntimeDescription.issue_threads, .cuda_graphs)
    from autopart.trace import predict

    predicted = {}
    for name, (_, threads, _) in settings.items():
        runtime = dataclasses.replace(profile.runtime, issue_threads=threads,
                                      cuda_graphs=name.startswith("graphs"))
        predicted[name] = predict(dataclasses.replace(profile, runtime=runtime),
                                  plan).step_time_us / 1e6
    times: dict[str, list[float]] = {name: [] for name in settings}
    medians: dict[str, list[float]] = {name: [] for name in settings}
    max_diff = 0.0
    load_before = os.getloadavg()
    for r in range(rounds):
        per_round: dict[str, list[float]] = {name: [] for name in settings}
        for i in range(steps + 1):  # one warm-up step per round
            losses = {}
            order = list(settings.items()) if i % 2 == 0 else list(settings.items())[::-1]
            for name, (p, threads, intra_op) in order:
                p.issue_threads = threads
                p.zero_grad(set_to_none=True)
                torch.set_num_threads(intra_op)
                _sync(devices)
                t = time.perf_counter()
                losses[name] = float(p.train_step(tokens, target=tokens))
                _sync(devices)
                torch.set_num_threads(caller)
                if i > 0:
                    per_round[name].append(time.perf_counter() - t)
            max_diff = max(max_diff, *(abs(v - losses["one_thread"]) for v in losses.values()))
        for name in settings:
            times[name] += per_round[name]
            medians[name].append(statistics.median(per_round[name]))
        print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.4f} s" for k, v in medians.items())
              + f" (load {os.getloadavg()[0]:.1f})", file=sys.stderr)
    load_after = os.getloadavg()
    one, per = statistics.median(times["one_thread"]), statistics.median(times["thread_per_rank"])
    paired = statistics.median(b / a for a, b in zip(times["one_thread"],
                                                     times["thread_per_rank"], strict=True))
    print(f"{schedule} m={m} on {devices}: one thread {one:.4f} s, thread per rank {per:.4f} s "
          f"({per / one - 1:+.1%}; paired {paired - 1:+.1%}); "
          + "".join(f"{k} {statistics.median(v):.4f} s; " for k, v in times.items()
                    if k not in ("one_thread", "thread_per_rank"))
          + f"max |loss diff| {max_diff:.1e}; load {load_before[0]:.1f} -> {load_after[0]:.1f}")
    print("predicted: " + ", ".join(
        f"{k} {v:.4f} s ({v / statistics.median(times[k]) - 1:+.1%})" for k, v in predicted.items()))
    return {
        "devices": devices, "schedule": schedule, "num_microbatches": m,
        "model": {"layers": layers, "hidden": hidden, "vocab": vocab, "batch": batch, "seq": seq},
        "torch": torch.__version__, "intra_op_threads_caller": torch.get_num_threads(),
        "cuts": [c.position for c in pipe.plan.cuts], "compile_s": round(compile_s, 1),
        "one_thread_s": round(one, 5), "thread_per_rank_s": round(per, 5),
        "medians_s": {k: round(statistics.median(v), 5) for k, v in times.items()},
        "predicted_s": {k: round(v, 5) for k, v in predicted.items()},
        "threaded_over_one": round(per / one - 1, 4), "paired": round(paired - 1, 4),
        "round_medians_s": {k: [round(x, 5) for x in v] for k, v in medians.items()},
        "max_abs_loss_diff": max_diff,
        "cuda_graph_reasons": None if graphed is None else {
            str(k): v for k, v in graphed.cuda_graph_reasons.items()},
        "loadavg_before": load_before, "loadavg_after": load_after,
        "device_name": (torch.cuda.get_device_name(devices[0])
                        if torch.device(devices[0]).type == "cuda" else f"{os.cpu_count()}-core CPU"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default="cpu,cpu", help="one device per rank")
    parser.add_argument("--big", action="store_true", help="fidelity_gpu.py's GPT-2 (GPU)")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None, help="folder for issue_threads.json")
    a = parser.parse_args()
    report = run(a.devices.split(","), a.big, a.microbatches, a.steps, a.rounds, a.schedule)
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "issue_threads.json").write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
