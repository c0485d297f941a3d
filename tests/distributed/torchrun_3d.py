"""Run under torchrun (4 ranks, no init_process_group): ``autopart.compile`` replays a
pp 2 x dp 2 plan (the (pp, dp, tp) mesh built from it), then plans one itself with dp=2
fixed; every rank passes the global batch. Loss, output and this rank's gradients against
the unpartitioned model (float32, rtol 1e-5, atol 4e-5)."""

import copy
import dataclasses
import os
import sys

sys.path.insert(0, os.getcwd())

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import autopart  # noqa: E402
from autopart.core.capture import capture  # noqa: E402
from tests.distributed.rank_exit import end_rank  # noqa: E402
from tests.plans import even_positions, manual_plan  # noqa: E402
from tests.zoo import ZOO  # noqa: E402

torch.set_num_threads(1)
model, (x,), y, loss_fn = ZOO["gpt2"]()  # batch 8, the same weights and data on every rank
model = model.eval()  # dropout is off in its config; eval() says so
reference = copy.deepcopy(model)
out = reference(x)
full = loss_fn(out, y)
full.backward()  # the global batch's gradients: what dp's average of the halves gives
grads = {n: p.grad for n, p in reference.named_parameters()}


def check(pipe: autopart.DistributedPipeline, label: str) -> None:
    plan = pipe.plan
    assert (plan.tp, len(plan.ranks), plan.dp) == (1, 2, 2), (plan.tp, plan.ranks, plan.dp)
    dp_rank = dist.get_rank(pipe.dp_group)
    assert dist.get_world_size(pipe.dp_group) == 2 and dist.get_world_size(pipe.pp_group) == 2
    rows = slice(4 * dp_rank, 4 * dp_rank + 4)
    loss = pipe.train_step(x, target=y)  # the global batch: this replica keeps its rows
    torch.testing.assert_close(loss, full.detach(), rtol=1e-5, atol=4e-5)  # the batch's loss
    held = dict(pipe.named_parameters())
    assert held, "this rank holds no parameters"
    for name, p in held.items():
        torch.testing.assert_close(p.grad, grads[name], rtol=1e-5, atol=4e-5, msg=name)
    with torch.no_grad():
        torch.testing.assert_close(pipe(x).logits, out.logits[rows].detach(), rtol=1e-5,
                                   atol=4e-5)
    print(f"rank {dist.get_rank()} {label} ok loss {float(loss):.6f} params {len(held)} "
          f"dp_rank {dp_rank}", flush=True)


# 1. replay: a hand-made pp 2 x dp 2 plan (global batch 8: 4 rows a replica, m = 2)
captured = capture(model, (x[:2],))
plan = dataclasses.replace(manual_plan(captured, even_positions(captured, 2), 2, 8,
                                       schedule_kind="1f1b"), dp=2)
pipe = autopart.compile(model, (x,), loss_fn=loss_fn, plan=plan)
check(pipe, "replay")
pipe.close()

# 2. chosen: tp=1 and dp=2 fixed, so pp = 4 / 2; rank 0 profiles and solves, the others wait
for p in model.parameters():
    p.grad = None
pipe = autopart.compile(model, (x,), loss_fn=loss_fn, example_target=y, tp=1, dp=2, zero_stage=0,
                        num_microbatches=2, schedule_kind="1f1b", time_limit_s=2.0)
check(pipe, "chosen")
pipe.close()
end_rank()
