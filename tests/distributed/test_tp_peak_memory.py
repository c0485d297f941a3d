"""A tensor-parallel step's measured peak memory against the plan's (gloo, spawned processes).

The contract (issue 34, item 6): a tp rank's predicted peak is never below its measured one.
What broke it on CPU was the meter, not the model: gloo marks a collective complete before its
worker thread drops the tensors the collective was handed, so a tp op's buffer freed right
after (the all-gathered logits' parts, the head's logits slice, an all-reduced activation
consumed at once) could be freed last by that thread, which torch's profiler does not record;
the CPU meter then counted the block as held to the end of the step, on whichever rank lost
the race (up to the whole logits and their slice over, 1.2 MiB above the prediction on
``train_3d.py --tp 2 --dp 2``). The tp ops now wait for gloo to let go before they return.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from autopart.core.plan import Plan
from tests.distributed.rank_exit import end_rank

ROWS, WIDTH = 64, 1024  # one collective's tensor: 256 KiB of float32
REPEATS = 30


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _collective_peaks(rank: int, world: int, port: int,
                      out: dict[int, tuple[int, int, list[bool]]]) -> None:
    import autopart.codegen  # noqa: F401  (registers torch.ops.autopart.tp_*)
    from autopart.core.memory import allocated_peak_bytes

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    group = dist.group.WORLD.group_name
    x = torch.randn(ROWS, WIDTH, requires_grad=True)
    ops = torch.ops.autopart

    def once() -> None:
        # every result dropped as soon as it is read: the race the ops must not lose
        y = x + ops.tp_reduce(x * 2, group)                      # (ROWS, WIDTH)
        y = y + ops.tp_copy(x * 2, group)                        # backward all-reduces
        z = ops.tp_gather(x * 3, 1, rank, world, group)          # (ROWS, WIDTH * world)
        # sequence parallelism's: reduce-scatter / all-gather of the rows, and back
        t = ops.tp_reduce_scatter(x * 2, 0, 1, world, group)     # (ROWS / world, WIDTH)
        w = ops.tp_seq_gather_split(t, 0, 1, world, group)       # (ROWS, WIDTH)
        v = ops.tp_seq_gather(ops.tp_seq_scatter(x * 3, 0, 1, rank, world, group), 0, 1,
                              rank, world, group)
        # context parallelism's Ulysses exchange (its all-gather form uses the gather above)
        a = ops.all_to_all((x * 2).view(world, ROWS // world, WIDTH), group)
        (y.sum() + z.sum() + w.sum() + v.sum() + a.sum()).backward()
        x.grad = None

    once()  # warm-up: first-use allocations
    # one round's peak: the least of 5 (before the fix a single round could lose a free too)
    one = min(allocated_peak_bytes(once, torch.device("cpu"))[1] for _ in range(5))
    _, many = allocated_peak_bytes(lambda: [once() for _ in range(REPEATS)],
                                   torch.device("cpu"))
    # the all-to-all's values and gradient, through gloo's all-to-all and, on the meter's
    # steps, through an all-reduce: both as torch.distributed's all_to_all_single gives them
    parts = torch.arange(world * 3 * 4, dtype=torch.float32).view(world, 3, 4) + 100 * rank
    expected = torch.empty_like(parts)
    dist.all_to_all_single(expected, parts)

    def exchanged() -> tuple[torch.Tensor, torch.Tensor]:
        p = parts.clone().requires_grad_()
        got = ops.all_to_all(p, group)
        (got * (rank + 1)).sum().backward()  # part j went to rank j, which scales it by j + 1
        assert p.grad is not None
        return got.detach(), p.grad

    grad = torch.arange(1, world + 1, dtype=torch.float32).view(world, 1, 1).expand(world, 3, 4)
    exact = [torch.equal(got, expected) and torch.equal(g, grad)
             for got, g in (exchanged(), allocated_peak_bytes(exchanged, torch.device("cpu"))[0])]
    out[rank] = (one, many, exact)
    end_rank()


def test_tp_collectives_leave_no_buffer_for_gloos_thread_to_free() -> None:
    """30 rounds of tp_reduce, tp_copy (forward and backward), tp_gather, sequence
    parallelism's four ops and the all-to-all hold about what one round holds at their peak:
    blocks the meter saw allocated are seen freed. Before the fix, 30 rounds came out 5-8
    MiB (20-30 lost blocks of 256-512 KiB) above one round, on every run (sequence
    parallelism's ops through gloo's own reduce-scatter and all-gather: 5.9 MiB over); after
    it, equal or one block above on a quiet machine (the CPU meter's own noise: a rare lost
    or misordered record), and 4 blocks above once in a CI run on a loaded machine
    (2026-12-03: 1.0 MiB), hence a slack of 8 blocks, under half of the 20 the fix removed.
    The all-to-all's values and gradient equal torch.distributed's ``all_to_all_single``'s,
    through gloo's all-to-all and through the all-reduce it runs as on the meter's steps."""
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_collective_peaks, args=(2, _free_port(), out), nprocs=2, join=True)
        peaks = dict(out)
    for rank, (one, many, exact) in sorted(peaks.items()):
        assert exact == [True, True], (rank, "all_to_all plain, metered", exact)
        assert one > 0, (rank, one)
        # one collective's tensor is the smallest buffer a lost free would leave behind
        assert many < one + 8 * ROWS * WIDTH * 4, (rank, one, many)


#: GPT-2-like (tied wte / lm_head: a vocab-parallel head whose logits tp_gather all-gathers),
#: built by autopart.apps.bench.load_workload (random weights, dropout off, next-token loss)
WORKLOAD = "hf:GPT2LMHeadModel"
CONFIG = {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 2048, "n_positions": 32,
          "batch": 8, "seq": 32}


def _tp2_plan(sequence_parallel: bool = False) -> Plan:
    """tp = 2 on 2 ranks (pp = dp = 1), 1F1B over 2 microbatches: the layout search's costing
    of that fixed layout (no cut searched) on a profile for the distributed runtime, with
    Megatron's sequence parallelism where asked."""
    from autopart.apps.bench import load_workload
    from autopart.layout_planning import layout_request, model_heads
    from autopart.options import CompileOptions
    from autopart.planning import profile_model
    from autopart.solver.layout_search import evaluate_layout, layout_candidates

    model, args, target, loss_fn = load_workload(WORKLOAD, dict(CONFIG))
    profile = profile_model(model, args, devices=["cpu", "cpu"], num_microbatches=2,
                            loss_fn=loss_fn, example_target=target, backend="distributed",
                            split_cost=False, low_batch=False, cache=False)
    spec = profile.cluster().devices[0]
    options = profile.options(schedule_kind="1f1b", num_microbatches=2, stages_per_rank=1,
                              recompute=False, optimizer_state_bytes_per_param_byte=2.0)
    layout = layout_request(CompileOptions(tp=2, dp=1, zero_stage=0,
                                           sequence_parallel=sequence_parallel), 2, spec,
                            model_heads(model))
    cand = next(c for c in layout_candidates(profile.costs, spec, options, layout)
                if (c.tp, c.pp, c.dp) == (2, 1, 1))
    plan = evaluate_layout(profile.costs, spec, options, layout, cand, positions=())
    return dataclasses.replace(
        plan, ranks=tuple(dataclasses.replace(r, device="cpu") for r in plan.ranks),
        stages=tuple(dataclasses.replace(s, device="cpu") for s in plan.stages))


