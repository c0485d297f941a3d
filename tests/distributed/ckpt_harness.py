"""What the checkpoint-across-layouts scripts share (run under torchrun): the unpartitioned
AdamW loss curve, pipelines of each layout trained over some of its steps (resumed from and
saved to one checkpoint), and the plain model resuming from it."""

from __future__ import annotations

import copy
import os
import tempfile
from typing import Any

import torch
import torch.distributed as dist

import autopart


class LayoutResume:
    """One model's run through several layouts, each step's loss held against the plain run.

    Args:
        model: the model (the same weights on every rank).
        loss_fn: ``(output, target) -> loss``.
        batches: ``(x, y)`` global batches, one per step.
        lr: AdamW's learning rate.

    Attributes:
        curve: the unpartitioned run's loss at each step.
        ckpt: the checkpoint folder, the same on every rank (made on rank 0).
    """

    def __init__(self, model: torch.nn.Module, loss_fn: Any,
                 batches: list[tuple[torch.Tensor, torch.Tensor]], lr: float) -> None:
        self.model, self.loss_fn, self.batches, self.lr = model, loss_fn, batches, lr
        plain = copy.deepcopy(model)
        opt = torch.optim.AdamW(plain.parameters(), lr=lr)
        self.curve: list[float] = []
        for x, y in batches:
            loss = loss_fn(plain(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            self.curve.append(float(loss))
        dist.init_process_group("gloo")  # compile would at its first call; the folder first
        root = [tempfile.mkdtemp(prefix="ckpt-") if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(root, src=0)
        self.ckpt = os.path.join(root[0], "ckpt")

    def _check(self, k: int, got: float, label: str) -> None:
        want = self.curve[k]
        assert abs(got - want) <= 1e-5 * abs(want) + 4e-5, (label, k, got, want)

    def run(self, plan: Any, steps: range, label: str, *, resume: bool, save: bool) -> None:
        """A pipeline of ``plan`` (resumed from the checkpoint, which must hold step
        ``steps.start``), trained over ``steps`` (printing ``rank <r> <label> step <k> ok``),
        then saved with its optimizer."""
        pipe = autopart.compile(copy.deepcopy(self.model), (self.batches[0][0],),
                                loss_fn=self.loss_fn, plan=plan)
        opt = torch.optim.AdamW(pipe.parameters(), lr=self.lr)
        if resume:
            autopart.load(self.ckpt, pipe, optimizer=opt)
            assert autopart.checkpoint_extra(self.ckpt) == {"step": steps.start}
        for k in steps:
            x, y = self.batches[k]
            got = float(pipe.train_step(x, target=y))  # the global batch's loss, every rank
            opt.step()
            opt.zero_grad()
            self._check(k, got, label)
            print(f"rank {dist.get_rank()} {label} step {k} ok loss {got:.6f}", flush=True)
        if save:
            pipe.save(self.ckpt, optimizer=opt, extra={"step": steps.stop})
        pipe.close()

    def plain(self, steps: range) -> None:
        """Rank 0 alone: the plain model resumed from the checkpoint, trained over ``steps``
        (printing ``rank 0 plain step <k> ok``); every rank then meets at a barrier."""
        if dist.get_rank() == 0:
            mine = copy.deepcopy(self.model)
            opt = torch.optim.AdamW(mine.parameters(), lr=self.lr)
            autopart.load(self.ckpt, mine, optimizer=opt)
            for k in steps:
                x, y = self.batches[k]
                loss = self.loss_fn(mine(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                self._check(k, float(loss), "plain")
                print(f"rank 0 plain step {k} ok loss {float(loss):.6f}", flush=True)
        dist.barrier()
