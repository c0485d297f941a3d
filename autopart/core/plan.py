"""Plan: the solver's decision and the file users keep, diff and replay (JSON, validated on load)."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from autopart.core.errors import PlanError
from autopart.core.jsonio import dumps, write_text_atomic

__all__ = ["Cut", "StagePlan", "RankPlan", "SolverReport", "BaselineReport", "ParetoPoint",
           "LowerBounds", "Plan",
           "PLAN_SCHEMA_VERSION", "SCHEDULE_KINDS", "OPTIMIZE_TARGETS"]

PLAN_SCHEMA_VERSION = 1
SCHEDULE_KINDS = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
OPTIMIZE_TARGETS = ("speed", "memory")


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


@dataclass(frozen=True, slots=True)
class RankPlan:
    """One rank (device) and its predicted peak memory, bytes."""

    rank: int
    device: str
    stage_indices: tuple[int, ...]
    peak_memory_bytes: int


@dataclass(frozen=True, slots=True)
class SolverReport:
    """What the solver said: CP-SAT status, objective and best bound (µs), relative gap, wall time (s)."""

    status: str
    objective: float
    bound: float
    gap: float
    wall_s: float
    name: str = "cp-sat"


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


@dataclass(frozen=True, slots=True)
class ParetoPoint:
    """One non-dominated (step time µs, largest rank peak memory bytes) point the search saw."""

    predicted_step_time_us: float
    peak_memory_bytes: int


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
        stages_per_rank: v, virtual stages per rank (1 without interleaving).
        pareto: the (step time, peak memory) frontier of the candidates the solver evaluated,
            by ascending time (may be empty).
        lower_bounds: physical lower bounds and the plan's ratio to them (None when absent).
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
    schema_version: int = field(default=PLAN_SCHEMA_VERSION)

    def __post_init__(self) -> None:
        def bad(msg: str) -> PlanError:
            return PlanError(f"invalid plan: {msg}")

        if self.schema_version != PLAN_SCHEMA_VERSION:
            raise bad(f"schema_version {self.schema_version} is not supported (this autopart "
                      f"reads {PLAN_SCHEMA_VERSION}); re-plan with this version")
        if self.optimize not in OPTIMIZE_TARGETS:
            raise bad(f"optimize={self.optimize!r}; expected one of {OPTIMIZE_TARGETS}")
        if self.schedule_kind not in SCHEDULE_KINDS:
            raise bad(f"schedule_kind={self.schedule_kind!r}; expected one of {SCHEDULE_KINDS}")
        if self.num_microbatches < 1 or self.batch_size % self.num_microbatches:
            raise bad(f"num_microbatches={self.num_microbatches} must be >= 1 and divide "
                      f"batch_size={self.batch_size}")
        if len(self.stages) != len(self.cuts) + 1:
            raise bad(f"{len(self.stages)} stages but {len(self.cuts)} cuts; S stages need S - 1 cuts")
        positions = [c.position for c in self.cuts]
        ascending = all(a < b for a, b in zip(positions, positions[1:], strict=False))
        if not ascending or any(p < 1 for p in positions):
            raise bad(f"cut positions {positions} must be >= 1 and strictly ascending")
        for i, st in enumerate(self.stages):
            if st.stage_index != i:
                raise bad(f"stage {i} has stage_index {st.stage_index}")
            if not 0 <= st.rank < len(self.ranks):
                raise bad(f"stage {i} is on rank {st.rank}, but the plan has {len(self.ranks)} ranks")
        if not 0.0 <= self.bubble_fraction <= 1.0:
            raise bad(f"bubble_fraction={self.bubble_fraction} is outside [0, 1]")

    @property
    def num_stages(self) -> int:
        """S, the number of pipeline stages."""
        return len(self.stages)

    # ---- JSON ----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form; key order is made stable by the writer."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        """Build and validate a plan from :meth:`to_dict` output.

        Raises:
            PlanError: a field is missing, unknown or of the wrong type; the message names it.
        """
        if not isinstance(d, dict):
            raise PlanError(f"invalid plan: expected a JSON object, got {type(d).__name__}")
        try:
            _check_keys(cls, d, "plan")
            return cls(
                graph_fingerprint=str(d["graph_fingerprint"]),
                cluster_fingerprint=str(d["cluster_fingerprint"]),
                cost_source=str(d["cost_source"]),
                library_versions={str(k): str(v) for k, v in d["library_versions"].items()},
                optimize=d["optimize"], batch_size=int(d["batch_size"]),
                num_microbatches=int(d["num_microbatches"]), schedule_kind=d["schedule_kind"],
                cuts=tuple(_build(Cut, c, "cut") for c in d["cuts"]),
                stages=tuple(_build(StagePlan, s, "stage") for s in d["stages"]),
                ranks=tuple(_build(RankPlan, r, "rank") for r in d["ranks"]),
                predicted_step_time_us=float(d["predicted_step_time_us"]),
                bubble_fraction=float(d["bubble_fraction"]),
                solver=_build(SolverReport, d["solver"], "solver"),
                baselines=tuple(_build(BaselineReport, b, "baseline") for b in d.get("baselines", ())),
                stages_per_rank=int(d.get("stages_per_rank", 1)),
                pareto=tuple(_build(ParetoPoint, q, "pareto point") for q in d.get("pareto", ())),
                lower_bounds=(None if d.get("lower_bounds") is None
                              else _build(LowerBounds, d["lower_bounds"], "lower_bounds")),
                schema_version=int(d["schema_version"]),
            )
        except KeyError as exc:
            raise PlanError(f"invalid plan: missing field {exc.args[0]!r}") from exc
        except (TypeError, ValueError, AttributeError) as exc:
            raise PlanError(f"invalid plan: {exc}") from exc

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the plan as JSON (sorted keys), atomically: the old file or the new, never half."""
        write_text_atomic(path, dumps(self.to_dict()))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Plan:
        """Read and validate a plan file (JSON only; nothing is unpickled).

        Raises:
            PlanError: the file is not JSON or not a valid plan.
            FileNotFoundError: no such file.
        """
        with open(path, encoding="utf-8") as f:
            text = f.read()
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanError(f"{path}: not a JSON plan file ({exc}); pass a file written by "
                            "Plan.save or `autopart plan`") from exc
        return cls.from_dict(data)


_TUPLE_FIELDS = {"module_range", "stage_indices"}


def _check_keys(cls: type, d: dict[str, Any], what: str) -> None:
    known = {f.name for f in fields(cls)}
    unknown = set(d) - known
    if unknown:
        raise PlanError(f"invalid plan: unknown {what} field(s) {sorted(unknown)}; "
                        f"known: {sorted(known)}")


def _build(cls: type, d: Any, what: str) -> Any:
    if not isinstance(d, dict):
        raise PlanError(f"invalid plan: {what} must be a JSON object, got {type(d).__name__}")
    _check_keys(cls, d, what)
    kwargs = {k: tuple(v) if k in _TUPLE_FIELDS else v for k, v in d.items()}
    return cls(**kwargs)
