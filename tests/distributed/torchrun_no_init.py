"""Run under torchrun: never calls init_process_group; autopart.compile makes the group."""

import os
import sys

sys.path.insert(0, os.getcwd())

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import autopart  # noqa: E402
from tests.distributed.rank_exit import end_rank  # noqa: E402
from tests.zoo import mlp  # noqa: E402

torch.set_num_threads(1)
assert not dist.is_initialized()
model, args, target, loss_fn = mlp()
reference = mlp()[0]
pipe = autopart.compile(model, args, loss_fn=loss_fn, num_stages=2, num_microbatches=2,
                        schedule="1f1b", time_limit_s=5.0)
assert dist.is_initialized() and dist.get_backend() == "gloo"
assert type(pipe).__name__ == "DistributedPipeline"
loss = pipe.train_step(*args, target=target)
torch.testing.assert_close(loss, loss_fn(reference(*args), target).detach(), rtol=1e-5, atol=4e-5)
print(f"rank {dist.get_rank()} ok loss {float(loss):.6f}", flush=True)
pipe.close()
end_rank()
