"""build_stages: the one stage builder both runtimes use."""

import pytest
import torch
from torch import nn

from autopart.codegen import build_stages
from autopart.core.capture import capture
from autopart.core.errors import PlanError
from tests.plans import even_positions, manual_plan
from tests.zoo import ZOO


def test_a_rank_builds_its_own_stages_exactly_as_the_whole_pipeline_does() -> None:
    model, args, _, _ = ZOO["llama"]()
    captured = capture(model, tuple(a[:2] for a in args))
    plan = manual_plan(captured, even_positions(captured, 4), 4, 8,
                       schedule_kind="interleaved_1f1b", stages_per_rank=2)
    whole = build_stages(captured, plan, ["cpu", "cpu"])
    assert whole.local == (0, 1, 2, 3)
    sources = whole.sources()
    for rank in (0, 1):
        mine = build_stages(captured, plan, ["cpu", "cpu"], ranks={rank})
        assert mine.local == (rank, rank + 2)
        assert [m is None for m in mine.modules] == [s % 2 != rank for s in range(4)]
        assert mine.placement.owner == whole.placement.owner  # ownership over all stages
        assert mine.sources() == {s: sources[s] for s in mine.local}  # byte-identical
    # a second capture in the same process (its graph-module counter has moved on) too
    again = capture(model, tuple(a[:2] for a in args))
    assert build_stages(again, plan, ["cpu", "cpu"]).sources() == sources


def test_build_stages_refuses_what_does_not_match() -> None:
    model, args, _, _ = ZOO["mlp"]()
    captured = capture(model, tuple(a[:4] for a in args))
    plan = manual_plan(captured, even_positions(captured, 2), 2, 8)
    with pytest.raises(PlanError, match="the plan has 2 ranks but 3 devices"):
        build_stages(captured, plan, ["cpu"] * 3)
    with pytest.raises(PlanError, match=r"ranks \[0, 5\] are not all in the plan's ranks 0..1"):
        build_stages(captured, plan, ["cpu"] * 2, ranks={0, 5})
    other = capture(nn.Sequential(nn.Linear(32, 8), nn.Linear(8, 4)), (args[0][:4],))
    with pytest.raises(PlanError, match="a different model or config"):
        build_stages(other, plan, ["cpu"] * 2)


def test_fuse_wraps_only_the_built_stages() -> None:
    model, args, _, _ = ZOO["mlp"]()
    captured = capture(model, tuple(a[:4] for a in args))
    plan = manual_plan(captured, even_positions(captured, 2), 2, 8)
    built = build_stages(captured, plan, ["cpu"] * 2, ranks={1}, fuse=True)
    assert built.runners[0] is None and built.runners[1] is not built.modules[1]
    assert built.fuse_s >= 0.0
    out = built.runners[1](*[torch.randn(4, 32)])  # compiled on first call
    assert out[0].shape == (4, 4)


def test_a_meta_capture_finds_the_plans_cuts_by_node_name() -> None:
    from autopart.codegen import check_plan_matches
    from autopart.core.capture import op_nodes

    model, args, _, _ = ZOO["gpt2"]()
    on_cpu = capture(model, tuple(a[:2] for a in args))
    with torch.device("meta"):
        meta_model = ZOO["gpt2"]()[0]
    on_meta = capture(meta_model, tuple(a[:2].to("meta") for a in args))
    # transformers' attention takes a device-dependent branch: an extra clone per block
    assert len(op_nodes(on_meta.graph_module.graph)) > len(op_nodes(on_cpu.graph_module.graph))
    plan = manual_plan(on_cpu, even_positions(on_cpu, 3), 4, 8)
    with pytest.raises(PlanError, match="a different model or config"):
        check_plan_matches(plan, on_meta)
    positions = check_plan_matches(plan, on_meta, by_name=True)
    names = [n.name for n in op_nodes(on_meta.graph_module.graph)]
    assert [names[k - 1] for k in positions] == [c.after_node for c in plan.cuts]
    assert positions == sorted(positions) and positions != [c.position for c in plan.cuts]


def test_batchnorm_trains_across_stages_like_the_same_microbatching_by_hand() -> None:
    """BatchNorm's functional op saves the running statistics it read; the write-back after
    it must not invalidate them (it did: "modified by an inplace operation")."""
    import copy

    import autopart
    from autopart.core.capture import capture
    from autopart.core.microbatch import split_leaves
    from tests.plans import even_positions, manual_plan

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
        torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
        torch.nn.Flatten(), torch.nn.Linear(8 * 8 * 8, 5))
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 3, 8, 8), torch.randint(0, 5, (8,))
    loss_fn = torch.nn.functional.cross_entropy
    captured = capture(model, tuple(split_leaves([x], 2)[0]))
    plan = manual_plan(captured, even_positions(captured, 2), 2, 8, schedule_kind="1f1b")
    pipe = autopart.compile(model, (x,), loss_fn=loss_fn, plan=plan)
    loss = pipe.train_step(x, target=y)
    ref_loss = sum(loss_fn(reference(xm), ym) / 2 for xm, ym in zip(x.chunk(2), y.chunk(2),
                                                                      strict=True))
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=4e-5)
    grads = dict(pipe.named_parameters())
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name].grad, p.grad, rtol=1e-5, atol=4e-5)
    buffers = dict(pipe.named_buffers())
    for name, b in reference.named_buffers():
        torch.testing.assert_close(buffers[name], b, rtol=1e-6, atol=1e-6)


def test_a_plan_moves_onto_the_one_row_graph_of_the_same_model() -> None:
    """At one row torch.export drops the no-op expand of the positions GPT-2's mask is
    built from and renumbers the other expands (with the masks kept; capture's attention
    flags take them out, and the two graphs with them): the two-row plan's cuts are found
    by name there, and the plan then names that graph (fingerprint, cut positions, each
    stage's first and last node and node count)."""
    import dataclasses

    from autopart.codegen import check_plan_matches, plan_for_graph
    from autopart.core.capture import op_nodes

    model, (x,), _, _ = ZOO["gpt2"]()
    assert capture(model, (x[:2],)).fingerprint == capture(model, (x[:1],)).fingerprint
    two, one = (capture(model, (x[:n],), attention_flags=False) for n in (2, 1))
    assert two.fingerprint != one.fingerprint
    plan = manual_plan(two, even_positions(two, 3), 4, 8)
    assert plan_for_graph(plan, two) is plan  # made for this graph: unchanged
    with pytest.raises(PlanError, match="the plan was made for graph"):
        check_plan_matches(plan, one)
    moved = plan_for_graph(plan, one)
    assert moved.graph_fingerprint == one.fingerprint
    names = [n.name for n in op_nodes(one.graph_module.graph)]
    assert check_plan_matches(moved, one) == [c.position for c in moved.cuts]
    assert [c.after_node for c in moved.cuts] == [c.after_node for c in plan.cuts]
    assert sum(st.num_nodes for st in moved.stages) == len(names)
    assert [st.first_node for st in moved.stages] == [names[0]] + [
        c.before_node for c in moved.cuts]
    stranger = dataclasses.replace(plan, cuts=tuple(
        dataclasses.replace(c, after_node="nowhere_1") for c in plan.cuts))
    with pytest.raises(PlanError, match="not in this capture"):
        plan_for_graph(stranger, one)