def _step_peaks(rank: int, world: int, port: int, plan_paths: list[str],
                out: dict[tuple[int, int], int]) -> None:
    import autopart
    from autopart.apps.bench import load_workload

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    for k, plan_path in enumerate(plan_paths):
        model, args, target, loss_fn = load_workload(WORKLOAD, dict(CONFIG))
        pipe = autopart.compile(model, args, loss_fn=loss_fn, plan=plan_path,
                                backend="distributed")
        opt = torch.optim.AdamW(pipe.parameters(), lr=1e-5)
        pipe.train_step(*args, target=target)  # AdamW's state exists after one step
        opt.step()
        opt.zero_grad()
        pipe.train_step(*args, target=target, measure_memory=True, optimizer=opt)
        peak = pipe.last_peak_memory_bytes
        assert peak is not None
        out[(rank, k)] = peak.by_device["cpu"]  # this tp rank's own figure
        if k < len(plan_paths) - 1:
            pipe.close()
    end_rank(pipe)


def test_tp2_predicted_peak_is_never_under_either_tp_ranks_measured_one(
        tmp_path: Path) -> None:
    """Each tp rank of the stage, measured with AdamW's state held, is at or under the plan's
    peak for its pipeline rank (before the fix, the rank that lost gloo's race showed up to
    the logits and their slice more; the margin above is then the model's: about 10 %), with
    and without sequence parallelism, whose peaks are the lower ones."""
    pytest.importorskip("transformers")
    plans = [_tp2_plan(), _tp2_plan(sequence_parallel=True)]
    paths = []
    for k, plan in enumerate(plans):
        assert (plan.tp, len(plan.ranks), plan.dp, plan.sequence_parallel) == (2, 1, 1, k == 1)
        plan.save(tmp_path / f"plan{k}.json")
        paths.append(str(tmp_path / f"plan{k}.json"))
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_step_peaks, args=(2, _free_port(), paths, out), nprocs=2, join=True)
        measured = dict(out)
    assert sorted(measured) == [(r, k) for r in range(2) for k in range(2)]
    predicted = [plan.ranks[0].peak_memory_bytes for plan in plans]
    for (rank, k), got in measured.items():
        assert got <= predicted[k], (rank, k, predicted[k], got)
    # sequence parallelism halves the norms' and residuals' activations: predicted and
    # measured lower (2026-11-29: 7.893 vs 7.911 MB predicted, 7.059 vs 7.141 MB measured)
    assert predicted[1] < predicted[0]
    for rank in range(2):
        assert measured[(rank, 1)] < measured[(rank, 0)], measured
