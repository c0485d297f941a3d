"""Plan: the solver's decision and the file users keep, diff and replay (JSON, validated on load)."""

from __future__ import annotations

import json
import math
import os
import reprlib
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any

from autopart.core.errors import PlanError
from autopart.core.jsonio import dumps, write_text_atomic
from autopart.core.plan_rules import (
    FIX,
    OPTIMIZE_TARGETS,
    PLAN_SCHEMA_VERSION,
    READABLE_SCHEMA_VERSIONS,
    SCHEDULE_KINDS,
    SHARD_STYLES,
    check_plan_invariants,
)

__all__ = ["Cut", "StagePlan", "RankPlan", "SolverReport", "BaselineReport", "ParetoPoint",
           "LowerBounds", "ShardedParameter", "Plan",
           "PLAN_SCHEMA_VERSION", "READABLE_SCHEMA_VERSIONS", "SCHEDULE_KINDS",
           "OPTIMIZE_TARGETS", "SHARD_STYLES"]



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
        _check_fields(self)


@dataclass(frozen=True, slots=True)
class StagePlan:
    """One pipeline stage: a contiguous run of op nodes, and what it is predicted to cost.

    Times are per microbatch, µs; memory in bytes.
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

    def __post_init__(self) -> None:
        _check_fields(self)


@dataclass(frozen=True, slots=True)
class RankPlan:
    """One rank (device) and its predicted peak memory, bytes."""

    rank: int
    device: str
    stage_indices: tuple[int, ...]
    peak_memory_bytes: int

    def __post_init__(self) -> None:
        _check_fields(self)


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
        _check_fields(self)


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
        _check_fields(self)


@dataclass(frozen=True, slots=True)
class ParetoPoint:
    """One non-dominated (step time µs, largest rank peak memory bytes) point the search saw."""

    predicted_step_time_us: float
    peak_memory_bytes: int

    def __post_init__(self) -> None:
        _check_fields(self)


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
        _check_fields(self)


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
        _check_fields(self)
        if self.style not in SHARD_STYLES:
            raise PlanError(f"invalid plan: sharded parameter {self.name!r} has style "
                            f"{self.style!r}; expected one of {SHARD_STYLES}")


@dataclass(frozen=True, slots=True)
class Plan:
    """A complete partition and schedule decision for one model, batch and cluster.

    Attributes:
        graph_fingerprint: structure hash of the captured graph it was made for.
        cluster_fingerprint: devices it was made for (``Cluster.fingerprint``).
        cost_source: ``CostGraph.source`` of the costs it was solved on.
        library_versions: package -> version (torch, ortools, autopart) at solve time.
        optimize: ``"speed"`` or ``"memory"``.
        batch_size: the full batch (leading dimension) it was made for.
        num_microbatches: m; ``batch_size`` is divisible by it.
        schedule_kind: one of ``SCHEDULE_KINDS``.
        cuts: the S - 1 chosen cuts, ascending.
        stages: the S stages.
        ranks: per rank, the stages it runs and its predicted peak memory.
        predicted_step_time_us: one training step (all microbatches, fwd + bwd), µs.
        bubble_fraction: idle share of a rank's step time under the schedule, 0..1.
        solver: the solver's status, objective, bound, gap and wall time.
        baselines: other partitioners on the same costs (may be empty).
        stages_per_rank: v, virtual stages per rank (1 without interleaving; 2 for the V
            schedules ``zbv`` and ``dualpipev``, which place rank r's stages at r and
            2p - 1 - r; every other kind places stage s on rank s % p).
        pareto: the (step time, peak memory) frontier of the candidates the solver evaluated,
            by ascending time (may be empty).
        lower_bounds: physical lower bounds and the plan's ratio to them (None when absent).
        tp: tensor-parallel degree: every rank is a group of tp GPUs of one host (default 1).
        dp: data-parallel replicas of the whole pipeline (default 1); ``batch_size`` is the
            global batch over all of them, each replica runs ``batch_size / dp`` rows in
            ``num_microbatches`` microbatches.
        zero_stage: 0-3, what dp shards: nothing, optimizer state, + gradients, + parameters.
        sharded_parameters: the parameters tp splits and how (empty when tp = 1).
        model_flops: FLOPs of one training step of the whole model at ``batch_size``
            (forward + backward, recompute excluded), 0 when not recorded.
        Step time, stage and rank figures are per GPU (one GPU of a rank's tp group).
    """

    graph_fingerprint: str
    cluster_fingerprint: str
    cost_source: str
    library_versions: dict[str, str]
    optimize: str
    batch_size: int
    num_microbatches: int
    schedule_kind: str
    cuts: tuple[Cut, ...]
    stages: tuple[StagePlan, ...]
    ranks: tuple[RankPlan, ...]
    predicted_step_time_us: float
    bubble_fraction: float
    solver: SolverReport
    baselines: tuple[BaselineReport, ...] = ()
    stages_per_rank: int = 1
    pareto: tuple[ParetoPoint, ...] = ()
    lower_bounds: LowerBounds | None = None
    tp: int = 1
    dp: int = 1
    zero_stage: int = 0
    sharded_parameters: tuple[ShardedParameter, ...] = ()
    model_flops: int = 0
    schema_version: int = field(default=PLAN_SCHEMA_VERSION)

    def __post_init__(self) -> None:
        """Check every field's type, then the plan as a whole
        (:func:`autopart.core.plan_rules.check_plan_invariants`).

        Raises:
            PlanError: the first field or invariant that does not hold, with its value and
                the fix.
        """
        _check_fields(self, "")
        check_plan_invariants(self)

    @property
    def num_stages(self) -> int:
        """S, the number of pipeline stages."""
        return len(self.stages)

    @property
    def num_gpus(self) -> int:
        """tp x pp x dp, pp being the number of ranks."""
        return self.tp * len(self.ranks) * self.dp

    # ---- JSON ----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form; key order is made stable by the writer."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        """Build and validate a plan from :meth:`to_dict` output (values are taken as they are:
        ``2.7``, ``true`` or ``"2"`` where an integer belongs is refused, not converted).

        Raises:
            PlanError: a field is missing, unknown, of the wrong type or out of range, or the
                fields disagree with each other; the message names the field, the value and
                the fix.
        """
        kwargs = _kwargs(cls, d, "")
        for name, kind in (("cuts", Cut), ("stages", StagePlan), ("ranks", RankPlan),
                           ("baselines", BaselineReport), ("pareto", ParetoPoint),
                           ("sharded_parameters", ShardedParameter)):
            if name in kwargs:
                items = _listed(kwargs[name], name)
                kwargs[name] = tuple(_build(kind, x, f"{name}[{i}]") for i, x in enumerate(items))
        kwargs["solver"] = _build(SolverReport, kwargs["solver"], "solver")
        if kwargs.get("lower_bounds") is not None:
            kwargs["lower_bounds"] = _build(LowerBounds, kwargs["lower_bounds"], "lower_bounds")
        return cls(**kwargs)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the plan as JSON (sorted keys), atomically: the old file or the new, never half."""
        write_text_atomic(path, dumps(self.to_dict()))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Plan:
        """Read and validate a plan file (JSON only; nothing is unpickled).

        Raises:
            PlanError: the path cannot be read (missing, a directory, no permission), the
                file is not UTF-8 JSON (binary, truncated, duplicate keys, nested too deep,
                numbers too long), or it is not a valid plan; the message names the path.
        """
        fix = "pass a plan JSON file written by Plan.save or `autopart plan`"
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except OSError as exc:
            raise PlanError(f"{path}: cannot read a plan file there ({exc.strerror or exc}); "
                            f"{fix}") from None
        try:
            data = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys)
        except UnicodeDecodeError as exc:
            raise PlanError(f"{path}: not a JSON plan file (not UTF-8 text: byte {exc.start}); "
                            f"{fix}") from None
        except RecursionError:
            raise PlanError(f"{path}: not a JSON plan file (nested too deep to read); "
                            f"{fix}") from None
        except ValueError as exc:  # json.JSONDecodeError, or an integer of > 4300 digits
            raise PlanError(f"{path}: not a JSON plan file ({exc}); {fix}") from None
        try:
            return cls.from_dict(data)
        except PlanError as exc:
            raise PlanError(f"{path}: {exc}") from None


_TUPLE_FIELDS = {"module_range", "stage_indices"}
#: What each field annotation admits: (test, description for the message).
_KINDS: dict[str, tuple[Any, str]] = {
    "int": (lambda v: _is_int(v) and v >= 0, "an integer >= 0 (not a bool or a fraction)"),
    "float": (lambda v: _is_number(v), "a finite number"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "tuple[str, str]": (lambda v: isinstance(v, tuple) and len(v) == 2
                        and all(isinstance(x, str) for x in v), "a list of two strings"),
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


def _check_fields(obj: Any, where: str | None = None) -> None:
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


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads`` hook: a key given twice is refused (JSON would keep the last silently)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise PlanError(f"invalid plan: key {key!r} appears twice in one object; keep one")
        out[key] = value
    return out


def _listed(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list | tuple):
        raise PlanError(f"invalid plan: {where}={_show(value)} must be a list; {FIX}")
    return list(value)


def _kwargs(cls: type, d: Any, where: str) -> dict[str, Any]:
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


def _build(cls: type, d: Any, where: str) -> Any:
    kwargs = _kwargs(cls, d, where)
    _check_values(cls, kwargs, f"{where}.")
    return cls(**kwargs)
