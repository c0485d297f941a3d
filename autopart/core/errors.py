"""Typed errors raised by autopart; each message names the limit, the values seen and the fix."""

from __future__ import annotations

__all__ = ["AutopartError", "TraceError", "PlanError", "InfeasiblePlanError", "ProfileError"]


class AutopartError(Exception):
    """Base class of every error autopart raises on purpose."""


class TraceError(AutopartError):
    """The model could not be captured with ``torch.export`` (non-strict)."""


class ProfileError(AutopartError):
    """A node could not be profiled on the requested device."""


class PlanError(AutopartError):
    """A plan (or a request for one) is malformed or does not match the model."""


class InfeasiblePlanError(PlanError):
    """No partition satisfies the request (stage count, memory cap)."""
