"""Worker processes for the tensor-parallel tests (spawned, gloo): tp x pp pipelines of tiny
GPT-2, Llama (grouped-query attention) and BERT against the unpartitioned model."""

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

from tests.distributed.rank_exit import end_rank

#: the layer every tp x pp test cuts before (a cut inside a column/row pair is refused)
SECOND_LAYER = {"gpt2": "transformer.h.1", "llama": "model.layers.1",
                "bert": "bert.encoder.layer.1"}


def tiny(name: str) -> tuple[Any, tuple[Any, ...], Any, Any]:
    """A 2-layer, hidden-32 model with random weights, its inputs, target and loss."""
    import transformers
    from torch import nn

    torch.manual_seed(0)
    if name == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0))
    elif name == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=64, vocab_size=64, max_position_embeddings=16, use_cache=False))
    else:
        model = transformers.BertForMaskedLM(transformers.BertConfig(
            num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64,
            vocab_size=64, max_position_embeddings=16, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0))

    def loss_fn(out: Any, target: torch.Tensor) -> torch.Tensor:
        logits = out.logits
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                           target.reshape(-1))

    x = torch.randint(0, 64, (4, 8))
    return model, (x,), torch.randint(0, 64, (4, 8)), loss_fn


def styles(name: str) -> dict[str, str]:
    """The sharded parameters of the tiny models, written out by hand: Megatron's pairs, what
    ``find_tensor_parallel`` gives (tests/codegen/test_tensor_parallel.py checks it; BERT's
    q/k/v and output projection, and its two MLP dense layers, pair as sibling modules)."""
    out: dict[str, str] = {}
    for layer in range(2):
        if name == "gpt2":
            p = f"transformer.h.{layer}."
            for mod in ("attn.c_attn", "mlp.c_fc"):
                out[p + mod + ".weight"] = out[p + mod + ".bias"] = "column"
            out[p + "attn.c_proj.weight"] = out[p + "mlp.c_proj.weight"] = "row"
        elif name == "llama":
            p = f"model.layers.{layer}."
            for mod in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                        "mlp.gate_proj", "mlp.up_proj"):
                out[p + mod + ".weight"] = "column"
            out[p + "self_attn.o_proj.weight"] = out[p + "mlp.down_proj.weight"] = "row"
        else:
            p = f"bert.encoder.layer.{layer}."
            for mod in ("attention.self.query", "attention.self.key", "attention.self.value",
                        "intermediate.dense"):
                out[p + mod + ".weight"] = out[p + mod + ".bias"] = "column"
            out[p + "attention.output.dense.weight"] = out[p + "output.dense.weight"] = "row"
    out[{"gpt2": "transformer.wte.weight", "llama": "lm_head.weight",
         "bert": "bert.embeddings.word_embeddings.weight"}[name]] = "vocab"
    return out


def tp_plan(name: str, captured: Any, pp: int, m: int, batch: int,
            sequence_parallel: bool = False) -> Any:
    """A hand-made plan: ``pp`` stages cut before the second layer, tp = 2, sharding what
    ``find_tensor_parallel`` finds in the model's analytical profile (for BERT, its
    sibling-module pairs), with Megatron's sequence parallelism where asked."""
    from autopart.core.capture import node_module_path, op_nodes
    from autopart.core.cluster import PRESETS
    from autopart.core.plan import ShardedParameter
    from autopart.profiler import profile_analytical
    from autopart.solver.tensor_parallel import find_tensor_parallel
    from tests.plans import manual_plan

    positions = []
    if pp == 2:
        nodes = op_nodes(captured.graph_module.graph)
        positions = [next(k for k, n in enumerate(nodes)
                          if node_module_path(n).startswith(SECOND_LAYER[name]))]
    plan = manual_plan(captured, positions, m, batch, schedule_kind="1f1b")
    found = find_tensor_parallel(profile_analytical(captured, None, PRESETS["a100-80gb"]))
    return dataclasses.replace(plan, tp=2, sequence_parallel=sequence_parallel,
                               sharded_parameters=tuple(
        ShardedParameter(k, v) for k, v in sorted(found.params.items())))


def _close(problems: list[str], what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    try:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=4e-5)
    except (AssertionError, TypeError) as exc:
        problems.append(f"{what}: {str(exc).splitlines()[0]}")


