"""The schedule a distributed pipeline rank steps with: torch's schedule runtime over the
plan's actions, built per microbatch count and kept, run in torch's order of sends and
receives or with every receive posted first."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.pipelining import PipelineStage

from autopart.core.errors import PlanError
from autopart.core.plan import Plan
from autopart.core.plan_rules import overlaps_expert_exchanges
from autopart.core.schedule import build_schedule, forward_schedule
from autopart.core.v_schedules import V_SCHEDULE_KINDS, dualpipev_pairs
from autopart.runtime._torch_private import (
    ScheduleRuntime,
    new_schedule_runtime,
    overlap_pairs,
    receives_first_order,
)
from autopart.runtime.distributed._stages import side_thread

__all__ = ["StepSchedules"]


class StepSchedules:
    """One rank's schedule runtimes (:func:`autopart.runtime._torch_private.
    new_schedule_runtime`): the last one built, kept while steps keep its ``(m, training)``.
    A new runtime re-runs the stages' shape inference and buffer set-up (a P2P exchange);
    only one is kept because the stages hold the buffers of whichever runtime set them up
    last.

    Each runtime keeps torch's lowered action lists and the same with every receive posted
    first (:func:`autopart.runtime._torch_private.receives_first_order`), and runs in the one
    the caller asks for: gloo holds a send until its receive is posted, so gloo ranks post
    them all when the step starts; NCCL runs receives in stream order, where a receive posted
    first can hold back the same link's sends queued behind it.

    Args:
        stages: this rank's torch stages, in stage order.
        plan: the plan (its schedule kind and stages per rank).
        pp_size: pipeline ranks.
        recompute: the stages that recompute their forward in the backward
            (:func:`autopart.core.schedule.build_schedule`'s ``recompute``).
        loss_of_flat: the loss on the last stage's flat output, for training runtimes.
        gloo: the pipeline's sends and receives run on gloo.

    Training runtimes of a plan whose DualPipe-V pairs overlap their expert all-to-alls
    (:func:`autopart.core.plan_rules.overlaps_expert_exchanges`) run each pair
    (:func:`autopart.core.v_schedules.dualpipev_pairs`) as one action, its backward on a
    thread of its own (:func:`autopart.runtime._torch_private.overlap_pairs`).
    """

    def __init__(self, stages: Sequence[PipelineStage], plan: Plan, pp_size: int,
                 recompute: Sequence[int], loss_of_flat: Callable[[Any, Any], torch.Tensor],
                 gloo: bool) -> None:
        self._stages = list(stages)
        self._plan, self._pp_size, self._recompute = plan, pp_size, recompute
        self._loss_of_flat, self.gloo = loss_of_flat, gloo
        self._built: tuple[tuple[int, bool], ScheduleRuntime] | None = None
        self._pairs_on: bool | None = None  # the built runtime's pairs run at once
        self._orders: dict[bool, dict[int, list[Any]]] = {}

    def runtime(self, m: int, training: bool, receives_first: bool,
                overlap: bool = True) -> ScheduleRuntime:
        """The runtime for ``m`` microbatches (built unless the last one was for the same
        ``m`` and ``training``), set to post its receives first or in torch's order, and,
        where the plan's DualPipe-V pairs overlap, to run them at once (``overlap``) or one
        action after the other.

        Raises:
            PlanError: ``receives_first`` on a pipeline whose sends do not run on gloo.
        """
        if receives_first and not self.gloo:
            raise PlanError("receives_first=True is for gloo ranks only: NCCL runs receives in "
                            "stream order, so one posted first can hold back the sends queued "
                            "behind it; set pipe.receives_first = False")
        if self._built is None or self._built[0] != (m, training):
            runtime = self._new(m, training)
            lowered = runtime.pipeline_order_with_comms
            self._orders = {False: lowered,
                            True: {r: receives_first_order(a) for r, a in lowered.items()}}
            self._built, self._pairs_on = ((m, training), runtime), None
        runtime = self._built[1]
        runtime.pipeline_order_with_comms = self._orders[receives_first]
        if self._overlaps(training) and self._pairs_on != overlap:
            overlap_pairs(runtime, side_thread, on=overlap)
            self._pairs_on = overlap
        return runtime

    def _overlaps(self, training: bool) -> bool:
        plan = self._plan
        return training and overlaps_expert_exchanges(plan.schedule_kind, plan.ep, plan.tp,
                                                      plan.cp, plan.zero_stage)

    def _new(self, m: int, training: bool) -> ScheduleRuntime:
        # gradients are divided by m once per step in train_step, not by each stage: torch
        # divides every stage's parameters, so a tensor two local stages share (a tied one)
        # would be divided twice
        kind, v = self._plan.schedule_kind, self._plan.stages_per_rank
        # the V schedules' inference runs their stages' forwards only (torch 2.13's runtime
        # cannot run a V training schedule in eval, and DualPipe-V's needs m >= 2p, which an
        # inference batch need not have); the other kinds hand torch their training
        # schedule, whose backwards its eval skips
        actions = (forward_schedule(self._pp_size, m, v, kind=kind)
                   if not training and kind in V_SCHEDULE_KINDS
                   else build_schedule(kind, self._pp_size, m, v, recompute=self._recompute))
        pairs = [dualpipev_pairs(self._pp_size, m, r) for r in range(self._pp_size)] \
            if self._overlaps(training) else []
        return new_schedule_runtime(self._stages, m, actions,
                                    self._loss_of_flat if training else None, pairs)
