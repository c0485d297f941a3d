"""Every error autopart raises on purpose; each message names the value, the limit and the fix."""

from __future__ import annotations

__all__ = ["AutopartError", "TraceError", "ProfileError", "PlanError", "InfeasiblePlanError",
           "BaselineNotApplicable", "CheckpointError", "PipelineFailure", "UsageError"]


class AutopartError(Exception):
    """Base class of every error autopart raises on purpose."""


class TraceError(AutopartError):
    """The model could not be captured with ``torch.export`` (non-strict)."""


class ProfileError(AutopartError):
    """A node could not be profiled on the requested device."""


class PlanError(AutopartError):
    """A plan (or a request for one) is malformed, conflicts with the arguments, or does not
    match the model."""


class InfeasiblePlanError(PlanError):
    """No partition satisfies the request (stage count, memory cap)."""


class BaselineNotApplicable(PlanError):
    """A baseline cannot make the requested number of non-empty stages on this graph."""


class CheckpointError(PlanError):
    """A checkpoint directory is missing, damaged, or from another model."""


class PipelineFailure(AutopartError):
    """A rank of a multi-process pipeline failed or stopped responding."""


class UsageError(AutopartError):
    """A command-line argument is wrong (the CLI prints the message and exits with code 2)."""
