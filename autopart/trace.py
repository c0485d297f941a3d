"""Traces for users: save a real step's trace, load one, and predict a plan's.

A measured trace comes from ``pipe.train_step(..., trace=True)`` (``pipe.last_trace``); the
predicted trace of the same plan from :func:`predict`. Both are
:class:`autopart.core.trace.Trace`: Chrome trace-event JSON that ``ui.perfetto.dev`` opens,
one track per rank. ``autopart.apps.figures.gantt`` draws them one above the other.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from autopart.core.errors import UsageError
from autopart.core.plan import Plan
from autopart.core.trace import Trace, TraceEvent
from autopart.solver.predict import Prediction

__all__ = ["Trace", "TraceEvent", "Prediction", "save", "load", "predict"]

def save(trace: Trace | Any, path: str | os.PathLike[str]) -> Path:
    """Write ``trace`` (or a pipeline's ``last_trace``) as Chrome trace-event JSON, atomically.

    Raises:
        UsageError: a pipeline that has not run a traced step (``train_step(trace=True)``).
    """
    if not isinstance(trace, Trace):
        last = getattr(trace, "last_trace", None)
        if not isinstance(last, Trace):
            raise UsageError("nothing to save: run pipe.train_step(..., trace=True) first, then "
                             "save(pipe, path) or save(pipe.last_trace, path)")
        trace = last
    trace.save(path)
    return Path(path)


def load(path: str | os.PathLike[str]) -> Trace:
    """Read a trace :func:`save` wrote (see :meth:`autopart.core.trace.Trace.load`)."""
    return Trace.load(path)


def predict(profile: Any, plan: Plan, **choices: Any) -> Prediction:
    """The cost model's replay of ``plan`` on ``profile``'s costs: simulated step time,
    per-rank peak bytes and the predicted trace.

    Args:
        profile: an :class:`autopart.Profile` (from :func:`autopart.plan_model`).
        plan: a plan solved on that profile.
        **choices: the options the plan was solved with, where they change costs
            (``optimizer_state_bytes_per_param_byte``); see ``Profile.options``.

    Raises:
        PlanError: the plan is for another graph or rank count.
    """
    from autopart.solver.predict import predict as _predict

    return _predict(plan, profile.costs, profile.cluster(),
                    profile.options(**choices))
