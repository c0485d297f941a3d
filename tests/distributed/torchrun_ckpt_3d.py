"""Run under torchrun (4 ranks): a checkpoint of a tp 2 x pp 2 pipeline loads into a
pp 2 x dp 2 ZeRO-3 pipeline, whose checkpoint loads into a tp 2 x dp 2 ZeRO-1 pipeline and
into the plain model; AdamW training continues the unpartitioned run's loss curve through
every change of layout (float32, rtol 1e-5)."""

import copy
import dataclasses
import os
import sys
import tempfile

sys.path.insert(0, os.getcwd())

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import autopart  # noqa: E402
from autopart.core.capture import capture  # noqa: E402
from tests.distributed.rank_exit import end_rank  # noqa: E402
from tests.distributed.tp_worker import tiny, tp_plan  # noqa: E402

torch.set_num_threads(1)
LR = 1e-2
model, _, _, loss_fn = tiny("gpt2")  # the same weights on every rank
gen = torch.Generator().manual_seed(1)
batches = [(torch.randint(0, 64, (8, 8), generator=gen), torch.randint(0, 64, (8, 8),
                                                                         generator=gen))
           for _ in range(5)]  # global batch 8
x0 = batches[0][0]

# the unpartitioned run: the loss of each of 5 AdamW steps
plain = copy.deepcopy(model)
opt = torch.optim.AdamW(plain.parameters(), lr=LR)
curve = []
for x, y in batches:
    loss = loss_fn(plain(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    curve.append(float(loss))


def train(pipe: autopart.DistributedPipeline, opt: torch.optim.Optimizer, steps: range,
          label: str) -> None:
    for k in steps:
        x, y = batches[k]
        got = float(pipe.train_step(x, target=y))  # the global batch's loss, every rank
        opt.step()
        opt.zero_grad()
        assert abs(got - curve[k]) <= 1e-5 * abs(curve[k]) + 4e-5, (label, k, got, curve[k])
        print(f"rank {dist.get_rank()} {label} step {k} ok loss {got:.6f}", flush=True)


captured = capture(model, (x0[:4],))
tp_pp = tp_plan("gpt2", captured, 2, 2, 8)  # tp 2 x pp 2, m = 2
pp_dp = dataclasses.replace(tp_plan("gpt2", captured, 2, 2, 8), tp=1, sharded_parameters=(),
                            dp=2, zero_stage=3)  # 4 rows a replica, m = 2
tp_dp = dataclasses.replace(tp_plan("gpt2", captured, 1, 1, 8), dp=2, zero_stage=1)
dist.init_process_group("gloo")  # compile would, at its first call; the folder is needed first
root = [tempfile.mkdtemp(prefix="ckpt3d-") if dist.get_rank() == 0 else None]
dist.broadcast_object_list(root, src=0)
ckpt = os.path.join(root[0], "ckpt")


def run(plan, steps: range, label: str, *, resume: bool, save: bool) -> None:
    """A pipeline of ``plan`` (resumed from the checkpoint, which must hold step
    ``steps.start``), trained over ``steps``, then saved with its optimizer."""
    pipe = autopart.compile(copy.deepcopy(model), (x0,), loss_fn=loss_fn, plan=plan)
    opt = torch.optim.AdamW(pipe.parameters(), lr=LR)
    if resume:
        autopart.load(ckpt, pipe, optimizer=opt)
        assert autopart.checkpoint_extra(ckpt) == {"step": steps.start}
    train(pipe, opt, steps, label)
    if save:
        pipe.save(ckpt, optimizer=opt, extra={"step": steps.stop})
    pipe.close()


run(tp_pp, range(0, 2), "tp2xpp2", resume=False, save=True)  # 1. tp 2 x pp 2
run(pp_dp, range(2, 3), "pp2xdp2-zero3", resume=True, save=True)  # 2. ZeRO-3 DTensor shards
run(tp_dp, range(3, 5), "tp2xdp2-zero1", resume=True, save=False)  # 3. tp slices over dp

# 4. the plain model (rank 0 alone): the ZeRO-3 checkpoint, then steps 4 and 5
if dist.get_rank() == 0:
    mine = copy.deepcopy(model)
    opt = torch.optim.AdamW(mine.parameters(), lr=LR)
    autopart.load(ckpt, mine, optimizer=opt)
    for k in range(3, 5):
        x, y = batches[k]
        loss = loss_fn(mine(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        assert abs(float(loss) - curve[k]) <= 1e-5 * abs(curve[k]) + 4e-5, (k, float(loss))
        print(f"rank 0 plain step {k} ok loss {float(loss):.6f}", flush=True)
dist.barrier()
end_rank()
