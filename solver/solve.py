"""solve(costs, cluster, options) -> Plan: cuts and microbatch count for a GPipe pipeline."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from importlib.metadata import version

from autopart.cluster import Cluster
from autopart.costgraph import CostGraph
from autopart.errors import InfeasiblePlanError, PlanError
from autopart.plan import OPTIMIZE_TARGETS, SCHEDULE_KINDS, Cut, Plan, RankPlan, SolverReport, StagePlan
from autopart.solver._costmodel import TIME_UNITS_PER_US, CostModel, StageEstimate
from autopart.solver.candidates import CutCandidates, find_candidates
from autopart.solver.partition_cpsat import CpSatResult, partition_cpsat

__all__ = ["SolveOptions", "solve"]

_GIB = 2**30


@dataclass(frozen=True, slots=True)
class SolveOptions:
    """What to solve for.

    Attributes:
        num_stages: S; must equal the cluster's number of ranks (rank r runs stage r).
        batch_size: the full batch (leading dimension) the plan is for.
        num_microbatches: m; ``None`` = choose among the divisors of ``batch_size``.
        microbatch_candidates: restricts the m searched when ``num_microbatches`` is None;
            each must divide ``batch_size``.
        optimize: ``"speed"`` (smallest step time under the memory cap) or ``"memory"``
            (smallest peak memory, then step time).
        training: plan for fwd + bwd (True) or forward-only inference.
        schedule_kind: one of ``SCHEDULE_KINDS``; ``None`` = ``"1f1b"`` when training (same
            step time as GPipe, fewer microbatches in flight), ``"gpipe"`` for inference.
        stages_per_rank: v; ``None`` or 1 in this version (one stage per rank).
        recompute: recompute every stage's activations in backward; ``None`` = False.
        memory_cap_bytes: per-device cap, bytes; ``None`` = each device's ``memory_bytes``.
        optimizer_state_bytes_per_param_byte: optimizer state per trainable parameter byte
            (AdamW: 2.0); weights + grads + state = ``(2 + this) x`` parameter bytes.
        time_limit_s: CP-SAT wall-clock limit per solve, seconds.
        library_versions: package -> version recorded in the plan (ortools is added).
        crossing_factor: see :func:`autopart.solver.candidates.find_candidates`.
        window: see :func:`autopart.solver.candidates.find_candidates`.
        max_candidates: see :func:`autopart.solver.candidates.find_candidates`.
    """

    num_stages: int
    batch_size: int
    num_microbatches: int | None = None
    microbatch_candidates: tuple[int, ...] | None = None
    optimize: str = "speed"
    training: bool = True
    schedule_kind: str | None = None
    stages_per_rank: int | None = None
    recompute: bool | None = None
    memory_cap_bytes: int | None = None
    optimizer_state_bytes_per_param_byte: float = 2.0
    time_limit_s: float = 10.0
    library_versions: dict[str, str] = field(default_factory=dict)
    crossing_factor: float = 2.0
    window: int = 32
    max_candidates: int = 128

    def __post_init__(self) -> None:
        if self.schedule_kind is not None and self.schedule_kind not in SCHEDULE_KINDS:
            raise PlanError(f"schedule_kind={self.schedule_kind!r}; expected one of "
                            f"{SCHEDULE_KINDS} or None")
        if self.stages_per_rank not in (None, 1):
            raise PlanError(f"stages_per_rank={self.stages_per_rank}: this solver version plans "
                            "one stage per rank; pass stages_per_rank=1 or None")
        if self.optimize not in OPTIMIZE_TARGETS:
            raise PlanError(f"optimize={self.optimize!r}; expected one of {OPTIMIZE_TARGETS}")
        if self.num_stages < 1 or self.batch_size < 1:
            raise PlanError(f"num_stages={self.num_stages} and batch_size={self.batch_size} "
                            "must be >= 1")
        if self.memory_cap_bytes is not None and self.memory_cap_bytes <= 0:
            raise PlanError(f"memory_cap_bytes={self.memory_cap_bytes} must be > 0 or None")
        if self.optimizer_state_bytes_per_param_byte < 0 or self.time_limit_s <= 0:
            raise PlanError("optimizer_state_bytes_per_param_byte must be >= 0 and "
                            "time_limit_s > 0")

    def microbatch_counts(self) -> tuple[int, ...]:
        """The m values to search, ascending.

        Raises:
            PlanError: a requested m does not divide ``batch_size``.
        """
        if self.num_microbatches is not None:
            wanted: tuple[int, ...] = (self.num_microbatches,)
        elif self.microbatch_candidates is not None:
            wanted = self.microbatch_candidates
        else:
            return tuple(d for d in range(1, self.batch_size + 1) if self.batch_size % d == 0)
        bad = [m for m in wanted if m < 1 or self.batch_size % m]
        if bad or not wanted:
            valid = [d for d in range(1, self.batch_size + 1) if self.batch_size % d == 0]
            raise PlanError(f"num_microbatches {bad or list(wanted)} must be >= 1 and divide "
                            f"batch_size={self.batch_size}; valid: {valid}")
        return tuple(sorted(set(wanted)))


@dataclass(frozen=True, slots=True)
class _Choice:
    """One evaluated (m, cuts) option."""

    m: int
    cuts: tuple[int, ...]  # node positions
    stages: tuple[StageEstimate, ...]
    step_us: float
    result: CpSatResult

    @property
    def max_peak(self) -> int:
        return max(st.peak_memory_bytes for st in self.stages)

    def fits(self, caps: list[int]) -> bool:
        return all(st.peak_memory_bytes <= cap for st, cap in zip(self.stages, caps, strict=True))


def _step_time_us(stages: tuple[StageEstimate, ...], m: int) -> float:
    """GPipe step time, µs: ``(m - 1) * max_stage + sum(stages)`` (stage times per microbatch)."""
    times = [st.time_us for st in stages]
    return (m - 1) * max(times) + sum(times)


def solve(costs: CostGraph, cluster: Cluster, options: SolveOptions) -> Plan:
    """Choose cuts and the microbatch count for a GPipe pipeline, one stage per rank.

    For every candidate m it solves the chain partition over cut candidates with CP-SAT:
    ``"speed"`` minimises the largest per-microbatch stage time (compute + communication)
    subject to an additive memory bound per stage; ``"memory"`` first minimises the largest
    additive stage memory, then the stage time with that memory fixed. Each answer is then
    re-evaluated exactly (tied parameters counted on every stage that reads them, the stage's
    own largest output as transient). ``"speed"`` keeps the m with the smallest predicted step
    time ``(m - 1) * max_stage + sum(stages)`` whose every stage fits the cap; ``"memory"`` the
    one with the smallest largest peak, then step time. Ties go to the smaller m. If no
    speed-first answer fits the cap, the memory-first cuts of every m are tried before giving up.

    Costs enter CP-SAT as integers: time in 0.1 µs units (rounded), memory in bytes.
    Communication in the chain model uses the slowest neighbour link for every cut; the
    reported stage times use the actual link of each cut. The plan's ``solver`` report gives
    the final CP-SAT solve of the chosen m: objective and bound are its largest per-microbatch
    stage time, µs; ``wall_s`` sums every CP-SAT solve made.

    Args:
        costs: per-node costs, profiled at ``costs.batch_size``.
        cluster: the devices; rank r runs stage r.
        options: see :class:`SolveOptions`.

    Returns:
        A complete plan; equal inputs give equal plans except for ``solver.wall_s``.

    Raises:
        PlanError: ``num_stages`` differs from ``cluster.num_ranks``, an m does not divide the
            batch, or CP-SAT found nothing within the time limit.
        InfeasiblePlanError: too few valid cut positions, or no m fits under the memory cap.
    """
    s_total = options.num_stages
    if s_total != cluster.num_ranks:
        raise PlanError(f"num_stages={s_total} but the cluster has {cluster.num_ranks} ranks; "
                        "this version runs one stage per rank, so pass num_stages="
                        f"{cluster.num_ranks} or a cluster of {s_total} devices")
    counts = options.microbatch_counts()
    cands = find_candidates(costs, s_total, crossing_factor=options.crossing_factor,
                            window=options.window, max_candidates=options.max_candidates)
    model = CostModel(costs, cluster, batch_size=options.batch_size, training=options.training,
                      state_factor=options.optimizer_state_bytes_per_param_byte)
    caps = [dev.memory_bytes if options.memory_cap_bytes is None else options.memory_cap_bytes
            for dev in cluster.devices]
    wall = [0.0]

    def run(cost: list[int], out: list[int], cin: list[int], seg_weight: list[int] | None = None,
            cut_weight: list[int] | None = None,
            weight_cap: int | list[int] | None = None) -> CpSatResult:
        res = partition_cpsat(cost, out, s_total, cin, seg_weight=seg_weight,
                              cut_weight=cut_weight, weight_cap=weight_cap,
                              time_limit_s=options.time_limit_s, num_workers=1, random_seed=0)
        wall[0] += res.wall_s
        return res

    def choice(m: int, res: CpSatResult) -> _Choice:
        positions = tuple(cands.positions[i] for i in res.cuts)
        stages = tuple(model.evaluate(positions, m))
        return _Choice(m, positions, stages, _step_time_us(stages, m), res)

    def memory_first(m: int) -> _Choice:
        seg_w, cut_w = model.chain_memory(cands, m)
        mem = run(seg_w, cut_w, cut_w)
        seg_t, out_t, in_t = model.chain_time(cands, m)
        return choice(m, run(seg_t, out_t, in_t, seg_weight=seg_w, cut_weight=cut_w,
                             weight_cap=mem.objective))

    tried: list[_Choice] = []
    for m in counts:
        if options.optimize == "memory":
            tried.append(memory_first(m))
            continue
        seg_w, cut_w = model.chain_memory(cands, m)
        seg_t, out_t, in_t = model.chain_time(cands, m)
        try:
            tried.append(choice(m, run(seg_t, out_t, in_t, seg_weight=seg_w,
                                              cut_weight=cut_w,
                                              weight_cap=model.chain_memory_caps(caps, m))))
        except InfeasiblePlanError:
            continue

    fitting = [c for c in tried if c.fits(caps)]
    if not fitting and options.optimize == "speed":
        # The additive bound is conservative on transients; the memory-first cuts may still fit.
        tried = [memory_first(m) for m in counts]
        fitting = [c for c in tried if c.fits(caps)]
    if not fitting:
        raise _memory_error(options, caps, tried)
    if options.optimize == "speed":
        best = min(fitting, key=lambda c: (round(c.step_us, 6), c.m))
    else:
        best = min(fitting, key=lambda c: (c.max_peak, round(c.step_us, 6), c.m))
    return _plan(costs, cluster, options, cands, best, wall[0])


def _memory_error(options: SolveOptions, caps: list[int],
                  tried: list[_Choice]) -> InfeasiblePlanError:
    least = min(tried, key=lambda c: (c.max_peak, c.m))
    rank = max(least.stages, key=lambda st: st.peak_memory_bytes).stage
    return InfeasiblePlanError(
        f"no partition into {options.num_stages} stages fits the memory cap: the smallest "
        f"predicted peak is {least.max_peak} bytes ({least.max_peak / _GIB:.3f} GiB, rank "
        f"{rank}, num_microbatches={least.m}) but the cap is {min(caps)} bytes "
        f"({min(caps) / _GIB:.3f} GiB); use more stages/devices, or a memory cap of at least "
        f"{least.max_peak} bytes ({math.ceil(least.max_peak / _GIB * 1000) / 1000:.3f} GiB)")


def _plan(costs: CostGraph, cluster: Cluster, options: SolveOptions, cands: CutCandidates,
          best: _Choice, wall_s: float) -> Plan:
    nodes = costs.nodes
    ratio = options.batch_size / best.m / costs.batch_size
    cuts = tuple(
        Cut(position=p, after_node=nodes[p - 1].name, before_node=nodes[p].name,
            crossing_bytes=CostModel.scale_bytes(cands.crossing_bytes[cands.positions.index(p)],
                                                 ratio))
        for p in best.cuts)
    stages = []
    for st in best.stages:
        paths = [nd.module_path for nd in nodes[st.start:st.stop] if nd.module_path]
        stages.append(StagePlan(
            stage_index=st.stage, rank=st.stage, device=cluster.device_names[st.stage],
            first_node=nodes[st.start].name, last_node=nodes[st.stop - 1].name,
            num_nodes=st.stop - st.start,
            module_range=(paths[0], paths[-1]) if paths else ("", ""),
            num_parameters=st.num_parameters, param_bytes=st.param_bytes,
            predicted_fwd_us=round(st.fwd_us, 3), predicted_bwd_us=round(st.bwd_us, 3),
            predicted_comm_us=round(st.comm_us, 3),
            predicted_peak_memory_bytes=st.peak_memory_bytes,
            recompute=bool(options.recompute)))
    ranks = tuple(RankPlan(rank=st.stage, device=cluster.device_names[st.stage],
                           stage_indices=(st.stage,), peak_memory_bytes=st.peak_memory_bytes)
                  for st in best.stages)
    busy_mean = best.m * sum(st.time_us for st in best.stages) / len(best.stages)
    bubble = 1.0 - busy_mean / best.step_us if best.step_us > 0 else 0.0
    res = best.result
    objective = res.objective / TIME_UNITS_PER_US
    bound = res.bound / TIME_UNITS_PER_US
    versions = {**options.library_versions, "ortools": version("ortools")}
    return Plan(
        graph_fingerprint=costs.fingerprint,
        cluster_fingerprint=cluster.fingerprint(),
        cost_source=costs.source,
        library_versions=dict(sorted(versions.items())),
        optimize=options.optimize,
        batch_size=options.batch_size,
        num_microbatches=best.m,
        schedule_kind=options.schedule_kind or ("1f1b" if options.training else "gpipe"),
        cuts=cuts,
        stages=tuple(stages),
        ranks=ranks,
        predicted_step_time_us=round(best.step_us, 3),
        bubble_fraction=round(min(max(bubble, 0.0), 1.0), 6),
        solver=SolverReport(status=res.status, objective=objective, bound=bound,
                            gap=(objective - bound) / objective if objective > 0 else 0.0,
                            wall_s=wall_s),
    )
