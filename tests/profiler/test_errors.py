"""A node that fails while profiling is named with its module and the model's source line."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autopart.core.capture import capture, node_source, op_nodes
from autopart.core.errors import ProfileError
from autopart.profiler import profile_graph


class Lookup(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(10, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table(ids).sum(1)  # export checks no index; the real lookup does


def test_a_failing_node_names_its_module_and_source_line() -> None:
    model = Lookup()
    captured = capture(model, (torch.zeros(2, 3, dtype=torch.long),))
    (embedding,) = [n for n in op_nodes(captured.graph_module.graph)
                    if n.target == torch.ops.aten.embedding.default]
    assert node_source(embedding).startswith("sparse.py:")  # torch's Embedding.forward
    bad = torch.full((2, 3), 12, dtype=torch.long)  # out of the table's range
    with pytest.raises(ProfileError, match=r"node 'embedding' \(aten.embedding.default, "
                                           r"module 'table', from sparse.py:\d+ .*\) failed "
                                           r"on cpu: IndexError: index out of range"):
        profile_graph(captured, [bad], warmup=0, repeats=1)


def test_nodes_without_a_recorded_frame_say_so() -> None:
    captured = capture(nn.Linear(2, 2), (torch.randn(2, 2),))
    graph = captured.graph_module.graph
    placeholder = next(n for n in graph.nodes if n.op == "placeholder")
    assert node_source(placeholder) == "unknown source line"
