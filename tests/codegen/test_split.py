import pytest
import torch
from torch import nn

from autopart.codegen.params import build_stage_modules
from autopart.codegen.split import crossing_names, split_graph, stage_of_nodes
from autopart.core.capture import capture, op_nodes
from autopart.core.errors import PlanError
from tests.zoo import SkipMLP, gpt2


def test_stage_of_nodes_table() -> None:
    assert stage_of_nodes(6, [2, 4]) == [0, 0, 1, 1, 2, 2]
    assert stage_of_nodes(3, []) == [0, 0, 0]
    with pytest.raises(PlanError, match="strictly ascending within 1..5"):
        stage_of_nodes(6, [4, 2])
    with pytest.raises(PlanError, match="within 1..5"):
        stage_of_nodes(6, [6])


def _linear_positions(captured, count: int) -> list[int]:  # type: ignore[no-untyped-def]
    names = [n.name for n in op_nodes(captured.graph_module.graph)]
    return [i for i, name in enumerate(names) if name.startswith("linear")][1:count + 1]


def test_skip_connection_is_passed_through_every_stage_between() -> None:
    torch.manual_seed(0)
    model = SkipMLP(width=8, depth=4)
    x = torch.randn(4, 8)
    captured = capture(model, (x,))
    positions = _linear_positions(captured, 3)
    crossings = crossing_names(captured, positions)
    skip = op_nodes(captured.graph_module.graph)[0].name  # output of self.inp
    assert all(skip in names for names in crossings), crossings
    stages = split_graph(captured, positions)
    assert [sg.input_names for sg in stages][1:] == [tuple(c) for c in crossings]
    # a middle stage both receives and returns the skip value, untouched
    assert skip in stages[1].input_names and skip in stages[1].output_names
    modules, _ = build_stage_modules(captured, stages, [torch.device("cpu")] * len(stages))
    values: tuple[torch.Tensor, ...] = (x,)
    for module in modules:
        values = module(*values)
    torch.testing.assert_close(values[0], model(x), rtol=0, atol=0)


def test_each_stage_owns_only_what_it_reads_and_tied_weights_are_replicated() -> None:
    model, args, _, _ = gpt2()
    captured = capture(model, args)
    n = len(op_nodes(captured.graph_module.graph))
    stages = split_graph(captured, [n // 2])
    modules, placement = build_stage_modules(captured, stages, [torch.device("cpu")] * 2)
    names0 = {k for k, _ in modules[0].named_parameters()}
    names1 = {k for k, _ in modules[1].named_parameters()}
    assert "transformer.wte.weight" in names0 and "transformer.wte.weight" in names1
    assert "transformer.h.0.attn.c_attn.weight" in names0
    assert "transformer.h.0.attn.c_attn.weight" not in names1
    assert "transformer.ln_f.weight" in names1 and "transformer.ln_f.weight" not in names0
    assert placement.owner["transformer.wte.weight"] == 0
    assert placement.replicas == {"transformer.wte.weight": [1]}
    owner = placement.tensors[(0, "transformer.wte.weight")]
    replica = placement.tensors[(1, "transformer.wte.weight")]
    assert owner is model.transformer.wte.weight  # same device: shared with the model
    assert replica is not owner and torch.equal(replica, owner)


class TupleOp(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = torch.chunk(x * 2, 2, dim=1)
        return a * b


def test_a_cut_between_a_tuple_op_and_its_getitem_is_refused() -> None:
    captured = capture(TupleOp(), (torch.randn(2, 4),))
    nodes = op_nodes(captured.graph_module.graph)
    # the op that returns a list (chunk / split); its getitem users follow it
    after_chunk = next(i for i, n in enumerate(nodes)
                       if isinstance(n.meta.get("val"), (list, tuple))) + 1
    with pytest.raises(PlanError, match=r"not a tensor.*move the cut"):
        split_graph(captured, [after_chunk])
