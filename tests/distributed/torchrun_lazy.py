"""Run under torchrun (2 ranks): the README's first example as written, on a tiny GPT-2, two
sequence lengths; loss and this rank's gradients against the unpartitioned model every step."""

import copy
import os
import sys

sys.path.insert(0, os.getcwd())

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

import autopart  # noqa: E402
from autopart.apps.demo import gpt2_loss as loss_fn  # noqa: E402
from tests.distributed.rank_exit import end_rank  # noqa: E402

torch.set_num_threads(1)
torch.manual_seed(0)  # every rank builds the same weights
model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128,
                                   n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
                                   attn_pdrop=0.0, use_cache=False, bos_token_id=0,
                                   eos_token_id=0))
reference = copy.deepcopy(model)

pipe = autopart.compile(model, loss_fn=loss_fn, optimize="memory")
opt = torch.optim.SGD(pipe.parameters(), lr=0.5)  # built before the first step
ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
ref_params = dict(reference.named_parameters())
for step, seq in enumerate([8, 16, 8]):
    x = torch.randint(0, 128, (4, seq), generator=torch.Generator().manual_seed(step))
    y = x
    opt.zero_grad()
    ref_opt.zero_grad()
    loss = pipe.train_step(x, target=y)
    ref_loss = loss_fn(reference(x), y)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=4e-5)
    held = dict(pipe.named_parameters())
    assert held, "this rank holds no parameters"
    for name, p in held.items():
        torch.testing.assert_close(p.grad, ref_params[name].grad, rtol=1e-5, atol=4e-5, msg=name)
    opt.step()
    ref_opt.step()
    print(f"rank {dist.get_rank()} step {step} seq {seq} ok loss {float(loss):.6f} "
          f"params {len(held)}", flush=True)
assert type(pipe.pipeline).__name__ == "DistributedPipeline" and len(pipe.pipelines) == 2
pipe.close()
end_rank()
