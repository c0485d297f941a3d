"""Worker processes for the fault tests of 3D plans: a rank of a tensor- or data-parallel
pipeline (tiny GPT-2, gloo, launched as separate processes) dies or hangs mid-step."""

from __future__ import annotations

import dataclasses
import datetime
import os
import sys
import time
from typing import Any

import torch.distributed as dist

#: what a killed victim exits with (no clean-up, no goodbye)
KILLED_EXIT_CODE = 17


def _pipeline(layout: str, world: int, step_timeout_s: float) -> tuple[Any, ...]:
    """This rank's pipeline of a fixed plan of tiny GPT-2 (global batch 4, m = 2):
    ``"tp"``: tp 2 x pp (world / 2), cut before the second layer; ``"zero<k>"``: pp 1 x dp 2
    under ZeRO-k. Built by ``autopart.compile`` (which builds the (pp, dp, tp) mesh)."""
    import autopart
    from autopart.core.capture import capture
    from tests.distributed.tp_worker import tiny, tp_plan
    from tests.plans import manual_plan

    model, args, target, loss_fn = tiny("gpt2")
    batch, m = args[0].shape[0], 2
    if layout == "tp":
        captured = capture(model, tuple(a[: batch // m] for a in args))
        plan = tp_plan("gpt2", captured, world // 2, m, batch)
    else:
        captured = capture(model, tuple(a[: batch // 2 // m] for a in args))
        plan = dataclasses.replace(manual_plan(captured, [], m, batch, schedule_kind="1f1b"),
                                   dp=2, zero_stage=int(layout.removeprefix("zero")))
    # the ranks meet before compile and before the first step, so that a short step timeout
    # governs only the step a test makes fail, never how far apart a busy machine started them
    dist.barrier()
    pipe = autopart.compile(model, args, loss_fn=loss_fn, plan=plan, backend="distributed",
                            step_timeout_s=step_timeout_s)
    dist.barrier()
    return pipe, args, target


def fails(rank: int, world: int, port: int, layout: str, victim: int, how: str,
          step_timeout_s: float) -> None:
    """Every rank trains a step; in the second, ``victim`` is killed (``how="dies"``: its
    process ends at once) or hangs (``"hangs"``: sleeps) when its first stage starts the
    forward of the second microbatch. The other ranks must fail the step with a
    ``PipelineFailure`` (printed on stderr as ``failure: ...``, then exit 3; any other error
    propagates); a step that succeeds exits 5. Survivors wait for one another before
    exiting (rank 0 serves the store the others diagnose through)."""
    sys.path.insert(0, os.getcwd())
    import autopart
    from tests.distributed.worker import _setup

    _setup(rank, world, port, 600)  # the default group's set-up is not what is timed
    pipe, args, target = _pipeline(layout, world, step_timeout_s)
    pipe.train_step(*args, target=target)
    if rank == victim:
        calls = [0]

        def fault(*_: Any) -> None:
            calls[0] += 1
            if calls[0] == 2:  # mid-step: the second microbatch's forward
                if how == "dies":
                    os._exit(KILLED_EXIT_CODE)
                time.sleep(3600)

        pipe.stages[0].register_forward_pre_hook(fault)
    try:
        pipe.train_step(*args, target=target)
    except autopart.PipelineFailure as exc:
        print(f"failure: {exc}", file=sys.stderr, flush=True)
        store = dist.distributed_c10d._get_default_store()
        store.set(f"test/failed/{rank}", "1")
        others = [f"test/failed/{r}" for r in range(world) if r not in (rank, victim)]
        try:
            store.wait(others, datetime.timedelta(seconds=120))
        except Exception:
            pass  # the store went away: its rank exited
        os._exit(3)
    os._exit(5)  # the step should not have succeeded


__all__: list[str] = ["fails", "KILLED_EXIT_CODE"]
