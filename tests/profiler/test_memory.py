"""Saved-for-backward bytes against what autograd actually keeps; repeated-block reuse; spread."""

from __future__ import annotations

import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks

from autopart.core.capture import capture, op_nodes
from autopart.profiler import profile_graph_report
from autopart.profiler.blocks import find_blocks, path_pattern, repeated_blocks
from autopart.profiler.meters import SavedTensorMeter, storage_key
from tests.profiler._models import small_gpt2

pytest.importorskip("transformers")


def _real_saved(model: torch.nn.Module, gm: torch.fx.GraphModule, x: torch.Tensor) -> int:
    """Distinct non-parameter storages autograd packs in one forward, checked by a backward."""
    excluded = {k for t in [*model.parameters(), *model.buffers()] if (k := storage_key(t))}
    meter = SavedTensorMeter(excluded)
    with saved_tensors_hooks(meter.pack, meter.unpack):
        out = gm(x)
    out[0].float().sum().backward()
    assert model.lm_head.weight.grad is not None
    model.zero_grad(set_to_none=True)
    return meter.saved_bytes


@pytest.mark.parametrize("reuse", [False, True])
def test_saved_bytes_equal_what_autograd_keeps(reuse: bool) -> None:
    model, x = small_gpt2()
    captured = capture(model, (x,))
    costs, report = profile_graph_report(captured, [x], warmup=0, repeats=1,
                                         reuse_repeated_blocks=reuse)
    assert sum(n.saved_bytes for n in costs.nodes) == _real_saved(model, captured.graph_module, x)
    assert bool(report.reused) == reuse
    assert all(n.transient_bytes >= n.output_bytes for n in costs.nodes if n.bwd_us > 0)


def test_repeated_blocks_map_layer_1_onto_layer_0() -> None:
    model, x = small_gpt2()
    captured = capture(model, (x,))
    assert path_pattern("transformer.h.1.attn") == ("transformer.h", 1)
    assert path_pattern("lm_head") is None
    blocks = find_blocks(captured.graph_module.graph)
    assert [(b.prefix, b.index) for b in blocks] == [("transformer.h", 0), ("transformer.h", 1)]
    mapping = repeated_blocks(captured.graph_module)
    assert set(mapping) == set(blocks[1].nodes)
    assert all(mapping[a] is b for a, b in zip(blocks[1].nodes, blocks[0].nodes, strict=True))
    costs, report = profile_graph_report(captured, [x], warmup=0, repeats=2)
    by_name = {n.name: n for n in costs.nodes}
    for node, rep in mapping.items():
        assert by_name[node.name].fwd_us == by_name[rep.name].fwd_us
        assert report.reused[node.name] == rep.name
    assert len(costs.nodes) == len(op_nodes(captured.graph_module.graph))
    assert report.reuse_saved_s > 0
    assert all(s >= 0 for s in report.fwd_spread.values())


def test_reuse_keeps_outputs_exact() -> None:
    """Reused nodes still compute their values: the last node's output is the model's."""
    model, x = small_gpt2()
    captured = capture(model, (x,))
    a, _ = profile_graph_report(captured, [x], warmup=0, repeats=1, reuse_repeated_blocks=True)
    b, _ = profile_graph_report(captured, [x], warmup=0, repeats=1, reuse_repeated_blocks=False)
    assert [n.flops for n in a.nodes] == [n.flops for n in b.nodes]
    assert [n.output_bytes for n in a.nodes] == [n.output_bytes for n in b.nodes]


def test_allocated_peak_counts_what_a_call_holds_at_once_and_ignores_older_blocks() -> None:
    from autopart.core.memory import allocated_peak_bytes

    old = [torch.empty(2**20, dtype=torch.uint8)]  # allocated before: its free is not seen

    def work() -> torch.Tensor:
        old.clear()
        a = torch.empty(2**20, dtype=torch.uint8)
        b = torch.empty(2**19, dtype=torch.uint8)  # 1.5 MiB held here
        del a, b
        return torch.empty(2**18, dtype=torch.uint8)

    out, peak = allocated_peak_bytes(work, torch.device("cpu"))
    assert out.numel() == 2**18
    assert 3 * 2**19 <= peak < 3 * 2**19 + 4096, peak
    assert allocated_peak_bytes(lambda: 7, torch.device("meta")) == (7, 0)


kept: list[torch.Tensor] = []


