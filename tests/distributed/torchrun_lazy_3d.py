"""Run under torchrun (2 ranks): a lazy compile with tp=2 plans at the first step; an optimizer
built on pipe.parameters() before it holds the model's tensors, not this rank's slices, so
the first step refuses to train, and an optimizer built after it trains the slices."""

import os
import sys

sys.path.insert(0, os.getcwd())

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import autopart  # noqa: E402
from autopart.core.errors import PlanError  # noqa: E402
from tests.distributed.rank_exit import end_rank  # noqa: E402
from tests.distributed.tp_worker import tiny  # noqa: E402

torch.set_num_threads(1)
model, _, _, loss_fn = tiny("gpt2")
x, y = torch.randint(0, 64, (8, 8)), torch.randint(0, 64, (8, 8))
pipe = autopart.compile(model, loss_fn=loss_fn, tp=2, num_microbatches=2, time_limit_s=2.0)
early = torch.optim.AdamW(pipe.parameters(), lr=1e-3)  # the model's own tensors
try:
    pipe.train_step(x, target=y)
    raise AssertionError("a step with an optimizer over the model's tensors was not refused")
except PlanError as exc:
    assert "tensor-parallel slices" in str(exc) and "after the first" in str(exc), exc
assert pipe.plan.tp == 2
opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3)  # now this rank's slices
shapes = {n: tuple(p.shape) for n, p in pipe.named_parameters()}
assert shapes["transformer.h.0.attn.c_attn.weight"] == (32, 48), shapes  # 96 / tp columns
loss = pipe.train_step(x, target=y)
opt.step()
print(f"rank {dist.get_rank()} lazy tp ok loss {float(loss):.6f}", flush=True)
end_rank()
