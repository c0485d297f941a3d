"""Worker processes for the expert-parallel tests (spawned, gloo): tiny Mixtral, Qwen3-MoE,
DeepSeek-V3 and GPT-OSS with their experts split over ep of the dp replicas, against the plain model."""

from __future__ import annotations

import copy
import dataclasses
import datetime
import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tests.distributed.rank_exit import end_rank
from tests.distributed.tp_worker import check_whole_state

#: the layer a pp = 2 plan cuts before
SECOND_LAYER = "model.layers.1"


def tiny_moe(name: str, layers: int = 2) -> tuple[Any, tuple[Any, ...], Any, Any]:
    """A ``layers``-layer (default 2), hidden-32 MoE model with 4 experts (top-2) and random
    weights, its global batch of 8 rows, target and loss."""
    import transformers
    from torch import nn

    torch.manual_seed(0)
    common = dict(num_hidden_layers=layers, hidden_size=32, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=64, max_position_embeddings=16,
                  use_cache=False)
    if name == "mixtral":
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, **common))
    elif name == "qwen3_moe":
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            intermediate_size=64, moe_intermediate_size=48, num_experts=4,
            num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[], head_dim=8,
            **common))
    elif name == "deepseek_v3":
        model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
            intermediate_size=64, moe_intermediate_size=48, n_routed_experts=4,
            num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=0, n_group=1,
            topk_group=1, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
            qk_nope_head_dim=8, v_head_dim=8, **{**common, "num_key_value_heads": 4}))
    elif name == "gpt_oss":  # experts stored transposed, with biases; attention with sinks
        model = transformers.GptOssForCausalLM(transformers.GptOssConfig(
            intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, head_dim=8,
            sliding_window=4, **common))
        with torch.no_grad():  # biases initialise to zero, which would hide them
            for module in model.modules():
                for attr in ("gate_up_proj_bias", "down_proj_bias", "sinks"):
                    if hasattr(module, attr):
                        getattr(module, attr).normal_(std=0.1)
    else:
        raise ValueError(f"no tiny MoE model {name!r}")

    def loss_fn(out: Any, target: torch.Tensor) -> torch.Tensor:
        logits = out.logits
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                           target.reshape(-1))

    x = torch.randint(0, 64, (8, 8))
    return model, (x,), torch.randint(0, 64, (8, 8)), loss_fn


def _close(problems: list[str], what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """Elementwise within rtol 1e-5, atol 4e-5, and (the tiny models' gradients are
    ~1e-4, under that atol) the whole tensor within 1e-5 of the reference, relative."""
    try:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=4e-5)
    except (AssertionError, TypeError) as exc:
        problems.append(f"{what}: {str(exc).splitlines()[0]}")
        return
    scale = float(want.float().norm())
    # a gradient that is zero but for rounding (a key bias: softmax ignores a shift shared by
    # every key) has no relative error to speak of; the elementwise check above holds it
    if scale > 1e-9 and float((got.float() - want.float()).norm()) > 1e-5 * scale:
        problems.append(f"{what}: off by {float((got - want).norm()) / scale:.2e} of its norm")


