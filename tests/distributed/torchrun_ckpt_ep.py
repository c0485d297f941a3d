"""Run under torchrun (4 ranks): a checkpoint of a tiny Mixtral trained with its experts split
over ep 4 (dp 4, one row per microbatch) loads into a pp 2 x dp 2 ep 2 pipeline, whose
checkpoint loads into a pp 2 x dp 2 pipeline without ep and into the plain model; AdamW
training continues the unpartitioned run's loss curve through every change of layout
(float32, rtol 1e-5)."""

import copy
import dataclasses
import os
import sys
import tempfile

sys.path.insert(0, os.getcwd())

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import autopart  # noqa: E402
from autopart.core.capture import capture, node_module_path, op_nodes  # noqa: E402
from tests.distributed.ep_worker import SECOND_LAYER, tiny_moe  # noqa: E402
from tests.distributed.rank_exit import end_rank  # noqa: E402
from tests.plans import manual_plan  # noqa: E402

torch.set_num_threads(1)
LR = 1e-2
model, _, _, loss_fn = tiny_moe("mixtral")  # the same weights on every rank
gen = torch.Generator().manual_seed(1)
batches = [(torch.randint(0, 64, (8, 8), generator=gen), torch.randint(0, 64, (8, 8),
                                                                         generator=gen))
           for _ in range(5)]  # global batch 8
x0 = batches[0][0]

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


captured = capture(model, (x0[:2],))
cut = next(k for k, n in enumerate(op_nodes(captured.graph_module.graph))
           if node_module_path(n).startswith(SECOND_LAYER))
dp4_ep4 = dataclasses.replace(manual_plan(captured, [], 2, 8, schedule_kind="1f1b"), dp=4, ep=4)
pp2_dp2_ep2 = dataclasses.replace(manual_plan(captured, [cut], 2, 8, schedule_kind="1f1b"),
                                  dp=2, ep=2)
pp2_dp2 = dataclasses.replace(pp2_dp2_ep2, ep=1)
dist.init_process_group("gloo")
root = [tempfile.mkdtemp(prefix="ckpt-ep-") if dist.get_rank() == 0 else None]
dist.broadcast_object_list(root, src=0)
ckpt = os.path.join(root[0], "ckpt")


def run(plan, steps: range, label: str, *, resume: bool, save: bool) -> None:
    pipe = autopart.compile(copy.deepcopy(model), (x0,), loss_fn=loss_fn, plan=plan)
    opt = torch.optim.AdamW(pipe.parameters(), lr=LR)
    if resume:
        autopart.load(ckpt, pipe, optimizer=opt)
        assert autopart.checkpoint_extra(ckpt) == {"step": steps.start}
    train(pipe, opt, steps, label)
    if save:
        pipe.save(ckpt, optimizer=opt, extra={"step": steps.stop})
    pipe.close()


run(dp4_ep4, range(0, 2), "dp4-ep4", resume=False, save=True)
run(pp2_dp2_ep2, range(2, 3), "pp2xdp2-ep2", resume=True, save=True)
run(pp2_dp2, range(3, 5), "pp2xdp2", resume=True, save=False)

if dist.get_rank() == 0:  # the plain model: the ep 2 checkpoint, then steps 4 and 5
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
