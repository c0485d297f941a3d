"""Done-when of training checkpoints: 3 steps on 2 ranks, saved with AdamW state, resumed on
2 ranks, in one process on a 3-stage plan and in the plain model: every path's 6 losses and
its optimizer state equal one unpartitioned 6-step run with the same clipping."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

import autopart
from autopart.core.capture import capture
from tests import training
from tests.distributed.test_multiprocess import _spawn
from tests.plans import even_positions, manual_plan
from tests.zoo import gpt2

TOL = {"rtol": 1e-5, "atol": 1e-6}


def _reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    """The unpartitioned run: 6 losses and the optimizer state after step 3."""
    model, _, _, loss_fn = gpt2()
    opt = training.adamw(model.named_parameters())
    step = training.plain_step(model, loss_fn)
    clip = lambda n: torch.nn.utils.clip_grad_norm_(model.parameters(), n)  # noqa: E731
    losses = training.train(step, clip, opt, range(3))
    state = training.optimizer_state(model.named_parameters(), opt)
    return losses + training.train(step, clip, opt, range(3, 6)), state


def _check_state(state: dict[str, torch.Tensor], ref: dict[str, torch.Tensor],
                 every: bool = True) -> None:
    assert state, "no optimizer state"
    if every:
        assert sorted(state) == sorted(ref)
    for key, value in state.items():
        # gradients of a partitioned run differ from the plain model's in the last bits
        # (another summation order), so the moments do: compare at rtol 1e-5 with an atol
        # of 1e-5 of the tensor's own scale (exp_avg_sq entries reach 1e-14)
        scale = float(ref[key].abs().max())
        torch.testing.assert_close(value, ref[key], rtol=1e-5, atol=1e-5 * scale,
                                   msg=lambda m, key=key: f"{key}: {m}")


def test_resume_on_two_ranks_in_one_process_on_three_stages_and_in_the_plain_model(
        tmp_path: Path) -> None:
    ref_losses, ref_state = _reference()
    root = tmp_path / "ckpt"
    with tempfile.TemporaryDirectory() as out:
        proc = _spawn("ckpt_train", 2, str(root), out, timeout=400)
        assert proc.returncode == 0, proc.stderr[-3000:]
        first = [float(x) for x in (Path(out) / "losses.txt").read_text().split()]
    torch.testing.assert_close(first, ref_losses[:3], **TOL)

    # (a) 2 ranks again
    with tempfile.TemporaryDirectory() as out:
        proc = _spawn("ckpt_resume", 2, str(root), out, timeout=400)
        assert proc.returncode == 0, proc.stderr[-3000:]
        later = [float(x) for x in (Path(out) / "losses.txt").read_text().split()]
        merged: dict[str, torch.Tensor] = {}
        for r in range(2):
            part = load_file(str(Path(out) / f"state{r}.safetensors"))
            _check_state(part, ref_state, every=False)
            merged.update(part)
    assert sorted(merged) == sorted(ref_state)  # together the ranks hold every entry
    torch.testing.assert_close(first + later, ref_losses, **TOL)

    # (b) one process, 3 stages
    model, args, _, loss_fn = gpt2()
    training.scrambled(model)
    captured = capture(model, tuple(a[:4] for a in args))
    plan = manual_plan(captured, even_positions(captured, 3), 2, 8, schedule_kind="gpipe")
    pipe = autopart.compile(model, args, loss_fn=loss_fn, plan=plan, devices=["cpu"] * 3)
    opt = training.adamw(pipe.named_parameters())
    assert autopart.load(root, pipe, optimizer=opt) is pipe
    _check_state(training.optimizer_state(pipe.named_parameters(), opt), ref_state)
    step = autopart.checkpoint_extra(root)["step"]
    later = training.train(lambda a, t: pipe.train_step(*a, target=t), pipe.clip_grad_norm_,
                           opt, range(step, step + 3))
    torch.testing.assert_close(first + later, ref_losses, **TOL)

    # (c) the plain model
    plain = training.scrambled(gpt2()[0])
    opt = training.adamw(plain.named_parameters())
    autopart.load(root, plain, optimizer=opt)
    _check_state(training.optimizer_state(plain.named_parameters(), opt), ref_state)
    later = training.train(training.plain_step(plain, loss_fn),
                           lambda n: torch.nn.utils.clip_grad_norm_(plain.parameters(), n),
                           opt, range(3, 6))
    torch.testing.assert_close(first + later, ref_losses, **TOL)



def test_an_async_save_on_two_ranks_holds_the_state_of_its_step(tmp_path: Path) -> None:
    model, _, _, loss_fn = gpt2()
    opt = training.adamw(model.named_parameters())
    training.train(training.plain_step(model, loss_fn),
                   lambda n: torch.nn.utils.clip_grad_norm_(model.parameters(), n), opt, range(3))
    with tempfile.TemporaryDirectory() as out:
        proc = _spawn("ckpt_train", 2, str(tmp_path / "ckpt"), out, True, timeout=400)
        assert proc.returncode == 0, proc.stderr[-3000:]
    plain = training.scrambled(gpt2()[0])
    popt = training.adamw(plain.named_parameters())
    autopart.load(tmp_path / "ckpt", plain, optimizer=popt)
    for (name, a), (_, b) in zip(model.named_parameters(), plain.named_parameters(), strict=True):
        torch.testing.assert_close(b, a, **TOL, msg=lambda m, name=name: f"{name}: {m}")
    _check_state(training.optimizer_state(plain.named_parameters(), popt),
                 training.optimizer_state(model.named_parameters(), opt))
