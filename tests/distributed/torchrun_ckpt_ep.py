"""Run under torchrun (4 ranks): a checkpoint of a tiny Mixtral trained with its experts split
over ep 4 (dp 4, one row per microbatch) loads into a pp 2 x dp 2 ep 2 pipeline, whose
checkpoint loads into a pp 2 x dp 2 pipeline without ep and into the plain model; AdamW
training continues the unpartitioned run's loss curve through every change of layout
(float32, rtol 1e-5)."""

import dataclasses
import os
import sys

sys.path.insert(0, os.getcwd())

import torch  # noqa: E402

from autopart.core.capture import capture, node_module_path, op_nodes  # noqa: E402
from tests.distributed.ckpt_harness import LayoutResume  # noqa: E402
from tests.distributed.ep_worker import SECOND_LAYER, tiny_moe  # noqa: E402
from tests.distributed.rank_exit import end_rank  # noqa: E402
from tests.plans import manual_plan  # noqa: E402

torch.set_num_threads(1)
model, _, _, loss_fn = tiny_moe("mixtral")  # the same weights on every rank
gen = torch.Generator().manual_seed(1)
batches = [(torch.randint(0, 64, (8, 8), generator=gen), torch.randint(0, 64, (8, 8),
                                                                         generator=gen))
           for _ in range(5)]  # global batch 8

captured = capture(model, (batches[0][0][:2],))
cut = next(k for k, n in enumerate(op_nodes(captured.graph_module.graph))
           if node_module_path(n).startswith(SECOND_LAYER))
dp4_ep4 = dataclasses.replace(manual_plan(captured, [], 2, 8, schedule_kind="1f1b"), dp=4, ep=4)
pp2_dp2_ep2 = dataclasses.replace(manual_plan(captured, [cut], 2, 8, schedule_kind="1f1b"),
                                  dp=2, ep=2)
pp2_dp2 = dataclasses.replace(pp2_dp2_ep2, ep=1)
run = LayoutResume(model, loss_fn, batches, lr=1e-2)
run.run(dp4_ep4, range(0, 2), "dp4-ep4", resume=False, save=True)
run.run(pp2_dp2_ep2, range(2, 3), "pp2xdp2-ep2", resume=True, save=True)
run.run(pp2_dp2, range(3, 5), "pp2xdp2", resume=True, save=False)
run.plain(range(3, 5))  # the plain model: the ep 2 checkpoint, then steps 4 and 5
end_rank()
