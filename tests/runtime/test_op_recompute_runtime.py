"""The plan's ``"op"`` recompute policy in the one-process runtime: each recomputing stage
keeps the outputs of the nodes its ``recompute_kept`` lists, and runs the rest again. A
plan keeping any subset trains as the unpartitioned model does, and the kernels of kept
nodes run once per step where the others run twice (the distributed runtime's case is in
``tests/distributed/test_selective_recompute_ranks.py``)."""

from __future__ import annotations

import copy
import dataclasses
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import autopart
from autopart.core.capture import capture, op_nodes
from autopart.core.op_names import VIEW_OPS
from autopart.core.recompute_policy import op_keepable
from tests.numerics import KernelCounts, assert_train_step_matches
from tests.plans import even_positions, manual_plan
from tests.zoo import ZOO

M = 4  # microbatches; batch 8 -> microbatch 2

_CAPTURED: dict[str, tuple[Any, ...]] = {}


def _pipe(name: str, kind: str, num_stages: int, v: int,
          keep: Callable[[int, Any], bool] | None) -> tuple[Any, ...]:
    """A pipeline of ``ZOO[name]`` from a hand-written plan whose every stage recomputes
    under ``"op"`` keeping the op nodes ``keep(index, node)`` accepts (None: no stage
    recomputes), built by ``autopart.compile(plan=...)``, and an untouched copy of the
    model."""
    if name not in _CAPTURED:
        model, args, target, loss_fn = ZOO[name]()
        _CAPTURED[name] = (model, capture(model, tuple(a[: 8 // M] for a in args)), args,
                           target, loss_fn)
    model0, captured0, args, target, loss_fn = _CAPTURED[name]
    model, captured = copy.deepcopy((model0, captured0))
    positions = even_positions(captured, num_stages)
    plan = manual_plan(captured, positions, M, 8, schedule_kind=kind, stages_per_rank=v,
                       recompute=keep is not None)
    if keep is not None:
        nodes = op_nodes(captured.graph_module.graph)
        bounds = [0, *positions, len(nodes)]
        stages = tuple(dataclasses.replace(st, recompute_kept=tuple(
            nd.name for i, nd in enumerate(nodes[bounds[s]:bounds[s + 1]], bounds[s])
            if keep(i, nd))) for s, st in enumerate(plan.stages))
        plan = dataclasses.replace(plan, stages=stages, recompute_policy="op")
    pipe = autopart.compile(model, args, loss_fn=loss_fn, plan=plan,
                            devices=["cpu"] * (num_stages // v))
    return pipe, copy.deepcopy(model0), args, target, loss_fn


def _every_other_keepable(i: int, node: Any) -> bool:
    return i % 2 == 0 and op_keepable(str(node.target), VIEW_OPS)


LAYOUTS = [("gpt2", "1f1b", 2, 1), ("llama", "interleaved_1f1b", 4, 2),
           ("bert", "zero_bubble", 2, 1)]


@pytest.mark.parametrize(("name", "kind", "num_stages", "v"), LAYOUTS,
                         ids=[f"{n}-{k}-S{s}-v{v}" for n, k, s, v in LAYOUTS])
def test_op_recompute_matches_the_unpartitioned_model(name: str, kind: str, num_stages: int,
                                                      v: int) -> None:
    """Every second keepable node kept (Llama: grouped-query attention; BERT under ZB-H1,
    whose recomputing stages run a whole B)."""
    pipe, reference, args, target, loss_fn = _pipe(name, kind, num_stages, v,
                                                   _every_other_keepable)
    assert pipe.plan.recompute_policy == "op"
    assert all(st.recompute_kept for st in pipe.plan.stages)
    assert_train_step_matches(pipe, reference, args, target, loss_fn, atol=4e-5)


def _counts(keep: Callable[[int, Any], bool] | None) -> Counter[str]:
    pipe, _, args, target, _ = _pipe("gpt2", "1f1b", 2, 1, keep)
    with KernelCounts() as kernels:
        pipe.train_step(*args, target=target)
    return kernels.count


def test_kept_nodes_run_once_and_the_others_twice() -> None:
    """GPT-2 with only its layer norms kept: ``native_layer_norm`` runs as often as without
    recompute, its Conv1D matmuls (``addmm``) as often as under a whole-stage recompute;
    with only the matmuls kept, the other way round."""
    none, nothing = _counts(None), _counts(lambda i, nd: False)
    norms = _counts(lambda i, nd: str(nd.target) == "aten.layer_norm.default")
    matmuls = _counts(lambda i, nd: str(nd.target) in ("aten.addmm.default",
                                                       "aten.linear.default"))
    ln, mm = "aten.native_layer_norm.default", "aten.addmm.default"
    assert none[ln] < nothing[ln] and none[mm] < nothing[mm]
    assert norms[ln] == none[ln] and norms[mm] == nothing[mm]
    assert matmuls[mm] == none[mm] and matmuls[ln] == nothing[ln]


class _Policy(TorchDispatchMode):
    """Asks :func:`autopart.codegen.recompute.op_policy` about every kernel, as selective
    checkpointing does, and records its answers in ``seen``."""

    def __init__(self, seen: list[tuple[str, Any]]) -> None:
        super().__init__()
        self.seen = seen

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        from autopart.codegen.recompute import op_policy

        self.seen.append((str(func), op_policy(None, func)))  # type: ignore[arg-type]
        return func(*args, **(kwargs or {}))


def test_a_kept_linear_does_not_keep_its_input_view() -> None:
    """A kept node's view kernels are recomputed, not kept: keeping a 3-D linear's
    ``view`` of its input would hold the unkept input alive. The same node unmarked keeps
    nothing."""
    from torch.utils.checkpoint import CheckpointPolicy

    from autopart.codegen.recompute import mark_kept

    seen: list[tuple[str, CheckpointPolicy]] = []

    class _Linear(torch.nn.Module):
        def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return torch.ops.aten.linear.default(x, w)

    x, w = torch.randn(2, 3, 4), torch.randn(5, 4)
    plain, marked = torch.fx.symbolic_trace(_Linear()), torch.fx.symbolic_trace(_Linear())
    name = next(n.name for n in marked.graph.nodes if n.op == "call_function")
    assert mark_kept(marked, [name, "not_in_the_graph"]) == 1
    with _Policy(seen):
        marked(x, w)
    kept = [f for f, pol in seen if pol == CheckpointPolicy.MUST_SAVE]
    assert kept == ["aten.mm.default"], seen
    seen.clear()
    with _Policy(seen):
        plain(x, w)
    assert seen and all(pol == CheckpointPolicy.PREFER_RECOMPUTE for _, pol in seen)


def test_a_stage_keeping_nothing_runs_plain_checkpointing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Under "op", a recomputed stage with no kept node and no tp reduction runs torch's
    plain checkpoint (no selective checkpointing context), as the solver prices it; marked,
    it runs under the op policy. The same numbers either way."""
    import autopart.codegen.recompute as recompute

    selective: list[object] = []
    real = recompute.selective_context

    def counted(stage: Any, *args: Any) -> Any:
        selective.append(stage)
        return real(stage, *args)

    monkeypatch.setattr(recompute, "selective_context", counted)

    class _Block(torch.nn.Module):
        def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return torch.ops.aten.gelu.default(torch.ops.aten.linear.default(x, w))

    plain, marked = torch.fx.symbolic_trace(_Block()), torch.fx.symbolic_trace(_Block())
    name = next(n.name for n in marked.graph.nodes if n.op == "call_function")
    assert recompute.mark_kept(marked, [name]) == 1
    assert not recompute.keeps_any(plain) and recompute.keeps_any(marked)
    grads = []
    for stage in (plain, marked):
        x = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(0), requires_grad=True)
        w = torch.randn(5, 4, generator=torch.Generator().manual_seed(1), requires_grad=True)
        recompute.run_recomputed(stage, x, w, policy="op").sum().backward()
        grads.append((x.grad, w.grad))
    assert selective == [marked]
    torch.testing.assert_close(grads[0], grads[1])


def test_a_kept_attention_keeps_its_output_not_the_float_mask_it_makes() -> None:
    """``scaled_dot_product_attention`` with a boolean mask dispatches ``aten.where`` (the
    mask as floats, 4 bytes per query-key pair) before its attention kernel: only the
    attention kernel's output is kept, the node's output the solver prices. Twice, with a
    random op kept in between: the kernels the node dispatches are found by running it
    apart once per argument shapes, which leaves the random state as it was."""
    from torch.utils.checkpoint import CheckpointPolicy

    from autopart.codegen.recompute import mark_kept

    class _Attention(torch.nn.Module):
        def forward(self, q: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            a = torch.ops.aten.scaled_dot_product_attention.default(q, q, q, mask)
            return torch.ops.aten.add.Tensor(a, torch.ops.aten.rand_like.default(a))

    q = torch.randn(1, 2, 8, 4)
    mask = torch.ones(8, 8, dtype=torch.bool).tril()
    marked = torch.fx.symbolic_trace(_Attention())
    names = [n.name for n in marked.graph.nodes if n.op == "call_function"]
    assert mark_kept(marked, names) == 3
    seen: list[tuple[str, CheckpointPolicy]] = []
    for _ in range(2):
        seen.clear()
        torch.manual_seed(0)
        with _Policy(seen):
            out = marked(q, mask)
        torch.manual_seed(0)
        assert torch.equal(out, _Attention()(q, mask))
        kernels = [f for f, _ in seen]
        assert "aten.where.self" in kernels or "aten.where.ScalarSelf" in kernels, kernels
        kept = [f for f, pol in seen if pol == CheckpointPolicy.MUST_SAVE]
        assert kept == ["aten._scaled_dot_product_flash_attention_for_cpu.default",
                        "aten.rand_like.default", "aten.add.Tensor"], seen


def _two_kernels(x: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten.mul.Tensor(torch.ops.aten.add.Tensor(x, 1.0), 2.0)


torch.fx.wrap("_two_kernels")


def test_a_kept_node_codegen_wrote_keeps_every_kernel_and_is_not_run_apart() -> None:
    """A node whose target is not an aten op (tp's, cp's and ep's nodes issue collectives)
    is not run apart to count its kernels: every keepable kernel it dispatches is kept, as
    before the last-kernel rule."""
    from torch.utils.checkpoint import CheckpointPolicy

    from autopart.codegen.recompute import mark_kept

    class _Module(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return _two_kernels(x)

    marked = torch.fx.symbolic_trace(_Module())
    names = [n.name for n in marked.graph.nodes if n.op == "call_function"]
    assert mark_kept(marked, names) == 1
    seen: list[tuple[str, CheckpointPolicy]] = []
    x = torch.randn(3)
    with _Policy(seen):
        marked(x)
    assert seen == [("aten.add.Tensor", CheckpointPolicy.MUST_SAVE),
                    ("aten.mul.Tensor", CheckpointPolicy.MUST_SAVE)]
