"""Worker processes for the communication-trace tests: a traced step of pp2 x dp2 (4 gloo
ranks) under ZeRO-0 with overlapped buckets and ZeRO-1/3 on FSDP2; rank 0 of each
replica writes its trace and the FSDP units each pipeline rank holds."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

from tests.distributed.rank_exit import end_rank
from tests.distributed.zero_worker import _lm_loss, _setup, tiny

BATCH, SEQ, VOCAB, M = 8, 8, 128, 2


def _pipeline(zero: int, layers: bool, mesh: Any) -> tuple[Any, ...]:
    """This rank's pipeline of a hand-made pp2 x dp2 GPT-2 plan (m = 2), ZeRO-0 with
    ``overlap_grad_reduce``, or ZeRO 1-3 (per layer with ``layers``)."""
    from autopart.codegen import build_stages
    from autopart.core.capture import capture
    from autopart.core.signature import InputSignature
    from autopart.runtime.distributed.pipeline import DistributedPipeline
    from tests.plans import even_positions, manual_plan

    model = tiny("gpt2")
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    dp_rank, part = mesh.get_local_rank("dp"), BATCH // 2
    mine = tokens[dp_rank * part:(dp_rank + 1) * part]
    captured = capture(model, (mine[: part // M],))
    plan = manual_plan(captured, even_positions(captured, 2), M, BATCH, schedule_kind="1f1b")
    plan = dataclasses.replace(plan, dp=2, zero_stage=zero, zero_layer_units=layers,
                               overlap_grad_reduce=zero == 0)
    pp_group, dp_group = mesh.get_group("pp"), mesh.get_group("dp")
    device = torch.device("cpu")
    stages = build_stages(captured, plan, [device] * 2, ranks={dist.get_rank(pp_group)})
    pipe = DistributedPipeline(model, stages, InputSignature.of(captured), device,
                               loss_fn=_lm_loss, pp_group=pp_group, dp_group=dp_group)
    return pipe, mine


def _units(pipe: Any) -> list[str]:
    """The FSDP units of this rank that hold parameters, by their trace label."""
    out = []
    for st in pipe.pipeline_stages:
        paths = pipe._sharding.units.get(st.stage_index, [])
        root = st.submod.stage
        own = [n for n, _ in root.named_parameters()
               if not any(n.startswith(p + ".") for p in paths)]
        out += paths + ([f"stage {st.stage_index}"] if own or not paths else [])
    return out


def traced(rank: int, world: int, port: int, cases: list[tuple[int, bool]],
           result_dir: str) -> None:
    """Per ``(zero, layers)`` case: an untraced step, then a traced one; dp rank 0 of the
    pipeline writes ``<case>.json`` (the trace's Chrome JSON and each pp rank's units)."""
    sys.path.insert(0, os.getcwd())
    from torch.distributed.device_mesh import init_device_mesh

    _setup(rank, world, port)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    for zero, layers in cases:
        pipe, tokens = _pipeline(zero, layers, mesh)
        pipe.train_step(tokens, target=tokens)  # FSDP's lazy init, AdamW-free warm-up
        for p in pipe.parameters():
            p.grad = None
        pipe.train_step(tokens, target=tokens, trace=True)
        assert pipe.last_trace is not None
        units = _units(pipe) if zero else []
        gathered: list[Any] = [None] * dist.get_world_size(mesh.get_group("pp"))
        dist.all_gather_object(gathered, units, group=mesh.get_group("pp"))
        if mesh.get_local_rank("dp") == 0 and mesh.get_local_rank("pp") == 0:
            path = os.path.join(result_dir, f"zero{zero}{'_layers' if layers else ''}.json")
            with open(path, "w") as f:
                json.dump({"trace": pipe.last_trace.to_chrome(), "units": gathered}, f)
        pipe.close()
    end_rank()


__all__ = ["traced"]
