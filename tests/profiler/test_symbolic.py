"""Graphs with data-dependent (unbacked) sizes: profiling, block detection and the stages.

The model below has JetMoE's routing pattern: each token picks an expert, the per-expert
counts are read back with ``.tolist()`` and the sorted tokens are ``split`` by them, so
torch.export records unbacked sizes (``u0``, ``u1``, ...) in every layer. The profiler's
repeated-layer detection used to hash those sizes and fail with
``TypeError: unhashable type: non-nested SymInt``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import autopart
from autopart.core.capture import capture
from autopart.profiler import profile_graph_report
from autopart.profiler.blocks import find_blocks, repeated_blocks
from tests.numerics import assert_train_step_matches

B, T, D, E = 4, 6, 8, 3


class Routed(nn.Module):
    """Top-1 routing to ``E`` experts; the tokens are grouped by ``split`` on their counts."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(D, E)
        self.experts = nn.ModuleList(nn.Linear(D, D) for _ in range(E))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, D)
        choice = self.gate(flat).argmax(-1)
        sizes = nn.functional.one_hot(choice, E).sum(0).tolist()  # data-dependent
        order = choice.argsort()
        parts = flat[order].split(sizes, dim=0)
        out = torch.cat([expert(p) for expert, p in zip(self.experts, parts, strict=True)])
        weight = self.gate(flat).softmax(-1).amax(-1, keepdim=True)
        y = torch.zeros_like(flat).index_add(0, order, out) * weight
        return x + torch.tanh(y).reshape(x.shape)


class Model(nn.Module):
    def __init__(self, layers: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Routed() for _ in range(layers))
        self.head = nn.Linear(D, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)  # (B, T, 2)


def _model() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return Model(), torch.randn(B, T, D)


def test_the_capture_really_has_unbacked_sizes() -> None:
    """Guard on the premise: the layers' values carry unbacked symbolic sizes."""
    model, x = _model()
    captured = capture(model, (x,))
    symbolic = [n for n in captured.graph_module.graph.nodes
                if isinstance(n.meta.get("val"), torch.Tensor)
                and any(not isinstance(d, int) for d in n.meta["val"].shape)]
    assert symbolic


def test_blocks_with_unbacked_sizes_are_found_and_not_conflated() -> None:
    model, x = _model()
    captured = capture(model, (x,))
    blocks = find_blocks(captured.graph_module.graph)
    assert [b.index for b in blocks if b.prefix == "layers"] == [0, 1, 2]
    mapping = repeated_blocks(captured.graph_module)
    # Each layer's sizes are its own data-dependent symbols (u0.. vs u3..), which may differ
    # at run time: no layer is measured as a copy of another.
    assert not mapping


def test_profiling_measures_every_node() -> None:
    model, x = _model()
    captured = capture(model, (x,))
    costs, _ = profile_graph_report(captured, [x], warmup=0, repeats=1,
                                    reuse_repeated_blocks=True)
    assert len(costs.nodes) > 30 and all(n.fwd_us >= 0 for n in costs.nodes)


@pytest.mark.parametrize("num_stages", [2, 3])
def test_stages_match_the_model_loss_and_every_gradient(num_stages: int) -> None:
    model, x = _model()
    reference = copy.deepcopy(model)
    target = torch.randint(0, 2, (B, T))

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out.reshape(-1, 2), y.reshape(-1))

    pipe = autopart.compile(model, (x,), loss_fn=loss_fn, num_stages=num_stages,
                            num_microbatches=2, time_limit_s=5.0)
    assert len(pipe.plan.stages) == num_stages
    assert_train_step_matches(pipe, reference, (x,), target, loss_fn)