def ep_numerics(rank: int, world: int, port: int, result_dir: str, pp: int, ep: int,
                names: list[str], zero_stage: int = 0, layer_units: bool = False,
                kind: str = "1f1b") -> None:
    """pp x dp (= world / pp) with ep, and ZeRO ``zero_stage`` (per-layer FSDP units with
    ``layer_units``) on the dense parameters, on each model, under schedule ``kind``
    (``"dualpipev"``: a 4-layer model in 2 pp stages per rank, one layer each, m = 4, with
    its pairs' all-to-alls overlapped, which is checked to run): the global loss, every gradient
    (experts gathered whole, ZeRO's shards too), the whole state_dict, load_state_dict and the gradient norm
    against the plain model on the global batch; write this rank's problems to
    ``result_dir/<rank>.json``."""
    sys.path.insert(0, os.getcwd())
    from autopart.codegen import TensorParallelRank, build_stages
    from autopart.core.capture import capture, node_module_path, op_nodes
    from autopart.core.signature import InputSignature
    from autopart.runtime.distributed.mesh import mesh_groups
    from autopart.runtime.distributed.pipeline import DistributedPipeline
    from tests.plans import manual_plan

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    dp = world // pp
    problems: list[str] = []
    v = 2 if kind == "dualpipev" else 1
    for name in names:
        model, args, target, loss_fn = tiny_moe(name, layers=2 * v)
        reference = copy.deepcopy(model)
        m = 2 * v
        batch = args[0].shape[0]
        captured = capture(model, tuple(a[: batch // (m * dp)] for a in args))
        nodes = op_nodes(captured.graph_module.graph)
        positions = [next(k for k, n in enumerate(nodes)
                          if node_module_path(n).startswith(f"model.layers.{layer}"))
                     for layer in range(1, pp * v)]
        plan = dataclasses.replace(manual_plan(captured, positions, m, batch,
                                               schedule_kind=kind, stages_per_rank=v),
                                   dp=dp, ep=ep, zero_stage=zero_stage,
                                   zero_layer_units=layer_units)
        groups = mesh_groups(plan)
        chunk = groups.ep_chunk_group
        if (chunk is not None) != (kind == "dualpipev" and zero_stage <= 1):
            problems.append(f"{name}: second V chunk's ep group {chunk}")
        stages = build_stages(captured, plan, ["cpu"] * pp,
                              ranks={dist.get_rank(groups.pp_group)},
                              ep=TensorParallelRank.of_group(groups.ep_group),
                              ep_chunk=None if chunk is None else TensorParallelRank.of_group(chunk))
        pipe = DistributedPipeline(model, stages, InputSignature.of(captured),
                                   torch.device("cpu"), loss_fn=loss_fn,
                                   pp_group=groups.pp_group, dp_group=groups.dp_group,
                                   ep_group=groups.ep_group, edp_group=groups.edp_group)
        if any("ExpertParallelExperts" not in src and "experts" in src.lower()
               and "expert_parallel" not in src for src in pipe.stage_sources().values()):
            problems.append(f"{name}: a stage with experts was not rewritten")
        if chunk is not None:  # CPU ranks run the pairs one after the other unless told
            pipe.overlap_pairs = True
        loss = pipe.train_step(*args, target=target)
        if chunk is not None:
            order = pipe._schedule(m, True).pipeline_order_with_comms[pipe.pp_rank]
            if not any(a.sub_actions for a in order):
                problems.append(f"{name}: no overlapped F+B pair in rank {pipe.pp_rank}'s actions")
        ref_loss = loss_fn(reference(*args), target)
        ref_loss.backward()
        ref = dict(reference.named_parameters())
        _close(problems, f"{name} loss", loss, ref_loss.detach())
        seen = []
        for fqn, p in pipe.named_parameters():
            seen.append(fqn)
            if zero_stage and isinstance(p, DTensor) == (fqn in stages.ep_shards):
                problems.append(f"{name} {fqn}: {'a ZeRO shard' if isinstance(p, DTensor) else 'whole'}"
                                " (ZeRO shards the dense parameters, ep the experts)")
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            if isinstance(grad, DTensor):
                grad = grad.full_tensor()
            layout = stages.ep_shards.get(fqn)
            if layout is not None:
                if isinstance(p, DTensor) or p.shape == ref[fqn].shape:
                    problems.append(f"{name} {fqn}: not split over ep")
                parts = [torch.empty_like(grad) for _ in range(ep)]
                dist.all_gather(parts, grad.contiguous(), group=groups.ep_group)
                grad = layout.full(parts)
            _close(problems, f"{name} {fqn} grad", grad, ref[fqn].grad)
        if not stages.ep_shards:
            problems.append(f"{name}: no expert weight split on rank {rank}")
        check_whole_state(pipe, ref, seen, world, name, problems, _close)
        pipe.close()
    with open(os.path.join(result_dir, f"{rank}.json"), "w") as f:
        json.dump(problems, f)
    dist.barrier()
    end_rank()
