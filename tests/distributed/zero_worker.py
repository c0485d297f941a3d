"""Worker processes for the ZeRO tests: pp2 x dp2 (4 gloo ranks) against the plain model."""

from __future__ import annotations

import copy
import dataclasses
import datetime
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tests.distributed.rank_exit import end_rank

BATCH, SEQ, VOCAB = 8, 8, 128


def _lm_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    logits = out.logits  # (batch, seq, vocab)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def tiny(name: str) -> nn.Module:
    """A 2-layer, hidden-32 model with random weights (seed 0), dropout off."""
    import transformers as tf

    torch.manual_seed(0)
    if name == "gpt2":  # wte tied to lm_head, which lands on the other pipeline rank
        return tf.GPT2LMHeadModel(tf.GPT2Config(
            n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=SEQ,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
            bos_token_id=0, eos_token_id=0))
    if name == "llama":  # grouped-query attention: 4 query heads share 2 key/value heads
        return tf.LlamaForCausalLM(tf.LlamaConfig(
            num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=SEQ,
            use_cache=False))
    if name == "bert":
        return tf.BertForMaskedLM(tf.BertConfig(
            num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64,
            vocab_size=VOCAB, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0))
    raise ValueError(name)


def _close(what: str, got: Any, want: Any, problems: list[str], atol: float = 4e-5) -> None:
    try:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=atol)
    except (AssertionError, TypeError) as exc:
        problems.append(f"{what}: {str(exc).splitlines()[0]}")


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _pipeline(name: str, zero: int, mesh: Any, kind: str = "1f1b", v: int = 1, *,
              dp_group: bool = True, plan_dp: int = 2, layers: bool = False,
              recompute: bool = False) -> tuple[Any, ...]:
    """This rank's pipeline of a hand-made pp2 x dp2 plan (m = 2, global batch 8), built as
    ``autopart.compile`` builds it; returns (pipe, reference, my_args, my_target, args, target)."""
    from autopart.codegen import build_stages
    from autopart.core.capture import capture
    from autopart.core.signature import InputSignature
    from autopart.runtime.distributed.pipeline import DistributedPipeline
    from tests.plans import even_positions, manual_plan

    reference = tiny(name)
    model = copy.deepcopy(reference)
    gen = torch.Generator().manual_seed(1)
    args = (torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen),)
    target = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    dp_rank, part = mesh.get_local_rank("dp"), BATCH // 2
    mine = slice(dp_rank * part, (dp_rank + 1) * part)
    my_args, my_target = tuple(a[mine] for a in args), target[mine]
    m = 2
    captured = capture(model, tuple(a[: part // m] for a in my_args))
    plan = manual_plan(captured, even_positions(captured, 2 * v), m, BATCH, schedule_kind=kind,
                       stages_per_rank=v)
    plan = dataclasses.replace(plan, dp=plan_dp, zero_stage=zero, zero_layer_units=layers)
    if recompute:
        plan = dataclasses.replace(plan, stages=tuple(dataclasses.replace(st, recompute=True)
                                                      for st in plan.stages))
    pp_group, dp = mesh.get_group("pp"), mesh.get_group("dp") if dp_group else None
    device = torch.device("cpu")
    stages = build_stages(captured, plan, [device] * 2, ranks={dist.get_rank(pp_group)})
    pipe = DistributedPipeline(model, stages, InputSignature.of(captured), device,
                               loss_fn=_lm_loss, pp_group=pp_group, dp_group=dp)
    return pipe, reference, my_args, my_target, args, target


def _watch(pipe: Any) -> tuple[list[int], list[bool]]:
    """Count each local stage's ``perform_reduce_grad`` calls and record, after each of its
    forwards, whether its parameters are shards again (FSDP resharded them)."""
    from torch.distributed.tensor import DTensor

    reduces = [0] * len(pipe.pipeline_stages)
    after_fwd: list[bool] = []
    for k, st in enumerate(pipe.pipeline_stages):
        inner = st.perform_reduce_grad

        def counted(*a: Any, k: int = k, inner: Any = inner) -> Any:
            reduces[k] += 1
            return inner(*a)

        st.perform_reduce_grad = counted
        st.submod.register_forward_hook(lambda mod, *_: after_fwd.append(
            all(isinstance(p, DTensor) for p in mod.parameters())))
    return reduces, after_fwd


def _check_model(name: str, zero: int, mesh: Any, kind: str, v: int, layers: bool = False,
                 recompute: bool = False) -> list[str]:
    """One step, the gradients, clip_grad_norm_, one AdamW step, state_dict round trip;
    ``layers``: one FSDP unit per layer (``Plan.zero_layer_units``), ``recompute``: every
    stage recomputes its forward."""
    from torch.distributed.tensor import DTensor

    from autopart.core.schedule import splits_backward

    pipe, reference, my_args, my_target, args, target = _pipeline(
        name, zero, mesh, kind, v, layers=layers, recompute=recompute)
    problems: list[str] = []
    tag = f"{name} ZeRO-{zero} {kind} v{v}{' per layer' if layers else ''}"
    units = pipe._sharding.units
    if layers and not any(units.values()):
        problems.append(f"{tag}: layer units {units}")
    params = dict(pipe.named_parameters())
    if not params:
        problems.append(f"{tag}: no parameters")
    if zero and not all(isinstance(p, DTensor) for p in params.values()):
        problems.append(f"{tag}: parameters are not DTensor shards")
    start = {k: v.clone() for k, v in reference.state_dict().items()}
    out = pipe(*my_args)  # inference: every rank gets the output
    _close(f"{tag} output", out.logits, reference(*my_args).logits, problems)
    reduces, sharded_after_fwd = _watch(pipe)
    scatters: list[int] = []
    inner_rs = dist.reduce_scatter_single
    dist.reduce_scatter_single = lambda *a, **k: scatters.append(1) or inner_rs(*a, **k)
    try:
        loss = pipe.train_step(*my_args, target=my_target)
    finally:
        dist.reduce_scatter_single = inner_rs
    if layers:
        # one reduce-scatter per unit holding parameters: per step at ZeRO-1 (the stage's
        # last backward), per microbatch (m = 2) at ZeRO 2-3
        holding = 0
        for st in pipe.pipeline_stages:
            root, paths = st.submod.stage, units.get(st.stage_index, [])
            own = [n for n, _ in root.named_parameters()
                   if not any(n.startswith(p + ".") for p in paths)]
            holding += len(paths) + bool(own)
        want_rs = holding * (1 if zero == 1 else 2)
        if len(scatters) != want_rs:
            problems.append(f"{tag}: {len(scatters)} reduce-scatters, expected {want_rs}")
    # ZeRO-1: one reduce-scatter per stage and step; 2 and 3: one per microbatch (m = 2),
    # then REDUCE_GRAD's, which finds nothing left; ZeRO-3 alone reshards after forward
    # (a split backward's microbatches whose W comes after another's I reduce together)
    want = {1} if zero == 1 else {3} if not splits_backward(kind, False) else {2, 3}
    if layers:  # each unit reduces in its own backward; REDUCE_GRAD finds no FSDP stage
        want = {1}
    if not reduces or not set(reduces) <= want:
        problems.append(f"{tag}: reduce-scatter calls per stage {reduces}, expected {want}")
    if set(sharded_after_fwd) != {zero == 3}:
        problems.append(f"{tag}: parameters sharded after forward {sharded_after_fwd}")
    ref_loss = _lm_loss(reference(*args), target)  # the global batch's, on every rank
    _close(f"{tag} loss", loss, ref_loss.detach(), problems)
    reference.zero_grad()
    _lm_loss(reference(*args), target).backward()  # the global batch's gradients
    ref_params = dict(reference.named_parameters())
    for fqn, p in params.items():
        if p.grad is None:
            problems.append(f"{tag} {fqn}: no gradient")
            continue
        _close(f"{tag} grad {fqn}", _full(p.grad), ref_params[fqn].grad, problems)
    ref_norm = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()])
    max_norm = float(ref_norm) / 10
    torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
    norm = pipe.clip_grad_norm_(max_norm)
    _close(f"{tag} norm", norm, ref_norm, problems, atol=0)
    for fqn, p in params.items():
        if p.grad is not None:
            _close(f"{tag} clipped {fqn}", _full(p.grad), ref_params[fqn].grad, problems)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    opt.step()
    ref_opt.step()
    state = pipe.state_dict()
    for fqn in params:
        _close(f"{tag} stepped {fqn}", state[fqn], ref_params[fqn].detach(), problems)
    if zero and not all(type(t) is torch.Tensor for t in state.values()):
        problems.append(f"{tag}: state_dict holds shards, not whole tensors")
    pipe.load_state_dict(start, strict=False)
    back = pipe.state_dict()
    for fqn in params:
        _close(f"{tag} reloaded {fqn}", back[fqn], start[fqn], problems, atol=0)
    pipe.close()
    return problems


def _check_scaled(name: str, zero: int, mesh: Any) -> list[str]:
    """A step under ``torch.amp.GradScaler`` (torch's AMP recipe on the pipeline's shards),
    then a step whose gradients hold an inf on one rank only: every rank's scaler skips it."""
    pipe, reference, my_args, my_target, args, target = _pipeline(name, zero, mesh)
    tag = f"{name} ZeRO-{zero} grad_scaler"
    problems: list[str] = []
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    pipe.train_step(*my_args, target=my_target, grad_scaler=scaler)
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    _lm_loss(reference(*args), target).backward()
    ref_opt.step()
    state, ref_params = pipe.state_dict(), dict(reference.named_parameters())
    for fqn, _ in pipe.named_parameters():
        _close(f"{tag} stepped {fqn}", state[fqn], ref_params[fqn].detach(), problems)
    opt.zero_grad()
    before = {k: v.clone() for k, v in state.items()}
    handle = None
    if dist.get_rank() == 0:  # an inf in one replica's first stage's backward only
        def poison(mod: nn.Module, inp: Any, out: Any) -> None:
            for o in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(o, torch.Tensor) and o.requires_grad:
                    o.register_hook(lambda g: torch.full_like(g, float("inf")))

        handle = pipe.stages[0].register_forward_hook(poison)
    pipe.train_step(*my_args, target=my_target, grad_scaler=scaler)
    if handle is not None:
        handle.remove()
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    if scaler.get_scale() != 2.0 ** 9:
        problems.append(f"{tag}: scale {scaler.get_scale()} after an overflow, expected 512")
    after = pipe.state_dict()
    problems += [f"{tag}: {k} changed in a skipped step" for k in before
                 if not torch.equal(before[k], after[k])]
    pipe.close()
    return problems


def _check_refusals(mesh: Any) -> list[str]:
    """What sharding cannot run is refused with a PlanError naming the fix."""
    from autopart.core.errors import PlanError

    problems = []
    for what, call, match in [
            ("tied stages on one rank", lambda: _pipeline("gpt2", 1, mesh, "zbv", 2),
             "two of them on one rank"),
            ("no dp group", lambda: _pipeline("llama", 3, mesh, dp_group=False),
             "data-parallel group of 1 rank"),
            ("dp size", lambda: _pipeline("llama", 2, mesh, plan_dp=4),
             "the plan has dp=4 but the data-parallel group has 2")]:
        try:
            call()
            problems.append(f"{what}: no PlanError")
        except PlanError as exc:
            if match not in str(exc):
                problems.append(f"{what}: {exc}")
    return problems


def numerics(rank: int, world: int, port: int, cases: list[tuple[Any, ...]],
             result_dir: str) -> None:
    """Each case on one pp2 x dp2 mesh: ``(zero, model, kind, v[, layers[, recompute]])`` checks numerics, ``
    ("scaled", zero, model)`` the grad scaler, ``("refusals",)`` the errors; writes this
    rank's problems."""
    sys.path.insert(0, os.getcwd())
    from torch.distributed.device_mesh import init_device_mesh

    _setup(rank, world, port)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    problems: list[str] = []
    for case in cases:
        if case[0] == "scaled":
            problems += _check_scaled(case[2], case[1], mesh)
        elif case[0] == "refusals":
            problems += _check_refusals(mesh)
        else:
            problems += _check_model(case[1], case[0], mesh, case[2], case[3], *case[4:])
    with open(os.path.join(result_dir, f"rank{rank}.txt"), "w") as f:
        f.write("\n".join(["done", *problems]) + "\n")
    end_rank()


def _setup(rank: int, world: int, port: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))


Check = Callable[..., list[str]]
__all__ = ["numerics", "tiny"]
