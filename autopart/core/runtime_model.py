"""RuntimeDescription: what the runtime that will run a plan costs and holds, as the
profiler and the solver see it (no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field

from autopart.core.errors import PlanError

__all__ = ["RuntimeDescription", "BACKENDS"]

#: The runtimes :func:`autopart.compile` can hand stages to.
BACKENDS = ("local", "distributed")


@dataclass(frozen=True, slots=True, kw_only=True)
class RuntimeDescription:
    """PLACEHOLDER until the solver branch lands (merged by hand)."""

    name: str = "local"
    receive_buffers_per_microbatch: bool = False
    transfer_overhead_us: float = 0.0
    split_backward_us_per_node: float = 0.0
    split_backward_points: tuple[tuple[float, float], ...] = ()
    ranks_are_processes: bool = False
    transfer_steps: str | None = None
    split_engine: object | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.transfer_overhead_us >= 0.0:
            raise PlanError("x")
