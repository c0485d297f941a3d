"""The parts of a plan file (cuts, stages, ranks, the solver's and the baselines' reports,
sharded parameters) and the field checks every part and the :class:`autopart.core.plan.Plan`
run on load: a field holds what its annotation says, nothing is coerced."""

from __future__ import annotations

import math
import reprlib
from dataclasses import MISSING, dataclass, fields
from typing import Any

from autopart.core.errors import PlanError
from autopart.core.plan_rules import FIX, SHARD_STYLES

__all__ = ["Cut", "StagePlan", "RankPlan", "SolverReport", "BaselineReport", "ParetoPoint",
           "LowerBounds", "ShardedParameter", "check_fields", "build_record", "record_kwargs",
           "unique_keys", "listed"]


@dataclass(frozen=True, slots=True)
class Cut:
    """A chosen cut: between op node ``position - 1`` (``after_node``) and ``position`` (``before_node``).

    Positions index the CostGraph's op nodes in topological order.
    ``crossing_bytes`` sizes the tensors crossing it, per microbatch.
    """

    position: int
    after_node: str
    before_node: str
    crossing_bytes: int

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True, slots=True)
class StagePlan:
    """One pipeline stage: a contiguous run of op nodes, and what it is predicted to cost.

    Times are per microbatch, µs; memory in bytes. ``recompute_kept``: under the plan's
    ``recompute_policy="op"``, the captured graph's nodes (FX names) whose outputs this
    recomputing stage keeps from its forward to its backward; every other node of it runs
    again in the backward. Empty otherwise (and in plans written before it).
    """

    stage_index: int
    rank: int
    device: str
    first_node: str
    last_node: str
    num_nodes: int
    module_range: tuple[str, str]
    num_parameters: int
    param_bytes: int
    predicted_fwd_us: float
    predicted_bwd_us: float
    predicted_comm_us: float
    predicted_peak_memory_bytes: int
    recompute: bool = False
    recompute_kept: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True, slots=True)
class RankPlan:
    """One rank (device) and its predicted peak memory, bytes."""

    rank: int
    device: str
    stage_indices: tuple[int, ...]
    peak_memory_bytes: int

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True, slots=True)
class SolverReport:
    """What the solver said: CP-SAT status, objective and best bound (µs), relative gap, wall time (s)."""

    status: str
    objective: float
    bound: float
    gap: float
    wall_s: float
    name: str = "cp-sat"

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True, slots=True)
class BaselineReport:
    """A baseline partitioner's result on the same costs.

    ``recompute`` is true when the baseline's cuts only fit the memory caps with every stage
    recomputing its forward (activation checkpointing on throughout, as its users would set
    it); ``fits`` says whether its peak fits the caps even so.
    """

    name: str
    predicted_step_time_us: float
    peak_memory_bytes: int
    recompute: bool = False
    fits: bool = True

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True, slots=True)
class ParetoPoint:
    """One non-dominated (step time µs, largest rank peak memory bytes) point the search saw."""

    predicted_step_time_us: float
    peak_memory_bytes: int

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True, slots=True)
class LowerBounds:
    """Physical lower bounds the plan is certified against, and its ratio to them.

    Attributes:
        step_time_us: total compute of one step spread evenly over the ranks, µs (no bubble,
            no communication): no plan can be faster.
        peak_memory_bytes: total parameter state spread evenly over the ranks, bytes: no plan's
            largest rank can hold less.
        step_time_ratio: predicted step time / ``step_time_us`` (>= 1).
        peak_memory_ratio: largest rank peak / ``peak_memory_bytes`` (>= 1).
    """

    step_time_us: float
    peak_memory_bytes: int
    step_time_ratio: float
    peak_memory_ratio: float

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True, slots=True)
class ShardedParameter:
    """A parameter tensor parallelism splits over the tp GPUs of a group (absent: replicated).

    ``style``: ``"column"`` (split by output feature; a column-parallel linear's weight and
    bias), ``"row"`` (split by input feature; a row-parallel linear's weight) or ``"vocab"``
    (split by vocabulary row; the token embedding and the head that shares it).
    """

    name: str
    style: str

    def __post_init__(self) -> None:
        check_fields(self)
        if self.style not in SHARD_STYLES:
            raise PlanError(f"invalid plan: sharded parameter {self.name!r} has style "
                            f"{self.style!r}; expected one of {SHARD_STYLES}")


