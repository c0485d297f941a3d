"""train_step(grad_scaler=...) on 2 gloo ranks (spawned processes, no mocks): an overflow on one
rank only skips the step on both and backs both scales off alike; a clean step afterwards
unscales, clips and steps like torch's AMP recipe on the plain model; GPT-2 under fp16
autocast matches the plain model run the same way."""

from __future__ import annotations

import copy
import datetime
import json
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tests.distributed.rank_exit import end_rank

ROOT = Path(__file__).resolve().parents[2]
SCALE = 2.0 ** 8
TOL = {"rtol": 1e-5, "atol": 4e-5}


def _setup(rank: int, world: int, port: int) -> None:
    sys.path.insert(0, os.getcwd())
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))


def worker(rank: int, world: int, port: int, result_dir: str) -> None:
    """Three steps of torch's AMP recipe on a 2-stage MLP pipeline: an inf made in the
    backward of rank 0's stage, then of rank 1's, then none; writes what this rank saw."""
    _setup(rank, world, port)
    import autopart
    from autopart.core.capture import capture
    from tests.plans import even_positions, manual_plan
    from tests.zoo import mlp

    model, args, target, loss_fn = mlp()
    reference = copy.deepcopy(model)
    captured = capture(model, tuple(a[:4] for a in args))
    plan = manual_plan(captured, even_positions(captured, world), 2, 8, schedule_kind="1f1b")
    pipe = autopart.compile(model, args, loss_fn=loss_fn, plan=plan, backend="distributed")
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    report: dict[str, object] = {"scales": [], "stepped": [], "problems": []}
    problems: list[str] = report["problems"]  # type: ignore[assignment]
    ref_loss = loss_fn(reference(*args), target)
    for victim in (0, 1, None):
        opt.zero_grad()
        before = {n: p.detach().clone() for n, p in pipe.named_parameters()}
        hook = None
        if victim == rank:  # an overflow in this rank's backward only
            first = next(iter(pipe.parameters()))
            hook = first.register_hook(lambda g: torch.full_like(g, float("inf")))
        loss = pipe.train_step(*args, target=target, grad_scaler=scaler)
        if hook is not None:
            hook.remove()
        try:
            torch.testing.assert_close(loss, ref_loss.detach(), **TOL)  # unscaled, finite
        except AssertionError as exc:
            problems.append(f"step {victim}: loss {exc}")
        scaler.unscale_(opt)
        norm = pipe.clip_grad_norm_(0.5)
        if victim is None:
            ref_loss.backward()
            ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
            ref = dict(reference.named_parameters())
            for name, p in pipe.named_parameters():
                try:
                    torch.testing.assert_close(p.grad, ref[name].grad, **TOL)
                except AssertionError as exc:
                    problems.append(f"{name}: {str(exc).splitlines()[0]}")
            try:
                torch.testing.assert_close(norm, ref_norm, **TOL)
            except AssertionError as exc:
                problems.append(f"norm: {str(exc).splitlines()[0]}")
        scaler.step(opt)
        scaler.update()
        report["scales"].append(scaler.get_scale())  # type: ignore[attr-defined]
        report["stepped"].append([not torch.equal(p, before[n])  # type: ignore[attr-defined]
                                  for n, p in pipe.named_parameters()])
    torch.optim.SGD(reference.parameters(), lr=0.1).step()  # the clean step, on the plain model
    ref = dict(reference.named_parameters())
    for name, p in pipe.named_parameters():
        try:
            torch.testing.assert_close(p, ref[name], **TOL)
        except AssertionError as exc:
            problems.append(f"{name} after the step: {str(exc).splitlines()[0]}")
    Path(result_dir, f"rank{rank}.json").write_text(json.dumps(report))
    end_rank(pipe)


def fp16_worker(rank: int, world: int, port: int, result_dir: str) -> None:
    """One step of GPT-2 on 2 ranks under fp16 autocast (float32 weights) with a GradScaler,
    and of the plain model run the same way; writes this rank's errors."""
    _setup(rank, world, port)
    import autopart
    from autopart.core.capture import capture
    from tests.plans import even_positions, manual_plan
    from tests.runtime.test_grad_scaler import FP16_GRAD_TOL, FP16_LOSS_TOL
    from tests.zoo import gpt2

    model, args, target, loss_fn = gpt2()
    reference = copy.deepcopy(model)
    captured = capture(model, tuple(a[:4] for a in args))
    plan = manual_plan(captured, even_positions(captured, world), 2, 8, schedule_kind="1f1b")
    pipe = autopart.compile(model, args, loss_fn=loss_fn, plan=plan, backend="distributed")
    scaler, ref_scaler = (torch.amp.GradScaler("cpu", init_scale=2.0 ** 12) for _ in range(2))
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = pipe.train_step(*args, target=target, grad_scaler=scaler)
        out = reference(*args)
        ref_loss = loss_fn(out, target)
    problems = [] if out.logits.dtype == torch.float16 else ["the reference did not run in fp16"]
    ref_scaler.scale(ref_loss).backward()
    ref_value = float(ref_loss.detach())
    if abs(float(loss) - ref_value) > FP16_LOSS_TOL * abs(ref_value):
        problems.append(f"loss {float(loss)} vs {ref_value}")
    scaler.unscale_(opt)
    ref_scaler.unscale_(ref_opt)
    ref = dict(reference.named_parameters())
    for name, p in pipe.named_parameters():
        err = float((p.grad - ref[name].grad).norm() / ref[name].grad.norm().clamp_min(1e-30))
        if not err <= FP16_GRAD_TOL:
            problems.append(f"{name}: relative gradient error {err:.2e}")
    scaler.step(opt)
    scaler.update()
    ref_scaler.step(ref_opt)
    ref_scaler.update()
    if scaler.get_scale() != ref_scaler.get_scale():
        problems.append(f"scale {scaler.get_scale()} vs {ref_scaler.get_scale()}")
    Path(result_dir, f"rank{rank}.json").write_text(json.dumps({"problems": problems}))
    end_rank(pipe)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawn(fn: str, world: int = 2) -> list[dict[str, Any]]:
    """Run ``fn`` of this module on ``world`` gloo ranks; each rank's JSON report."""
    with tempfile.TemporaryDirectory() as out:
        script = textwrap.dedent(f"""
            import sys
            sys.path.insert(0, {str(ROOT)!r})
            import torch.multiprocessing as mp
            from tests.runtime.test_grad_scaler_dist import {fn}
            if __name__ == "__main__":
                mp.spawn({fn}, args=({world}, {_free_port()}, {out!r}), nprocs={world})
        """)
        proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                              text=True, timeout=240)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]


def test_an_overflow_on_one_rank_skips_the_step_on_both() -> None:
    reports = _spawn("worker")
    for rank, report in enumerate(reports):
        assert report["problems"] == [], f"rank {rank}: {report['problems']}"
        # overflow on rank 0, then on rank 1: both skipped and backed off; then a clean step
        assert report["scales"] == [SCALE / 2, SCALE / 4, SCALE / 4], rank
        skipped_0, skipped_1, clean = report["stepped"]
        assert skipped_0 and not any(skipped_0) and not any(skipped_1), rank
        assert clean and all(clean), rank


def test_fp16_autocast_with_loss_scaling_matches_the_plain_model() -> None:
    for rank, report in enumerate(_spawn("fp16_worker")):
        assert report["problems"] == [], f"rank {rank}: {report['problems']}"
