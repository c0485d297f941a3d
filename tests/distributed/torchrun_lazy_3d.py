"""Run under torchrun (2 ranks): a lazy compile with tp=2 plans at the first step; an optimizer
built on pipe.parameters() before it holds the model's tensors, not this rank's slices, so
the first step refuses to train, and an optimizer built after it trains the slices; a longer
sequence then runs on the same slices (its peaks predicted), each step's loss the plain
model's under the same AdamW steps; a ZeRO-1 lazy pipeline refuses a second shape."""

import copy
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
reference = copy.deepcopy(model)
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
ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
shapes = {n: tuple(p.shape) for n, p in pipe.named_parameters()}
assert shapes["transformer.h.0.attn.c_attn.weight"] == (32, 48), shapes  # 96 / tp columns
x16, y16 = torch.randint(0, 64, (8, 16)), torch.randint(0, 64, (8, 16))
for inputs, target in ((x, y), (x16, y16), (x, y)):
    # a longer sequence runs on stages holding the same slices: the optimizer's step on the
    # first shape's gradients reaches it, and its gradients reach the optimizer
    opt.zero_grad()
    ref_opt.zero_grad()
    loss = pipe.train_step(inputs, target=target)
    ref_loss = loss_fn(reference(inputs), target)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=4e-5)
    assert {id(p) for p in pipe.parameters()} == {id(p) for g in opt.param_groups
                                                  for p in g["params"]}
    opt.step()
    ref_opt.step()
# the longer sequence's peaks were priced for the tp layout (every rank alike)
(peaks,) = pipe.peaks_bytes.values()
assert all(n > p for n, p in zip(peaks.bytes, peaks.planned_bytes, strict=True)), peaks
# ZeRO-1's FSDP2 units cannot be shared by a second pipeline: another shape is refused
zero = autopart.compile(tiny("gpt2")[0], loss_fn=loss_fn, dp=2, zero_stage=1,
                        num_microbatches=2, time_limit_s=2.0)
zero.train_step(x, target=y)
try:
    zero.train_step(x16, target=y16)
    raise AssertionError("a new shape under ZeRO-1 was not refused")
except PlanError as exc:
    assert "ZeRO-1 shards the parameters over dp" in str(exc) and "Pad or bucket" in str(exc), exc
assert len(zero.pipelines) == 1
print(f"rank {dist.get_rank()} lazy tp ok loss {float(loss):.6f}", flush=True)
end_rank()
