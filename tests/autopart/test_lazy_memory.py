"""A lazy pipeline's memory at a new input shape: the plan's per-rank peaks predicted there
(:func:`autopart.steps.shape_memory.peaks_at_shape`) and a shape that no longer fits the
devices refused before anything is built."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch import nn

import autopart
import autopart.api as api
from autopart.core.capture import capture
from autopart.core.cluster import PRESETS
from autopart.layout_planning import host_ranks_topology
from autopart.profiler import profile_analytical
from autopart.runtime.description import describe
from autopart.solver import SolveOptions
from autopart.solver.layout_search import LayoutOptions, solve_layout
from autopart.steps.shape_memory import peaks_at_shape
from tests.autopart.test_lazy import _gpt2, _tokens
from tests.zoo import _lm_loss


def _lazy(model: nn.Module) -> Any:
    return autopart.compile(model, loss_fn=_lm_loss, devices=["cpu", "cpu"], num_microbatches=2,
                            schedule_kind="1f1b", recompute=False, time_limit_s=2.0)


def _key(pipe: Any, seq: int) -> Any:
    return next(k for k in pipe.pipelines if k[1][0][0] == (seq,))


def test_a_new_shape_gets_its_peaks_predicted(capsys: pytest.CaptureFixture[str]) -> None:
    pipe = _lazy(_gpt2())
    for step, seq in enumerate((8, 32, 4)):
        x = _tokens(step, seq)
        pipe.train_step(x, target=x)
    planned = tuple(r.peak_memory_bytes for r in pipe.plan.ranks)
    longer, shorter = pipe.peaks_bytes[_key(pipe, 32)], pipe.peaks_bytes[_key(pipe, 4)]
    assert _key(pipe, 8) not in pipe.peaks_bytes  # the planned shape: the plan's own figures
    assert longer.planned_bytes == shorter.planned_bytes == planned
    assert all(n > p for n, p in zip(longer.bytes, planned, strict=True))
    assert all(0 < n < p for n, p in zip(shorter.bytes, planned, strict=True))
    assert longer.capacity_bytes == (PRESETS["cpu"].memory_bytes,) * 2
    assert longer.over() == []
    said = capsys.readouterr().out
    assert (f"new input shape (4, 32): captured and split at the plan's cuts (no profiling); its "
            f"predicted step is the first shape's, its largest predicted peak "
            f"{max(longer.bytes) / 2**20:.1f} MiB (planned {max(planned) / 2**20:.1f} MiB)"
            in said), said


def test_a_shape_over_the_devices_memory_is_refused_before_building(
        monkeypatch: pytest.MonkeyPatch) -> None:
    pipe = _lazy(_gpt2())
    x = _tokens(0, 8)
    first_loss = pipe.train_step(x, target=x)
    cap = max(r.peak_memory_bytes for r in pipe.plan.ranks) + 1  # the planned shape fits
    real = api.cluster_for_devices

    def capped(devices: list[str]) -> Any:
        cluster = real(devices)
        return dataclasses.replace(cluster, devices=tuple(
            dataclasses.replace(d, memory_bytes=cap) for d in cluster.devices))

    monkeypatch.setattr(api, "cluster_for_devices", capped)
    longer = _tokens(1, 32)
    with pytest.raises(autopart.PlanError, match=(
            r"inputs \(4, 32\) no longer fit the plan made at \(4, 8\): rank \d \(cpu\) is "
            r"predicted to peak at .* GiB there, over its device's .* GiB \(planned: .* at "
            r"\(4, 8\)\)\. Plan at the longest shape instead.*recompute=True.*cp=")):
        pipe.train_step(longer, target=longer)
    assert len(pipe.pipelines) == 1  # nothing built for it
    shorter = _tokens(2, 4)
    pipe.train_step(shorter, target=shorter)  # under the planned peaks: fits
    torch.testing.assert_close(pipe.train_step(x, target=x), first_loss)  # still runs
    monkeypatch.setattr(api, "cluster_for_devices", real)
    pipe.train_step(longer, target=longer)
    assert max(pipe.peaks_bytes[_key(pipe, 32)].bytes) > cap  # what the cap refused


def test_tensor_parallel_shares_the_growth() -> None:
    # a (tp, pp, dp) layout is priced as the layout search prices it: with tp 2 each GPU
    # holds half of the activations the tp pairs shard, so a longer sequence adds less
    model = _gpt2()
    short, long = (capture(model, (_tokens(0, seq)[:2],)) for seq in (8, 32))
    spec = PRESETS["h100-sxm"]
    options = SolveOptions(batch_size=8, num_microbatches=2, schedule_kind="1f1b",
                           recompute=False, runtime=describe("distributed"), time_limit_s=2.0)
    growth = {}
    for tp in (1, 2):
        layout = LayoutOptions(num_gpus=2 * tp, topology=host_ranks_topology(2 * tp, spec),
                               tp=tp, dp=1, zero_stage=0)
        plan = solve_layout(profile_analytical(short, None, spec), spec, options, layout)
        assert (plan.tp, len(plan.ranks)) == (tp, 2)
        peaks = peaks_at_shape(plan, short, long, (spec, spec), training=True,
                               state_factor=2.0, runtime=describe("distributed"))
        growth[tp] = [n - p for n, p in zip(peaks.bytes, peaks.planned_bytes, strict=True)]
        assert all(g > 0 for g in growth[tp])
    assert all(g2 < g1 for g1, g2 in zip(growth[1], growth[2], strict=True))
