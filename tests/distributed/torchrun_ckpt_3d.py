"""Run under torchrun (4 ranks): a checkpoint of a tp 2 x pp 2 pipeline loads into a
pp 2 x dp 2 ZeRO-3 pipeline, whose checkpoint loads into a tp 2 x dp 2 ZeRO-1 pipeline and
into the plain model; AdamW training continues the unpartitioned run's loss curve through
every change of layout (float32, rtol 1e-5)."""

import dataclasses
import os
import sys

sys.path.insert(0, os.getcwd())

import torch  # noqa: E402

from autopart.core.capture import capture  # noqa: E402
from tests.distributed.ckpt_harness import LayoutResume  # noqa: E402
from tests.distributed.rank_exit import end_rank  # noqa: E402
from tests.distributed.tp_worker import tiny, tp_plan  # noqa: E402

torch.set_num_threads(1)
model, _, _, loss_fn = tiny("gpt2")  # the same weights on every rank
gen = torch.Generator().manual_seed(1)
batches = [(torch.randint(0, 64, (8, 8), generator=gen), torch.randint(0, 64, (8, 8),
                                                                         generator=gen))
           for _ in range(5)]  # global batch 8

captured = capture(model, (batches[0][0][:4],))
tp_pp = tp_plan("gpt2", captured, 2, 2, 8)  # tp 2 x pp 2, m = 2
pp_dp = dataclasses.replace(tp_plan("gpt2", captured, 2, 2, 8), tp=1, sharded_parameters=(),
                            dp=2, zero_stage=3)  # 4 rows a replica, m = 2
tp_dp = dataclasses.replace(tp_plan("gpt2", captured, 1, 1, 8), dp=2, zero_stage=1)
run = LayoutResume(model, loss_fn, batches, lr=1e-2)
run.run(tp_pp, range(0, 2), "tp2xpp2", resume=False, save=True)  # 1. tp 2 x pp 2
run.run(pp_dp, range(2, 3), "pp2xdp2-zero3", resume=True, save=True)  # 2. ZeRO-3 DTensor shards
run.run(tp_dp, range(3, 5), "tp2xdp2-zero1", resume=True, save=False)  # 3. tp slices over dp
run.plain(range(3, 5))  # 4. the plain model: the ZeRO-3 checkpoint, then steps 4 and 5
end_rank()
