"""autopart: automatic pipeline partitioning for PyTorch models."""

from __future__ import annotations

from typing import Any

__all__ = ["compile", "load", "Plan", "PipelinedModule", "TraceError", "PlanError",
           "InfeasiblePlanError", "__version__"]
__version__ = "0.1.0"

# Exports resolve lazily (PEP 562) so that `import autopart.solver` or `autopart.core.plan`
# never pulls in torch: the solver layer stays pure Python.
_LAZY = {
    "compile": ("autopart.api", "compile"),
    "load": ("autopart.runtime.checkpoint", "load"),
    "PipelinedModule": ("autopart.runtime.local", "PipelinedModule"),
    "Plan": ("autopart.core.plan", "Plan"),
    "TraceError": ("autopart.core.errors", "TraceError"),
    "PlanError": ("autopart.core.errors", "PlanError"),
    "InfeasiblePlanError": ("autopart.core.errors", "InfeasiblePlanError"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'autopart' has no attribute {name!r}")
