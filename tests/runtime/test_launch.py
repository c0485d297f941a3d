"""A rank of a meta-device model materialises only the modules its own stages read."""

import torch

from autopart.codegen import build_stages
from autopart.core.capture import capture, on_meta
from autopart.runtime.distributed import launch
from tests.plans import even_positions, manual_plan
from tests.zoo import ZOO


def test_a_rank_materialises_only_what_its_stages_read() -> None:
    with torch.device("meta"):
        model, args, _, _ = ZOO["gpt2"]()
    assert on_meta(model)
    captured = capture(model, tuple(a[:2].to("meta") for a in args))
    plan = manual_plan(captured, even_positions(captured, 2), 4, 8)
    built = build_stages(captured, plan, ["cpu", "cpu"], ranks={1}, cuts_by_name=True,
                         tensor_of=launch.materialise(model, torch.device("cpu")))
    stage = built.modules[1]
    assert stage is not None and built.modules[0] is None
    assert all(not t.is_meta for t in list(stage.parameters()) + list(stage.buffers()))
    still_meta = {n for n, p in model.named_parameters() if p.is_meta}
    assert still_meta and still_meta != {n for n, _ in model.named_parameters()}
    assert "transformer.h.0.attn.c_attn.weight" in still_meta  # stage 0's, never materialised
    # the capture's device literals (stage 0's arange(..., device=meta) for the position ids)
    # point at the stage's device
    first = build_stages(captured, plan, ["cpu", "cpu"], ranks={0}, cuts_by_name=True,
                         tensor_of=launch.materialise(model, torch.device("cpu"))).modules[0]
    assert first is not None
    literals = [v for n in first.graph.nodes for v in [*n.args, *n.kwargs.values()]
                if isinstance(v, torch.device)]
    assert literals and all(v == torch.device("cpu") for v in literals)
