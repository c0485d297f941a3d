"""The gloo ranks' receive placement: every receive posted at the start of the step."""

from __future__ import annotations

import pytest
from torch.distributed.pipelining.schedules import _Action

from autopart.runtime._torch_private import receives_first_order

# torch's lowering of a 2-rank 1F1B step at m = 4 (rank 0 and rank 1), as
# _prepare_schedule_with_comms writes it on torch 2.13
RANK0 = ["0UNSHARD", "0F0", "0SEND_F0", "0F1", "0SEND_F1", "0RECV_B0", "0B0", "0F2", "0SEND_F2",
         "0RECV_B1", "0B1", "0F3", "0SEND_F3", "0RECV_B2", "0B2", "0RECV_B3", "0B3",
         "0REDUCE_GRAD", "0RESHARD"]
RANK1 = ["1UNSHARD", "1RECV_F0", "1F0", "1RECV_F1", "1B0", "1SEND_B0", "1F1", "1RECV_F2", "1B1",
         "1SEND_B1", "1F2", "1RECV_F3", "1B2", "1SEND_B2", "1F3", "1B3", "1SEND_B3",
         "1REDUCE_GRAD", "1RESHARD"]


@pytest.mark.parametrize("names", [RANK0, RANK1])
def test_receives_move_to_the_front_and_every_action_keeps_its_order(names: list[str]) -> None:
    actions = [_Action.from_str(n) for n in names]
    got = [str(a) for a in receives_first_order(actions)]
    receives = [n for n in names if "RECV" in n]
    rest = [n for n in names if "RECV" not in n]
    assert got == receives + rest  # same receives in the same order: gloo pairs them alike
    assert sorted(got) == sorted(names)


def test_a_rank_that_receives_nothing_keeps_torch_order() -> None:
    actions = [_Action.from_str(n) for n in ["0F0", "0SEND_F0", "0F1", "0SEND_F1"]]
    assert receives_first_order(actions) == actions
