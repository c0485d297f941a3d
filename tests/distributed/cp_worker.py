"""Worker processes for the context-parallel tests (spawned, gloo): tiny Llama (grouped-query
attention, causal), GPT-2 (causal) and BERT (attention over the whole sequence) with each
sequence split over cp ranks, against the plain model on the whole sequences."""

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

from autopart.core.errors import PlanError
from tests.distributed.ep_worker import _close
from tests.distributed.rank_exit import end_rank

#: the layer a pp = 2 plan cuts before, per model
SECOND_LAYER = {"llama": "model.layers.1", "gpt2": "transformer.h.1",
                "bert": "bert.encoder.layer.1"}


def tiny_model(name: str, seq: int, batch: int) -> tuple[Any, tuple[Any, ...], Any, Any]:
    """A 2-layer, hidden-32 model with random weights (sdpa attention, dropout off), its
    global batch of ``batch`` sequences of ``seq`` tokens, a target and a token-mean loss."""
    import transformers
    from torch import nn

    torch.manual_seed(0)
    if name == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2 * seq,
            use_cache=False, attn_implementation="sdpa"))
    elif name == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=2 * seq, use_cache=False,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa"))
    elif name == "bert":
        model = transformers.BertForMaskedLM(transformers.BertConfig(
            vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, max_position_embeddings=2 * seq, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, attn_implementation="sdpa"))
    else:
        raise ValueError(f"no tiny model {name!r}")

    def loss_fn(out: Any, target: torch.Tensor) -> torch.Tensor:
        logits = out.logits
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                           target.reshape(-1))

    x = torch.randint(0, 64, (batch, seq))
    return model.train(), (x,), torch.randint(0, 64, (batch, seq)), loss_fn


