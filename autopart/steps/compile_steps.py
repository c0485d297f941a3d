"""compile_steps: plan, capture and build in turn, for one batch of example inputs."""

from __future__ import annotations

from typing import Any

from torch import nn

from autopart.core.capture import CapturedGraph
from autopart.core.plan import Plan
from autopart.core.progress import progress
from autopart.options import CompileOptions
from autopart.runtime.pipeline import Pipeline
from autopart.steps.build_step import build_pipeline
from autopart.steps.capture_step import capture_for_plan
from autopart.steps.plan_step import Loss, choose_plan

__all__ = ["compile_steps"]


def compile_steps(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], loss: Loss,
                  plan: Plan | None, options: CompileOptions, backend: str,
                  ) -> tuple[Pipeline, CapturedGraph]:
    """What :func:`autopart.compile` does once it has example inputs: choose the plan
    (:func:`autopart.steps.plan_step.choose_plan`), capture ``model`` at its microbatch
    (:func:`autopart.steps.capture_step.capture_for_plan`; at one row the plan moves onto
    that graph), build the stages and wrap them in
    the ``backend``'s runtime (:func:`autopart.steps.build_step.build_pipeline`). The phases
    show on stderr (:mod:`autopart.core.progress`); their seconds land in the pipeline's
    ``timings_s``.

    Args:
        model: the model.
        args, kwargs: example inputs, tensors ``(batch, ...)``; under torchrun with a 3D
            layout the global batch.
        loss: ``(loss_fn, example_target)``; ``loss_fn`` None = inference only.
        plan: a plan to replay, or None to profile and solve.
        options: the choices (already checked against ``backend`` and ``plan``).
        backend: ``"local"`` or ``"distributed"``.

    Returns:
        ``(pipeline, captured)``: the pipeline and the graph of one microbatch its stages
        were built from (a lazy pipeline keeps it to price another shape against).

    Raises:
        TraceError, ProfileError, PlanError, InfeasiblePlanError: as :func:`autopart.compile`.
    """
    timings: dict[str, float] = {}
    with progress():
        chosen, profiled = choose_plan(model, args, kwargs, loss, plan, options, backend,
                                       timings)
        chosen, captured = capture_for_plan(model, args, kwargs, chosen, profiled, timings)
        return (build_pipeline(model, captured, chosen, loss[0], options, backend, timings),
                captured)
