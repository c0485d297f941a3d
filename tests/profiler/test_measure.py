"""Tests of profile_graph on a hand-worked MLP, a BatchNorm model and a 2-layer GPT-2."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autopart.core.capture import CapturedGraph, capture, op_nodes
from autopart.core.costgraph import CostGraph, NodeCost
from autopart.core.errors import ProfileError
from autopart.profiler import profile_graph

B, D_IN, D_HID, D_OUT = 5, 8, 16, 4
F32 = 4  # bytes per float32 element


def _mlp() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D_IN, D_HID), nn.ReLU(), nn.Dropout(0.5),
                          nn.Linear(D_HID, D_OUT)).train()
    return model, torch.randn(B, D_IN)


def _by_name(costs: CostGraph) -> dict[str, NodeCost]:
    return {n.name: n for n in costs.nodes}


@pytest.fixture(scope="module")
def mlp() -> tuple[nn.Module, torch.Tensor, CapturedGraph, CostGraph]:
    model, x = _mlp()
    captured = capture(model, (x,))
    return model, x, captured, profile_graph(captured, [x])


@pytest.fixture(scope="module")
def gpt2() -> tuple[nn.Module, CapturedGraph, CostGraph]:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000,
                                  n_positions=64, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0,
                                  use_cache=False, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg)
    x = torch.randint(0, 1000, (4, 16))
    captured = capture(model, (x,))
    return model, captured, profile_graph(captured, captured.flatten_inputs((x,), {}))


def test_mlp_nodes_and_timings(mlp: tuple[nn.Module, torch.Tensor, CapturedGraph, CostGraph],
                               ) -> None:
    _, _, captured, costs = mlp
    graph = captured.graph_module.graph
    assert [n.name for n in costs.nodes] == [n.name for n in op_nodes(graph)]
    assert all(n.fwd_us > 0 for n in costs.nodes)
    assert costs.source == "measured:cpu" and costs.bwd_source == "measured"
    assert costs.batch_size == B and costs.fingerprint == captured.fingerprint
    assert costs.graph_inputs == {"input_1": B * D_IN * F32}
    assert costs.graph_outputs == (costs.nodes[-1].name,)


def test_mlp_linear_hand_worked(mlp: tuple[nn.Module, torch.Tensor, CapturedGraph, CostGraph],
                                ) -> None:
    _, _, _, costs = mlp
    nodes = _by_name(costs)
    first, last = nodes["linear"], nodes["linear_1"]
    # FLOPs: one multiply-add per (row, in, out) = 2 * B * in * out; the bias add is not counted.
    assert first.flops == 2 * B * D_IN * D_HID == 1280
    assert last.flops == 2 * B * D_HID * D_OUT == 640
    # Saved for backward: the input activation only; the weight is a parameter (excluded).
    assert first.saved_bytes == B * D_IN * F32 == 160
    assert last.saved_bytes == B * D_HID * F32 == 320
    assert first.output_bytes == B * D_HID * F32 and first.output_is_tensor
    # bytes_accessed: x + weight + bias + output.
    assert first.bytes_accessed == (B * D_IN + D_HID * D_IN + D_HID + B * D_HID) * F32
    assert first.param_bytes == (D_IN * D_HID + D_HID) * F32
    assert first.params == ("0.weight", "0.bias")
    assert first.inputs == ("input_1",) and last.inputs == ("getitem",)  # native_dropout[0]
    assert first.bwd_weight_us > 0 and last.bwd_weight_us > 0 and last.bwd_input_us > 0
    # The graph input needs no gradient, so the first layer has no input-gradient part.
    assert first.bwd_input_us == 0.0


def test_mlp_params_and_trainable(mlp: tuple[nn.Module, torch.Tensor, CapturedGraph, CostGraph],
                                  ) -> None:
    model, _, _, costs = mlp
    expected = {name: p.numel() * p.element_size() for name, p in model.named_parameters()}
    assert costs.param_sizes == expected
    assert costs.param_numel == {name: p.numel() for name, p in model.named_parameters()}
    assert costs.trainable == frozenset(expected)
    assert sum(n.param_bytes for n in costs.nodes) == sum(expected.values())


def test_profiling_leaves_model_and_rng_untouched() -> None:
    model, x = _mlp()
    captured = capture(model, (x,))
    params = {k: v.clone() for k, v in model.state_dict().items()}
    x_before = x.clone()
    rng = torch.get_rng_state()
    profile_graph(captured, [x])
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(params[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(x, x_before)


def test_buffers_updated_in_place_stay_untouched() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D_IN, D_HID), nn.BatchNorm1d(D_HID), nn.ReLU(inplace=True),
                          nn.Linear(D_HID, D_OUT)).train()
    x = torch.randn(B, D_IN)
    captured = capture(model, (x,))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    costs = profile_graph(captured, [x])
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    nodes = _by_name(costs)
    # relu_ is functionalised to relu by capture; it still has an input-gradient backward.
    assert nodes["relu"].bwd_input_us > 0
    assert "1.running_mean" in costs.param_sizes and "1.running_mean" not in costs.trainable


def test_inference_profile_has_no_backward(
        mlp: tuple[nn.Module, torch.Tensor, CapturedGraph, CostGraph]) -> None:
    _, x, captured, _ = mlp
    costs = profile_graph(captured, [x], training=False, warmup=0, repeats=1)
    assert costs.bwd_source == "none"
    assert all(n.bwd_us == 0 and n.saved_bytes == 0 for n in costs.nodes)
    assert _by_name(costs)["linear"].flops == 1280


def test_gpt2_profile(gpt2: tuple[nn.Module, CapturedGraph, CostGraph]) -> None:
    model, captured, costs = gpt2
    graph = captured.graph_module.graph
    assert len(costs.nodes) == len(op_nodes(graph))
    assert all(n.fwd_us > 0 for n in costs.nodes)
    matmuls = [n for n in costs.nodes if n.op in ("aten.addmm.default", "aten.linear.default")]
    assert len(matmuls) == 2 * 4 + 1
    assert all(n.bwd_weight_us > 0 and n.flops > 0 for n in matmuls)
    lm_head = _by_name(costs)["linear"]
    assert lm_head.flops == 2 * (4 * 16) * 64 * 1000
    # wte and lm_head are one tensor: counted once, by its first reader (the embedding).
    unique = sum(p.numel() * p.element_size() for p in model.parameters())
    assert sum(n.param_bytes for n in costs.nodes) == unique
    assert sum(costs.param_sizes.values()) == unique
    assert lm_head.param_bytes == 0 and lm_head.params == ("transformer.wte.weight",)
    assert all(p.grad is None for p in model.parameters())


def test_costgraph_round_trips(gpt2: tuple[nn.Module, CapturedGraph, CostGraph]) -> None:
    _, _, costs = gpt2
    assert CostGraph.from_dict(costs.to_dict()) == costs


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_cuda_without_gpu_raises(mlp: tuple[nn.Module, torch.Tensor, CapturedGraph, CostGraph],
                                 ) -> None:
    _, x, captured, _ = mlp
    with pytest.raises(ProfileError, match=r"cuda:0.*torch.cuda.is_available\(\) is False"):
        profile_graph(captured, [x], device="cuda:0")


@pytest.mark.parametrize("device", ["gpu", "cuda", "cuda:x", "CPU"])
def test_malformed_device_raises(mlp: tuple[nn.Module, torch.Tensor, CapturedGraph, CostGraph],
                                 device: str) -> None:
    _, x, captured, _ = mlp
    with pytest.raises(ProfileError, match=r"is not valid; choose one of 'cpu'"):
        profile_graph(captured, [x], device=device)


def test_bad_inputs_and_counts_raise(
        mlp: tuple[nn.Module, torch.Tensor, CapturedGraph, CostGraph]) -> None:
    _, x, captured, _ = mlp
    with pytest.raises(ProfileError, match=r"takes 1 flat inputs, got 2"):
        profile_graph(captured, [x, x])
    with pytest.raises(ProfileError, match=r"repeats >= 1"):
        profile_graph(captured, [x], repeats=0)
    with pytest.raises(ProfileError, match=r"node 'linear' .* failed on cpu"):
        profile_graph(captured, [torch.randn(B, D_IN + 1)])


def test_a_moe_profile_counts_the_tokens_routed_to_each_expert() -> None:
    pytest.importorskip("transformers")
    from tests.distributed.ep_worker import tiny_moe

    model, args, _, _ = tiny_moe("mixtral")
    batch = args[0][:2]
    # the router's own choices, read from the eager model: (logits, scores, top-k ids)
    chosen: list[torch.Tensor] = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, out: chosen.append(out[2]))
             for layer in model.model.layers]
    with torch.no_grad():
        model(batch)
    for hook in hooks:
        hook.remove()
    captured = capture(model, (batch,))
    costs = profile_graph(captured, captured.flatten_inputs((batch,), {}), device="cpu",
                          warmup=0, repeats=1)
    routed = dict(costs.expert_tokens)
    assert sorted(routed) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    for i, ids in enumerate(chosen):
        want = tuple(torch.bincount(ids.reshape(-1), minlength=4).tolist())
        assert routed[f"model.layers.{i}.mlp.experts"] == want
        assert sum(want) == 2 * 8 * 2  # 2 rows x 8 tokens x top-2
    assert CostGraph.from_dict(costs.to_dict()).expert_tokens == costs.expert_tokens
