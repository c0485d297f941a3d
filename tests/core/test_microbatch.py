import pytest
import torch

from autopart.core.errors import PlanError
from autopart.core.microbatch import merge_leaves, split_leaves, split_tree


def test_split_tensors_along_dim0_and_broadcast_the_rest() -> None:
    x = torch.arange(12).reshape(6, 2)
    scalar = torch.tensor(3.0)
    mbs = split_leaves([x, scalar, 7, None], 3)
    assert len(mbs) == 3
    assert torch.equal(mbs[1][0], torch.tensor([[4, 5], [6, 7]]))
    assert all(mb[1] is scalar and mb[2] == 7 and mb[3] is None for mb in mbs)


def test_split_requires_divisible_batch() -> None:
    with pytest.raises(PlanError, match="not divisible by num_microbatches=4"):
        split_leaves([torch.zeros(6, 2)], 4)


def test_split_tree_and_merge_round_trip() -> None:
    tree = {"a": torch.arange(4), "b": (torch.ones(4, 2),)}
    parts = split_tree(tree, 2)
    assert torch.equal(parts[1]["a"], torch.tensor([2, 3]))
    merged = merge_leaves([[torch.arange(2), torch.tensor(1.0), "x"],
                           [torch.arange(2, 4), torch.tensor(3.0), "y"]])
    assert torch.equal(merged[0], torch.arange(4))
    assert merged[1].item() == 2.0  # 0-dim tensors (mean losses) are averaged
    assert merged[2] == "x"