def check_whole_state(pipe: Any, ref: dict[str, torch.Tensor], seen: list[str], world: int,
                      name: str, problems: list[str], close: Any) -> None:
    """After a step checked gradient by gradient: every parameter held by some rank (``seen``:
    this rank's FQNs), the whole ``state_dict`` against the plain model ``ref``'s, a reload of
    it (after zeros), and the gradient norm, each mismatch appended to ``problems`` by
    ``close(problems, what, got, want)``. Collective: every rank calls it."""
    every: list[Any] = [None] * world
    dist.all_gather_object(every, seen)
    missing = set(ref) - {f for names in every for f in names}
    if missing:
        problems.append(f"{name}: no rank holds {sorted(missing)[:3]}")
    full = pipe.state_dict()
    for fqn, t in full.items():
        if fqn in ref:
            close(problems, f"{name} state_dict {fqn}", t, ref[fqn].detach())
    pipe.load_state_dict({k: torch.zeros_like(v) for k, v in full.items()})
    pipe.load_state_dict(full)
    for fqn, t in pipe.state_dict().items():
        close(problems, f"{name} reloaded {fqn}", t, full[fqn])
    norm = pipe.clip_grad_norm_(1e9)
    ref_norm = torch.nn.utils.get_total_norm([p.grad for p in ref.values() if p.grad is not None])
    close(problems, f"{name} grad norm", norm, ref_norm)


def tp_numerics(rank: int, world: int, port: int, result_dir: str,
                sequence_parallel: bool = False, recompute_policy: str | None = None) -> None:
    """tp = 2 (adjacent ranks) x pp = world / 2 on the three models, with or without
    sequence parallelism, every stage recomputing under ``recompute_policy`` where one is
    given: loss, every gradient (gathered to full), the full state_dict, load_state_dict
    and the gradient norm against the plain model; write this rank's problems to
    ``result_dir/<rank>.json``."""
    sys.path.insert(0, os.getcwd())
    from autopart.codegen import TensorParallelRank, build_stages
    from autopart.core.capture import capture
    from autopart.core.signature import InputSignature
    from autopart.runtime.distributed.pipeline import DistributedPipeline

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    pp = world // 2
    tp_groups = [dist.new_group([2 * i, 2 * i + 1]) for i in range(pp)]
    pp_groups = [dist.new_group(list(range(j, world, 2))) for j in range(2)]
    tp_group, pp_group = tp_groups[rank // 2], pp_groups[rank % 2]
    problems: list[str] = []
    for name in ("gpt2", "llama", "bert"):
        model, args, target, loss_fn = tiny(name)
        reference = copy.deepcopy(model)
        m = 2
        captured = capture(model, tuple(a[: a.shape[0] // m] for a in args))
        plan = tp_plan(name, captured, pp, m, args[0].shape[0], sequence_parallel)
        if recompute_policy is not None:  # the recomputation runs tp's collectives again
            plan = dataclasses.replace(plan, recompute_policy=recompute_policy, stages=tuple(
                dataclasses.replace(st, recompute=True) for st in plan.stages))
        pp_rank = dist.get_rank(pp_group)
        stages = build_stages(captured, plan, ["cpu"] * pp, ranks={pp_rank},
                              tp=TensorParallelRank.of_group(tp_group))
        pipe = DistributedPipeline(model, stages, InputSignature.of(captured),
                                   torch.device("cpu"), loss_fn=loss_fn, pp_group=pp_group,
                                   tp_group=tp_group)
        collective = "autopart.tp_reduce_scatter" if sequence_parallel else "autopart.tp_reduce"
        if not any(collective in src for src in pipe.stage_sources().values()):
            problems.append(f"{name}: no {collective} in rank {rank}'s stage source")
        loss = pipe.train_step(*args, target=target)
        ref_loss = loss_fn(reference(*args), target)
        ref_loss.backward()
        ref = dict(reference.named_parameters())
        _close(problems, f"{name} loss", loss, ref_loss.detach())
        seen = []
        for fqn, p in pipe.named_parameters():
            seen.append(fqn)
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            layout = stages.shards.get(fqn)
            if layout is not None:
                if p.shape == ref[fqn].shape:
                    problems.append(f"{name} {fqn}: not sharded")
                parts = [torch.empty_like(grad) for _ in range(2)]
                dist.all_gather(parts, grad.contiguous(), group=tp_group)
                grad = layout.full(parts)
            _close(problems, f"{name} {fqn} grad", grad, ref[fqn].grad)
        check_whole_state(pipe, ref, seen, world, name, problems, _close)
        pipe.close()
    with open(os.path.join(result_dir, f"{rank}.json"), "w") as f:
        json.dump(problems, f)
    dist.barrier()
    end_rank()