_TUPLE_FIELDS = {"module_range", "stage_indices", "recompute_kept"}
#: What each field annotation admits: (test, description for the message).
_KINDS: dict[str, tuple[Any, str]] = {
    "int": (lambda v: _is_int(v) and v >= 0, "an integer >= 0 (not a bool or a fraction)"),
    "float": (lambda v: _is_number(v), "a finite number"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "tuple[str, str]": (lambda v: isinstance(v, tuple) and len(v) == 2
                        and all(isinstance(x, str) for x in v), "a list of two strings"),
    "tuple[str, ...]": (lambda v: isinstance(v, tuple) and all(isinstance(x, str) for x in v),
                        "a list of strings"),
    "tuple[int, ...]": (lambda v: isinstance(v, tuple) and all(_is_int(x) and x >= 0 for x in v),
                        "a list of integers >= 0"),
    "dict[str, str]": (lambda v: isinstance(v, dict) and all(isinstance(k, str) and
                                                             isinstance(x, str)
                                                             for k, x in v.items()),
                       "an object of strings (package -> version)"),
    "SolverReport": (lambda v: isinstance(v, SolverReport), "a solver report object"),
    "LowerBounds | None": (lambda v: v is None or isinstance(v, LowerBounds),
                           "a lower-bounds object or null"),
    "tuple[Cut, ...]": (lambda v: _tuple_of(v, Cut), "a list of cuts"),
    "tuple[StagePlan, ...]": (lambda v: _tuple_of(v, StagePlan), "a list of stages"),
    "tuple[RankPlan, ...]": (lambda v: _tuple_of(v, RankPlan), "a list of ranks"),
    "tuple[BaselineReport, ...]": (lambda v: _tuple_of(v, BaselineReport), "a list of baselines"),
    "tuple[ParetoPoint, ...]": (lambda v: _tuple_of(v, ParetoPoint), "a list of Pareto points"),
    "tuple[ShardedParameter, ...]": (lambda v: _tuple_of(v, ShardedParameter),
                                     "a list of sharded parameters"),
}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return False
    try:
        return math.isfinite(float(v))
    except OverflowError:  # an integer beyond float's range
        return False


def _tuple_of(v: Any, cls: type) -> bool:
    return isinstance(v, tuple) and all(isinstance(x, cls) for x in v)


def _show(value: Any) -> str:
    return reprlib.repr(value)


def check_fields(obj: Any, where: str | None = None) -> None:
    """Every field of a plan dataclass holds what its annotation says (no coercion).

    ``where`` prefixes the field's name in the message (default: the class name).
    """
    _check_values(type(obj), {f.name: getattr(obj, f.name) for f in fields(obj)},
                  f"{type(obj).__name__}." if where is None else where)


def _check_values(cls: type, values: dict[str, Any], where: str) -> None:
    for f in fields(cls):
        if f.name not in values:
            continue
        value = values[f.name]
        test, desc = _KINDS[str(f.type)]
        if not test(value):
            raise PlanError(f"invalid plan: {where}{f.name}={_show(value)} must be {desc}; {FIX}")


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads`` hook: a key given twice is refused (JSON would keep the last silently)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise PlanError(f"invalid plan: key {key!r} appears twice in one object; keep one")
        out[key] = value
    return out


def listed(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list | tuple):
        raise PlanError(f"invalid plan: {where}={_show(value)} must be a list; {FIX}")
    return list(value)


def record_kwargs(cls: type, d: Any, where: str) -> dict[str, Any]:
    """``d``'s fields as keyword arguments of ``cls``: unknown and missing keys refused."""
    what = where or "plan"
    if not isinstance(d, dict):
        raise PlanError(f"invalid plan: {what} must be a JSON object, got {type(d).__name__}")
    known = {f.name for f in fields(cls)}
    unknown = set(d) - known
    if unknown:
        raise PlanError(f"invalid plan: unknown {what} field(s) {sorted(unknown)}; "
                        f"known: {sorted(known)}")
    required = [f.name for f in fields(cls)
                if f.default is MISSING and f.default_factory is MISSING]
    missing = [k for k in required if k not in d]
    if missing:
        raise PlanError(f"invalid plan: missing field {missing[0]!r}"
                        f"{f' in {where}' if where else ''}; {FIX}")
    return {k: tuple(v) if k in _TUPLE_FIELDS and isinstance(v, list) else v
            for k, v in d.items()}


def build_record(cls: type, d: Any, where: str) -> Any:
    kwargs = record_kwargs(cls, d, where)
    _check_values(cls, kwargs, f"{where}.")
    return cls(**kwargs)
