"""Run under torchrun (8 ranks): tp 2 x pp 2 x dp 2 with ZeRO-1 and ZeRO-3 on a tiny GPT-2.
The global loss equals the unpartitioned model's, and every parameter's gradient too: after
one SGD step of learning rate 1 the whole state dict is the plain model's after the same
step (float32, rtol 1e-5, atol 4e-5); a step under bf16 autocast gives the plain model's
autocast loss within bf16's rounding; clip_grad_norm_ is the plain model's norm."""

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
from tests.distributed.tp_worker import tiny, tp_plan  # noqa: E402

torch.set_num_threads(1)
model, _, _, loss_fn = tiny("gpt2")
gen = torch.Generator().manual_seed(2)
x = torch.randint(0, 64, (8, 8), generator=gen)
y = torch.randint(0, 64, (8, 8), generator=gen)

plain = copy.deepcopy(model)
want_loss = loss_fn(plain(x), y)
want_loss.backward()
want_norm = torch.nn.utils.get_total_norm([p.grad for p in plain.parameters()])
torch.optim.SGD(plain.parameters(), lr=1.0).step()
want_state = plain.state_dict()
with torch.autocast("cpu", dtype=torch.bfloat16):
    want_bf16 = float(loss_fn(copy.deepcopy(model)(x), y))

captured = capture(model, (x[:2],))
for zero in (1, 3):
    plan = dataclasses.replace(tp_plan("gpt2", captured, 2, 2, 8), dp=2, zero_stage=zero)
    pipe = autopart.compile(copy.deepcopy(model), (x,), loss_fn=loss_fn, plan=plan)
    assert (plan.tp, len(plan.ranks), plan.dp) == (2, 2, 2)
    loss = pipe.train_step(x, target=y)  # the global batch's on every rank
    torch.testing.assert_close(loss, want_loss.detach(), rtol=1e-5, atol=4e-5)
    norm = pipe.clip_grad_norm_(1e9)  # the norm, nothing clipped
    torch.testing.assert_close(norm, want_norm, rtol=1e-5, atol=4e-5)
    torch.optim.SGD(pipe.parameters(), lr=1.0).step()
    got = pipe.state_dict()  # whole tensors of this rank's stages
    assert got, "this rank holds nothing"
    for fqn, t in got.items():
        key = fqn if fqn in want_state else "lm_head.weight"
        torch.testing.assert_close(t, want_state[key], rtol=1e-5, atol=4e-5, msg=fqn)
    pipe.load_state_dict(model.state_dict(), strict=False)  # back to the initial weights
    for p in pipe.parameters():
        p.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = pipe.train_step(x, target=y).detach().float()
    assert abs(float(loss) - want_bf16) <= 2e-2 * abs(want_bf16), (float(loss), want_bf16)
    print(f"rank {dist.get_rank()} zero{zero} ok loss {float(loss):.6f} "
          f"tensors {len(got)}", flush=True)
    pipe.close()
end_rank()