def test_a_block_from_an_earlier_measurement_freed_during_this_one_does_not_lower_it() -> None:
    from autopart.core.memory import allocated_peak_bytes

    # allocated while the profiler watched (an earlier measurement): the profiler knows its
    # size and reports its free in the next one
    _, earlier = allocated_peak_bytes(lambda: kept.append(torch.empty(2**16, dtype=torch.uint8)),
                                      torch.device("cpu"))

    def work() -> None:
        kept.clear()
        a = torch.empty(2**20, dtype=torch.uint8)
        del a

    _, peak = allocated_peak_bytes(work, torch.device("cpu"))
    assert earlier >= 2**16
    assert 2**20 <= peak < 2**20 + 4096, peak


def test_each_nodes_backward_peak_covers_the_gradients_it_returns() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    x = torch.randn(32, 64)
    captured = capture(model, (x,))
    costs, _ = profile_graph_report(captured, [x], warmup=0, repeats=1)
    linears = [n for n in costs.nodes if n.params]
    assert len(linears) == 2
    for n in linears:
        weights = sum(costs.param_sizes[p] for p in n.params)
        # the weight and bias gradients, and the input's for the second linear
        grads_in = 0 if n is linears[0] else 32 * 256 * 4
        assert n.backward_peak_bytes >= weights + grads_in, (n.name, n.backward_peak_bytes)
        assert n.backward_peak_bytes < 4 * (weights + grads_in) + 65536


@pytest.mark.parametrize("reuse", [False, True])
def test_saved_from_names_the_node_that_returned_each_saved_storage(reuse: bool) -> None:
    """Each node's saved storages that a node returned point back at that node: a layer
    norm's input at the residual add before it, the embedding's token ids at the graph's
    input, attention's output at itself; the repeated layer's reused costs point the same
    distance back. The transposed attention output is strided."""
    model, x = small_gpt2()
    captured = capture(model, (x,))
    costs, _ = profile_graph_report(captured, [x], warmup=0, repeats=1,
                                    reuse_repeated_blocks=reuse)
    nodes = costs.nodes
    for nd in nodes:
        assert nd.saved_from is not None, nd.name
        assert sum(b for _, b in nd.saved_from) <= nd.saved_bytes, nd.name
    producers = {nd.name: {nodes[i - d].op if d <= i else "input" for d, _ in nd.saved_from}
                 for i, nd in enumerate(nodes)}
    norms = [i for i, nd in enumerate(nodes) if nd.op == "aten.layer_norm.default"]
    assert [producers[nodes[i].name] for i in norms[1:]] == [{"aten.add.Tensor"}] * (
        len(norms) - 1)  # every norm after the first reads the residual stream
    embedding = next(nd for nd in nodes if nd.op == "aten.embedding.default")
    assert producers[embedding.name] == {"input"}  # the token ids
    assert dict(embedding.saved_from or ())[nodes.index(embedding) + 1] == x.numel() * 8
    attention = [(i, nd) for i, nd in enumerate(nodes) if "scaled_dot_product" in nd.op]
    assert len(attention) == 2
    for _, nd in attention:  # the fused kernel keeps its own output
        assert dict(nd.saved_from or ()).get(0) == nd.output_bytes
        assert nd.strided_output_bytes == nd.output_bytes  # (b, heads, t, d) over (b, t, heads, d)
    assert sum(nd.strided_output_bytes > 0 for nd in nodes) >= 2


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))


class _Blocks(torch.nn.Module):
    """Three identical blocks (reused costs), then a head of another shape reading the last
    block's ReLU output, which that ReLU saved first."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Block() for _ in range(3))
        self.head = torch.nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_a_storage_a_reused_node_saved_is_not_counted_again_by_a_measured_one() -> None:
    torch.manual_seed(0)
    model, x = _Blocks(), torch.randn(16, 32)
    captured = capture(model, (x,))
    excluded = {k for t in model.parameters() if (k := storage_key(t))}
    meter = SavedTensorMeter(excluded)
    with saved_tensors_hooks(meter.pack, meter.unpack):
        captured.graph_module(x)
    for reuse in (False, True):
        costs, report = profile_graph_report(captured, [x], warmup=0, repeats=1,
                                             reuse_repeated_blocks=reuse)
        assert bool(report.reused) == reuse
        assert sum(n.saved_bytes for n in costs.nodes) == meter.saved_bytes, reuse