def cp_numerics(rank: int, world: int, port: int, result_dir: str, pp: int, cp: int,
                names: list[str], seq: int, zero_stage: int = 0, compiled: bool = False,
                tp: int = 1, attentions: tuple[str, ...] = ("all_gather", "ulysses")) -> None:
    """tp x pp x dp x cp (dp = world / (tp pp cp)) with ZeRO ``zero_stage``, on each model and
    each of ``attentions`` (``Plan.cp_attention``; a hand-made plan; with ``compiled``, on the
    first model, also ``autopart.compile(...,
    cp=cp)`` planning the world's other degrees on rank 0, and a lazy pipeline at that
    sequence and one twice as long): the global loss and every gradient against the plain
    model on the global batch of whole sequences; write this rank's problems to
    ``result_dir/<rank>.json``."""
    sys.path.insert(0, os.getcwd())
    from autopart.codegen import TensorParallelRank, build_stages
    from autopart.core.capture import capture, node_module_path, op_nodes
    from autopart.core.context import context_inputs
    from autopart.core.signature import InputSignature, microbatch_inputs
    from autopart.runtime.distributed.mesh import mesh_groups
    from autopart.runtime.distributed.pipeline import DistributedPipeline
    from tests.distributed.tp_worker import tp_plan
    from tests.plans import manual_plan

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    dp = world // (tp * pp * cp)
    problems: list[str] = []
    for name, attention in [(n, a) for n in names for a in attentions]:
        m, batch = 2, 4 * dp
        model, args, target, loss_fn = tiny_model(name, seq, batch)
        reference = copy.deepcopy(model)
        rows = tuple(a[: batch // dp] for a in args)
        mb_args, mb_kwargs = microbatch_inputs(*context_inputs(model, cp, rows, {})[:2], m)
        captured = capture(model, mb_args, mb_kwargs)
        positions = []
        if pp == 2:
            nodes = op_nodes(captured.graph_module.graph)
            positions = [next(k for k, n in enumerate(nodes)
                              if node_module_path(n).startswith(SECOND_LAYER[name]))]
        plan = (manual_plan(captured, positions, m, batch, schedule_kind="1f1b") if tp == 1
                else tp_plan(name, captured, pp, m, batch))
        plan = dataclasses.replace(plan, dp=dp, cp=cp, zero_stage=zero_stage,
                                   cp_attention=attention)
        groups = mesh_groups(plan)
        stages = build_stages(captured, plan, ["cpu"] * pp,
                              ranks={dist.get_rank(groups.pp_group)},
                              cp=TensorParallelRank.of_group(groups.cp_group),
                              tp=None if tp == 1 else TensorParallelRank.of_group(
                                  groups.tp_group))
        pipe = DistributedPipeline(model, stages, InputSignature.of(captured),
                                   torch.device("cpu"), loss_fn=loss_fn,
                                   pp_group=groups.pp_group, dp_group=groups.dp_group,
                                   tp_group=groups.tp_group)
        _check(problems, f"{name} {attention}", rank, pipe, args, target, loss_fn, reference,
               stages.shards, groups.tp_group)
        kind = {"all_gather": "ContextParallelAttention", "ulysses": "UlyssesAttention"}
        built = {type(mod).__name__ for st in stages.modules if st is not None
                 for mod in st.modules()}
        held = sorted(built & set(kind.values()))
        if held != [kind[attention]]:
            problems.append(f"{name} {attention}: the stages hold {held}")
        if compiled and (name, attention) == (names[0], attentions[0]):  # the public path
            import autopart

            model, args, target, loss_fn = tiny_model(name, seq, batch)
            initial = copy.deepcopy(model)
            pipe = autopart.compile(model, args, loss_fn=loss_fn, example_target=target,
                                    cp=cp, num_microbatches=m)
            if pipe.plan.cp != cp:
                problems.append(f"{name} compiled: plan has cp={pipe.plan.cp}")
            _check(problems, f"{name} compiled", rank, pipe, args, target, loss_fn,
                   copy.deepcopy(initial))
            # cp searched with the other degrees (whole sequences split per rank by the
            # search; a cp > 1 it chooses is profiled again at S / cp and solved there)
            pipe = autopart.compile(copy.deepcopy(initial), args, loss_fn=loss_fn,
                                    example_target=target, cp=None, num_microbatches=m)
            if pipe.plan.num_gpus != world:
                problems.append(f"{name} cp searched: a plan for {pipe.plan.num_gpus} GPUs")
            _check(problems, f"{name} cp searched (cp={pipe.plan.cp})", rank, pipe, args,
                   target, loss_fn, copy.deepcopy(initial), context=pipe.plan.cp > 1)
            # planned at the first step (a lazy pipeline), then a sequence twice as long: its
            # own capture at the new shape, cut to this rank's tokens, on the same plan
            model = copy.deepcopy(initial)
            lazy = autopart.compile(model, loss_fn=loss_fn, cp=cp, num_microbatches=m)
            _check(problems, f"{name} lazy", rank, lazy, args, target, loss_fn,
                   copy.deepcopy(initial), close=False)
            _, longer, longer_target, _ = tiny_model(name, 2 * seq, batch)
            lazy.zero_grad()
            _check(problems, f"{name} lazy, 2 x seq", rank, lazy, longer, longer_target,
                   loss_fn, copy.deepcopy(initial))
    with open(os.path.join(result_dir, f"{rank}.json"), "w") as f:
        json.dump(problems, f)
    dist.barrier()
    end_rank()


def _check(problems: list[str], name: str, rank: int, pipe: Any, args: tuple[Any, ...],
           target: Any, loss_fn: Any, reference: Any, shards: Any = None,
           tp_group: Any = None, close: bool = True, context: bool = True) -> None:
    """One step of ``pipe`` on the global batch against ``reference``'s loss and gradients
    (a tp shard's gathered whole over ``tp_group`` by its layout in ``shards``); with
    ``context`` (a cp > 1 plan) every attention must be rewritten and the forward refused."""
    loss = pipe.train_step(*args, target=target)
    sources = pipe.stage_sources().values()
    if context and not any("context_parallel" in src for src in sources):
        problems.append(f"{name}: no attention of rank {rank}'s stages was rewritten")
    if context and any("scaled_dot_product_attention" in src for src in sources):
        problems.append(f"{name}: an attention was left whole on rank {rank}")
    ref_loss = loss_fn(reference(*args), target)
    ref_loss.backward()
    ref = dict(reference.named_parameters())
    _close(problems, f"{name} loss", loss, ref_loss.detach())
    for fqn, p in pipe.named_parameters():
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        if isinstance(grad, DTensor):
            grad = grad.full_tensor()
        layout = (shards or {}).get(fqn)
        if layout is not None:
            parts = [torch.empty_like(grad) for _ in range(dist.get_world_size(tp_group))]
            dist.all_gather(parts, grad.contiguous(), group=tp_group)
            grad = layout.full(parts)
        _close(problems, f"{name} {fqn} grad", grad, ref[fqn].grad)
    try:
        pipe(*args)
        if context:
            problems.append(f"{name}: forward with cp > 1 was not refused")
    except PlanError as exc:
        if not context or "not gathered back" not in str(exc):
            problems.append(f"{name}: forward refused for another reason: {exc}")
    if close:
        pipe.close()
