"""A recomputing stage under the ``"selective"`` recompute policy
(:func:`autopart.codegen.recompute.run_recomputed`): the numerics of no recompute, matmul and
attention outputs kept, the rest run again in the backward, buffers left as the forward
left them."""

from __future__ import annotations

import copy
import gc
from collections import Counter
from typing import Any

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy

import autopart.codegen  # noqa: F401  (registers tp's collectives as torch.ops.autopart.*)
from autopart.codegen import build_stages
from autopart.codegen.recompute import op_policy, run_recomputed, selective_policy
from autopart.core.capture import capture
from autopart.core.errors import PlanError
from autopart.core.recompute_policy import SELECTIVE_KEPT_KERNELS, TP_KEPT_NODE_OPS
from tests.codegen._modules import EmaCentre
from tests.plans import manual_plan

TOL = {"rtol": 1e-5, "atol": 4e-5}


class _Ops(TorchDispatchMode):
    """Counts the kernels dispatched meanwhile (``str(func)``), and remembers the storage of
    every tensor they return."""

    def __init__(self) -> None:
        super().__init__()
        self.count: Counter[str] = Counter()
        self._made: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.count[str(func)] += 1
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                self._made[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())
        return out

    def live_bytes(self) -> int:
        """Bytes of the storages made meanwhile that something still holds."""
        gc.collect()
        return sum(n for ref, n in self._made.values() if not ref.expired())


def _gpt2_stage() -> tuple[nn.Module, torch.Tensor]:
    """A 2-layer GPT-2 with dropout on, captured in training mode as one stage."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=32,
                     resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, use_cache=False,
                     bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg).train()
    x = torch.randint(0, 256, (2, 16))
    captured = capture(model, (x,))
    return build_stages(captured, manual_plan(captured, [], 1, 2), ["cpu"]).modules[0], x


def test_selective_keeps_the_matmuls_recomputes_the_rest_with_the_same_numerics() -> None:
    stage, x = _gpt2_stage()
    runs = {}
    for policy in ("none", "full", "selective"):
        stage.zero_grad(set_to_none=True)
        torch.manual_seed(7)  # the same dropout masks in every run
        with _Ops() as forward:
            out = stage(x) if policy == "none" else run_recomputed(stage, x, policy=policy)
        kept = forward.live_bytes()  # the outputs, and what the forward keeps for backward
        with _Ops() as backward:
            out[0].pow(2).mean().backward()
        runs[policy] = (out[0].detach(), {n: p.grad for n, p in stage.named_parameters()},
                        kept, backward.count)
        del out
    logits, grads, none_bytes, none_ops = runs["none"]
    for policy in ("full", "selective"):
        torch.testing.assert_close(runs[policy][0], logits, **TOL)
        for name, g in runs[policy][1].items():
            torch.testing.assert_close(g, grads[name], **TOL, msg=f"{policy}: {name}")
    _, _, full_bytes, full_ops = runs["full"]
    _, _, sel_bytes, sel_ops = runs["selective"]
    assert full_bytes < sel_bytes < none_bytes, (full_bytes, sel_bytes, none_bytes)
    # the kept kernels run in the backward as often as without recompute (the backward's
    # own matmuls), where "full" runs the forward's again: GPT-2's Conv1D is addmm, its
    # attention with dropout the math kernel's bmm (the forward's one mm, the LM head, is
    # last: checkpoint stops recomputing before it)
    assert sel_ops["aten.mm.default"] == none_ops["aten.mm.default"] > 0
    for kernel in ("aten.addmm.default", "aten.bmm.default"):
        assert sel_ops[kernel] == none_ops[kernel] < full_ops[kernel], kernel
    # norms, dropout (attention's too) and the GELU's tanh run again, as often as under
    # "full", and draw the same masks (checkpoint restores the RNG state)
    for kernel in ("aten.native_layer_norm.default", "aten.native_dropout.default",
                   "aten.bernoulli_.float", "aten.tanh.default"):
        assert none_ops[kernel] == 0 < sel_ops[kernel] == full_ops[kernel], kernel


def test_selective_leaves_written_buffers_as_the_forward_left_them() -> None:
    """BatchNorm's statistics and an in-place EMA: two microbatches, each backward after
    both forwards (as a pipeline runs them), end as without recompute, with its gradients."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
                          nn.Linear(8 * 6 * 6, 16), EmaCentre(16), nn.Tanh(),
                          nn.Linear(16, 3)).train()
    xs = [torch.randn(2, 3, 8, 8) for _ in range(2)]
    results = []
    for policy in ("none", "selective"):
        captured = capture(copy.deepcopy(model), (xs[0],))
        stage = build_stages(captured, manual_plan(captured, [], 1, 2), ["cpu"]).modules[0]
        outs = [stage(x) if policy == "none" else run_recomputed(stage, x, policy=policy)
                for x in xs]
        for out in outs:
            out[0].pow(2).sum().backward()
        results.append(({n: b.clone() for n, b in stage.named_buffers()},
                        {n: p.grad for n, p in stage.named_parameters()}))
    (buffers, grads), (sel_buffers, sel_grads) = results
    assert buffers.keys() == sel_buffers.keys() and len(buffers) >= 4
    for name, b in buffers.items():
        torch.testing.assert_close(sel_buffers[name], b, rtol=1e-6, atol=1e-7, msg=name)
    for name, g in grads.items():
        torch.testing.assert_close(sel_grads[name], g, **TOL, msg=name)


def test_the_kept_kernel_names_are_what_the_ops_print() -> None:
    """``str(op)`` of an aten kernel and of tp's custom collectives is the name the shared
    constants hold, so the policy keeps them."""
    for name in ("aten.mm.default", "aten.addmm.default", "aten.bmm.default",
                 "aten._scaled_dot_product_flash_attention_for_cpu.default", *TP_KEPT_NODE_OPS):
        namespace, op, overload = name.split(".")
        kernel = getattr(getattr(getattr(torch.ops, namespace), op), overload)
        assert str(kernel) == name and name in SELECTIVE_KEPT_KERNELS
        assert selective_policy(None, kernel) == CheckpointPolicy.MUST_SAVE
    for kernel in (torch.ops.aten.gelu.default, torch.ops.aten.native_dropout.default,
                   torch.ops.aten.mm.out):
        assert selective_policy(None, kernel) == CheckpointPolicy.PREFER_RECOMPUTE
    # sequence parallelism's all-gathers run again in the backward (Megatron-LM keeps a
    # sequence-parallel linear's input split), under both checkpointed policies
    for kernel in (torch.ops.autopart.tp_seq_gather_split.default,
                   torch.ops.autopart.tp_seq_gather.default):
        assert selective_policy(None, kernel) == CheckpointPolicy.PREFER_RECOMPUTE
        assert op_policy(None, kernel) == CheckpointPolicy.PREFER_RECOMPUTE
    assert op_policy(None, torch.ops.autopart.tp_reduce_scatter.default) == \
        CheckpointPolicy.MUST_SAVE


def test_an_unknown_policy_is_refused() -> None:
    lin = nn.Linear(2, 2)
    with pytest.raises(PlanError, match="'offload'.*'full', 'selective'"):
        run_recomputed(lin, torch.randn(1, 2, requires_grad=True), policy="offload")
