"""solve(costs, cluster, options) -> Plan: cuts, microbatches, interleaving, schedule and recompute."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from importlib.metadata import version
from typing import Any

from autopart.core.cluster import Cluster
from autopart.core.costgraph import CostGraph
from autopart.core.errors import InfeasiblePlanError, PlanError
from autopart.core.plan import (
    OPTIMIZE_TARGETS,
    SCHEDULE_KINDS,
    BaselineReport,
    Plan,
    SolverReport,
)
from autopart.solver._costmodel import TIME_UNITS_PER_US, CostModel
from autopart.solver._evaluate import Candidate, build_plan, evaluate, lower_bounds, pareto
from autopart.solver._schedule_cost import in_flight, objective_weights
from autopart.solver.candidates import CutCandidates, add_positions, find_candidates
from autopart.solver.chain import ChainAnswer, ChainProblem
from autopart.solver.partition_cpsat import ChainResult, solve_chain_cpsat
from autopart.solver.partition_dp import chain_dp_hint

__all__ = ["SolveOptions", "solve"]

_GIB = 2**30
_V_CHOICES = (1, 2, 4)


@dataclass(frozen=True, slots=True, kw_only=True)
class SolveOptions:
    """What to solve for (keyword-only).

    Attributes:
        batch_size: the full batch (leading dimension) the plan is for.
        num_stages: S = ranks x stages_per_rank; ``None`` (default) = the cluster's ranks times
            the chosen v. Giving it fixes v = S / ranks.
        num_microbatches: m; ``None`` = choose among the divisors of ``batch_size``.
        microbatch_candidates: restricts the m searched when ``num_microbatches`` is None;
            each must divide ``batch_size``.
        optimize: ``"speed"`` (smallest step time with every rank under its cap) or
            ``"memory"`` (smallest largest-rank peak memory, then step time).
        training: plan for fwd + bwd (True) or forward-only inference (GPipe forward schedule).
        schedule_kind: one of ``SCHEDULE_KINDS``; ``None`` = the solver chooses (training).
        stages_per_rank: v; ``None`` = the solver chooses among 1, 2, 4 (v > 1 only with
            ``interleaved_1f1b``, which needs m to be a multiple of the ranks).
        recompute: ``True`` every stage recomputes, ``False`` none, ``None`` the solver picks
            per stage.
        memory_cap_bytes: per-device cap, bytes; ``None`` = each device's ``memory_bytes``.
        optimizer_state_bytes_per_param_byte: optimizer state per trainable parameter byte
            (AdamW: 2.0); weights + grads + state = ``(2 + this) x`` parameter bytes.
        time_limit_s: CP-SAT wall-clock limit per solve, seconds (a safety net; the search
            is bounded by ``deterministic_time`` so that it is reproducible).
        deterministic_time: CP-SAT deterministic time limit per solve (default 2.0).
        max_cpsat_solves: how many (kind, v, m) subproblems CP-SAT refines, best DP seeds
            first (default 8); the rest keep their DP answer.
        max_simulated: how many best candidates the schedule simulator replays (default 4;
            only the best when a replay has more than 8192 microbatch-stage pairs, and
            baselines then keep their closed-form time).
        hint: a previous plan whose cuts seed the search (warm start after a change of
            batch, sequence length or device count).
        library_versions: package -> version recorded in the plan (ortools is added).
        split_backward_factor: measured ``(I + W) / B`` of the runtime that will run the
            plan: what splitting one backward into its input- and weight-gradient parts
            costs (default 1.0: free, as the ZB-H1 paper assumes). ``zero_bubble``
            candidates have their non-recomputed stages' I and W multiplied by it; must be
            >= 1. :func:`autopart.compile` measures it on the profiled device.
        crossing_factor, window, max_candidates: see
            :func:`autopart.solver.candidates.find_candidates`.
    """

    batch_size: int
    num_stages: int | None = None
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
    deterministic_time: float = 2.0
    max_cpsat_solves: int = 8
    max_simulated: int = 4
    hint: Plan | None = None
    library_versions: dict[str, str] = field(default_factory=dict)
    split_backward_factor: float = 1.0
    crossing_factor: float = 2.0
    window: int = 32
    max_candidates: int = 128

    def __post_init__(self) -> None:
        if self.schedule_kind is not None and self.schedule_kind not in SCHEDULE_KINDS:
            raise PlanError(f"schedule_kind={self.schedule_kind!r}; expected one of "
                            f"{SCHEDULE_KINDS} or None")
        if self.stages_per_rank is not None and self.stages_per_rank < 1:
            raise PlanError(f"stages_per_rank={self.stages_per_rank} must be >= 1 or None")
        if (self.stages_per_rank or 1) > 1 and self.schedule_kind not in (None, "interleaved_1f1b"):
            raise PlanError(f"stages_per_rank={self.stages_per_rank} needs schedule_kind "
                            f"'interleaved_1f1b' (or None), not {self.schedule_kind!r}")
        if self.optimize not in OPTIMIZE_TARGETS:
            raise PlanError(f"optimize={self.optimize!r}; expected one of {OPTIMIZE_TARGETS}")
        if self.batch_size < 1 or (self.num_stages is not None and self.num_stages < 1):
            raise PlanError(f"num_stages={self.num_stages} and batch_size={self.batch_size} "
                            "must be >= 1")
        if not self.split_backward_factor >= 1.0:
            raise PlanError(f"split_backward_factor={self.split_backward_factor} must be >= 1 "
                            "(splitting a backward cannot make it cheaper)")
        if self.memory_cap_bytes is not None and self.memory_cap_bytes <= 0:
            raise PlanError(f"memory_cap_bytes={self.memory_cap_bytes} must be > 0 or None")
        if (self.optimizer_state_bytes_per_param_byte < 0 or self.time_limit_s <= 0
                or self.deterministic_time <= 0 or self.max_cpsat_solves < 0
                or self.max_simulated < 1):
            raise PlanError("optimizer_state_bytes_per_param_byte must be >= 0, time_limit_s "
                            "and deterministic_time > 0, max_cpsat_solves >= 0, "
                            "max_simulated >= 1")

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

    def configurations(self, num_ranks: int) -> list[tuple[str, int]]:
        """The (schedule kind, v) pairs to search.

        Raises:
            PlanError: ``num_stages`` is not a multiple of the ranks, or disagrees with
                ``stages_per_rank``.
        """
        v_fixed = self.stages_per_rank
        if self.num_stages is not None:
            if self.num_stages % num_ranks or (v_fixed is not None
                                               and self.num_stages != v_fixed * num_ranks):
                raise PlanError(f"num_stages={self.num_stages} but the cluster has {num_ranks} "
                                f"ranks and stages_per_rank={v_fixed}: num_stages must equal "
                                "ranks x stages_per_rank; pass num_stages=None to let the "
                                "solver choose")
            v_fixed = self.num_stages // num_ranks
        if not self.training:
            return [(self.schedule_kind or "gpipe", v_fixed or 1)]
        kinds = (self.schedule_kind,) if self.schedule_kind else SCHEDULE_KINDS
        out = []
        for kind in kinds:
            if kind == "interleaved_1f1b":
                if self.schedule_kind is None:  # v = 1 is plain 1F1B: searched under that name
                    vs = () if v_fixed == 1 else ((v_fixed,) if v_fixed else (2, 4))
                else:
                    vs = (v_fixed,) if v_fixed else _V_CHOICES
            else:
                vs = (1,) if v_fixed in (None, 1) else ()
            out += [(kind, v) for v in vs if v is not None]
        return out


@dataclass(frozen=True, slots=True)
class _Sub:
    """One (kind, v, m) subproblem: its chain problem, seed and solve."""

    kind: str
    v: int
    m: int
    problem: ChainProblem
    seed: ChainAnswer | None
    result: ChainResult | None = None


def solve(costs: CostGraph, cluster: Cluster, options: SolveOptions) -> Plan:
    """Choose cuts, microbatch count m, stages per rank v, schedule kind and recompute.

    The search, for every allowed (kind, v, m):

    1. A :class:`~autopart.solver.chain.ChainProblem` over the cut candidates: segment times at
       the microbatch size, P2P sends, memory that follows the schedule (parameter state,
       activations x in-flight microbatches of that kind, recompute keeping only stage
       inputs), per-rank caps, and the kind's closed-form step time as a linear objective.
    2. An exact min-max DP seeds it (:func:`chain_dp_hint`); CP-SAT refines the
       ``max_cpsat_solves`` most promising seeds on the full objective, with per-stage
       recompute decisions, and returns a bound.
    On big subproblems (more than ``_BAND_ABOVE`` segment x stage pairs) CP-SAT only searches
    a band of +-2 stages around the seed, for ``_BIG_SOLVES`` subproblem(s) at most and a
    shorter deterministic time; the plan's bound is then a relaxation bound of that
    subproblem (see :func:`_global_bound`), named in ``solver.name``.
    3. Every answer is costed exactly (tied parameters on every stage reading them, per-stage
       transient) in closed form; the ``max_simulated`` best are replayed by the schedule
       simulator, whose step time and per-rank peaks are what the plan reports.

    ``"speed"`` keeps the fastest fitting candidate (ties: smaller m, then the earlier kind);
    ``"memory"`` the smallest largest-rank peak, then time. Baseline partitioners (when
    :mod:`autopart.solver.baselines` is present) are evaluated under 1F1B, v = 1 at the chosen m
    (with every stage recomputing if that is what makes them fit) and reported; a faster
    fitting baseline is taken instead.

    Args:
        costs: per-node costs, profiled at ``costs.batch_size``.
        cluster: the devices; stage s runs on rank ``s % p``.
        options: see :class:`SolveOptions`.

    Returns:
        A complete plan; equal inputs give equal plans except for ``solver.wall_s``.

    Raises:
        PlanError: bad options (see :class:`SolveOptions`).
        InfeasiblePlanError: too few cut positions for the stages, or nothing fits the memory
            cap; the message names the smallest peak found and the cap or device count needed.
    """
    p = cluster.num_ranks
    configs = options.configurations(p)
    counts = options.microbatch_counts()
    caps = [dev.memory_bytes if options.memory_cap_bytes is None else options.memory_cap_bytes
            for dev in cluster.devices]
    model = CostModel(costs, cluster, batch_size=options.batch_size, training=options.training,
                      state_factor=options.optimizer_state_bytes_per_param_byte,
                      split_factor=options.split_backward_factor)
    baselines = _baseline_cuts(costs, p)
    s_max = p * max(v for _, v in configs) if configs else p
    cands = find_candidates(costs, min(s_max, _valid_count(costs, p)) if s_max > p else p,
                            crossing_factor=options.crossing_factor, window=options.window,
                            max_candidates=options.max_candidates)
    hint_pos = _hint_positions(costs, options.hint)
    cands = add_positions(costs, cands, [q for _, cuts in baselines for q in cuts] + hint_pos)
    k = len(cands.segments)
    configs = [(kind, v) for kind, v in configs if p * v <= k]
    if not configs:
        raise InfeasiblePlanError(f"{p} ranks need at least {p} stages but the graph has only "
                                  f"{k} candidate segments ({cands.num_valid} valid cut "
                                  f"positions); use at most {k} devices")
    mode = {None: "auto", True: "all", False: "none"}[options.recompute]
    if not options.training:
        mode = "none"

    # 1. Subproblems and their DP seeds.
    # Equal chain problems are seeded and solved once (1F1B and ZB-H1 share theirs for
    # inference; in training ZB-H1's hides W and may pay a split cost).
    subs: list[_Sub] = []
    seeds: dict[ChainProblem, ChainAnswer | None] = {}
    for kind, v in configs:
        for m in counts:
            if kind == "interleaved_1f1b" and m % p:
                continue
            prob = _chain_problem(model, cands, caps, kind, p, v, m, mode, options)
            if prob not in seeds:
                seeds[prob] = _seed(prob, cands, options.hint, costs)
            subs.append(_Sub(kind, v, m, prob, seeds[prob]))
    if not subs:
        raise PlanError(f"no microbatch count in {list(counts)} is a multiple of the {p} ranks "
                        "that interleaved_1f1b needs; allow another m or schedule")

    # 2. CP-SAT on the most promising seeds.
    wall = 0.0
    scored = sorted(range(len(subs)), key=lambda i: _seed_score(model, cands, subs[i], options))
    solved: list[_Sub] = []
    results: dict[ChainProblem, ChainResult | None] = {}
    big_solves = 0
    for rank_i, i in enumerate(scored):
        sub = subs[i]
        if rank_i < options.max_cpsat_solves and (sub.problem in results
                                                  or not _is_big(sub)
                                                  or big_solves < _BIG_SOLVES):
            if sub.problem not in results:
                big_solves += _is_big(sub)
                try:
                    res: ChainResult | None = _cpsat(sub, options)
                except InfeasiblePlanError:
                    res = None
                results[sub.problem] = res
                wall += res.wall_s if res is not None else 0.0
            res = results[sub.problem]
            if res is None:
                continue
            sub = replace(sub, result=res)
        if sub.result is None and sub.seed is None:
            continue
        solved.append(sub)

    # 3. Exact costs, simulator on the best, choice.
    evaluated = [evaluate(model, cands, s.kind, p, s.v, s.m, _answer(s), caps, sub=s)
                 for s in solved]
    base_reports, base_cands = _baselines(model, baselines, p, caps, evaluated, counts)
    # A baseline may replace the solver's answer only where its setting (1F1B, v = 1, its
    # recompute) is one the options allow.
    allowed = (options.schedule_kind in (None, base_cands[0].kind if base_cands else None)
               and options.stages_per_rank in (None, 1) and options.num_stages in (None, p))
    pool = [c for c in evaluated if c.fits] + [
        c for c in base_cands if c.fits and allowed
        and options.recompute in (None, any(c.recompute))]
    if not pool:
        raise _memory_error(model, cands, caps, configs, counts, p, options)
    key = _key(options.optimize)
    pool.sort(key=key)
    n_sim = options.max_simulated if pool[0].m * p * pool[0].v <= _SIMULATE_ABOVE else 1
    final = [c.simulated() for c in pool[:n_sim]]
    final = [c for c in final if c.fits] or final
    best = min(final, key=key)
    frontier = pareto(evaluated + base_cands + final)
    sub = best.sub
    report = _report(sub.result if isinstance(sub, _Sub) else None, options, wall, best)
    versions = {**options.library_versions, "ortools": version("ortools")}
    plan = build_plan(costs, cluster, model, cands, best, options.optimize,
                      options.batch_size, dict(sorted(versions.items())), report,
                      tuple(base_reports), frontier)
    return replace(plan, lower_bounds=lower_bounds(model, plan, p))


# ---- building blocks ----------------------------------------------------------------------
def _valid_count(costs: CostGraph, p: int) -> int:
    from autopart.solver.candidates import crossing_profile

    _, valid = crossing_profile(costs)
    return max(p, sum(valid[1:len(costs.nodes)]) + 1)


def _chain_problem(model: CostModel, cands: CutCandidates, caps: list[int], kind: str, p: int,
                   v: int, m: int, mode: str, options: SolveOptions) -> ChainProblem:
    ratio = model.ratio(m)
    seg_t, out_t, in_t = model.chain_time(cands, m)
    seg_w: list[int] | None = None
    if kind == "zero_bubble" and options.training:
        # every stage splits its backward at the measured cost (a recomputed one does not,
        # which evaluate() knows) and all but stage 0 run their W off the critical path
        extra = model.split_factor - 1.0
        if extra > 0.0:
            seg_t = [t + int(round(extra * TIME_UNITS_PER_US * (
                model.part_us("bwd_input", s.start, s.stop, ratio)
                + model.part_us("bwd_weight", s.start, s.stop, ratio))))
                for t, s in zip(seg_t, cands.segments, strict=True)]
        seg_w = [int(round(model.split_factor * TIME_UNITS_PER_US
                           * model.part_us("bwd_weight", s.start, s.stop, ratio)))
                 for s in cands.segments]
    seg_f = [int(round(model.part_us("fwd", s.start, s.stop, ratio) * TIME_UNITS_PER_US))
             for s in cands.segments]
    seg_mem, cut_b = model.chain_memory(cands, 1)
    # chain_memory(., 1) holds state + one microbatch's saved bytes at b0; rebuild at ratio.
    state = [model._first_state[s.stop] - model._first_state[s.start] for s in cands.segments]
    saved = [model.scale_bytes(model.saved_bytes(s.start, s.stop), ratio) if options.training
             else 0 for s in cands.segments]
    cut_b = [model.scale_bytes(c, ratio) for c in cands.crossing_bytes]
    n = len(model.costs.nodes)
    transient = model.max_transient_bytes(ratio)
    w_stage, w_rank, w_sum = objective_weights(kind, p, m, v)
    speed = tuple(model.speed(r) for r in range(p))
    del seg_mem
    return ChainProblem(
        seg_time=tuple(seg_t), seg_fwd=tuple(seg_f if options.training else [0] * len(seg_f)),
        cut_out=tuple(out_t), cut_in=tuple(in_t), num_ranks=p, stages_per_rank=v,
        speed=None if all(f == 1.0 for f in speed) else speed,
        w_stage=w_stage, w_rank=w_rank, w_sum=w_sum, seg_state=tuple(state),
        seg_saved=tuple(saved), cut_bytes=tuple(cut_b),
        first_in_bytes=model.scale_bytes(model.crossing[0], ratio),
        last_out_bytes=model.scale_bytes(model.crossing[n], ratio),
        in_flight=in_flight(kind, p, m, v, options.training),
        rank_caps=tuple(max(c - transient, 0) for c in caps), recompute=mode,
        optimize=options.optimize, seg_bwd_weight=None if seg_w is None else tuple(seg_w))


def _seed(prob: ChainProblem, cands: CutCandidates, hint: Plan | None,
          costs: CostGraph) -> ChainAnswer | None:
    """The DP answer, or the previous plan's cuts when they fit and are no worse."""
    dp = chain_dp_hint(prob)
    if hint is None or len(hint.cuts) != prob.num_stages - 1:
        return dp
    idx = [_nearest_index(cands, q) for q in _hint_positions(costs, hint)]
    if len(set(idx)) != len(idx) or sorted(idx) != idx:
        return dp
    flags = tuple(st.recompute for st in hint.stages) if prob.recompute == "auto" else (
        (prob.recompute == "all",) * prob.num_stages)
    if not prob.fits(idx, flags):
        return dp
    warm = ChainAnswer(tuple(idx), flags, prob.objective(idx, flags))
    return warm if dp is None or warm.objective <= dp.objective else dp


def _nearest_index(cands: CutCandidates, position: int) -> int:
    """Index i of the candidate nearest ``position`` ("cut after segment i")."""
    return min(range(len(cands.positions)), key=lambda i: (abs(cands.positions[i] - position), i))


def _hint_positions(costs: CostGraph, hint: Plan | None) -> list[int]:
    """A previous plan's cut positions mapped onto ``costs``: by the node name before each
    cut when it exists here, else by relative position in the node order."""
    if hint is None:
        return []
    index = {nd.name: i for i, nd in enumerate(costs.nodes)}
    n_old = max(sum(st.num_nodes for st in hint.stages), 1)
    n = len(costs.nodes)
    out = []
    for cut in hint.cuts:
        pos = index.get(cut.before_node)
        if pos is None:
            pos = int(round(cut.position / n_old * n))
        out.append(min(max(pos, 1), n - 1))
    return out


def _seed_score(model: CostModel, cands: CutCandidates, sub: _Sub,
                options: SolveOptions) -> tuple[float, int, int]:
    if sub.seed is None:
        return (math.inf, sub.m, sub.v)
    cand = evaluate(model, cands, sub.kind, sub.problem.num_ranks, sub.v, sub.m, sub.seed,
                    None, sub=sub)
    primary = cand.step_us if options.optimize == "speed" else float(cand.max_peak)
    return (primary, sub.m, sub.v)


#: Above this many x[i, s] pairs CP-SAT searches a band of +-2 stages around the seed.
_BAND_ABOVE = 20_000
#: How many such big subproblems CP-SAT refines, and its deterministic time on each. On the
#: 175B-shaped graph (K = 388 segments, 64 ranks) CP-SAT's presolve and loading of the DP
#: hint alone take about 1 deterministic second (several wall seconds on 2 cores) and 2.0
#: improves the DP seed by < 0.1%, so the big ones get one short, reproducible search.
_BIG_SOLVES = 1
_BIG_DETERMINISTIC_TIME = 1.0


def _is_big(sub: _Sub) -> bool:
    return (sub.problem.num_segments * sub.problem.num_stages > _BAND_ABOVE
            and sub.seed is not None)
#: Above this many actions per replay only the final choice and no baseline is simulated.
_SIMULATE_ABOVE = 8192


def _global_bound(prob: ChainProblem) -> int:
    """A lower bound on ``prob``'s objective valid for every answer: each stage and rank
    carries at least its share of the fastest segment times, communication counted as 0,
    and (ZB-H1) every segment's weight-gradient time taken off.

    It is the bound (and so the gap) a plan reports when its subproblem was solved banded
    (``solver.name == "cp-sat-band+relaxation-bound"``), and whenever it is tighter than
    CP-SAT's own bound: a relaxation of that one (kind, v, m) closed-form objective (perfect
    balance, no sends, no recompute), not a bound over other microbatch counts or kinds and
    not the simulator's step time."""
    if prob.optimize == "memory":
        return -(-sum(prob.seg_state or (0,)) // prob.num_ranks)
    fast = [min(prob.seg_time_on(r)[i] for r in range(prob.num_ranks))
            for i in range(prob.num_segments)]
    total = sum(fast)
    per_stage = max(-(-total // prob.num_stages), max(fast))
    # ZB-H1 takes off at most every segment's W (stage 0's stays, recomputed ones hide none)
    hidden = sum(max(prob.seg_bwd_weight_on(r)[i] for r in range(prob.num_ranks))
                 for i in range(prob.num_segments))
    return (prob.w_stage * per_stage + prob.w_rank * -(-total // prob.num_ranks)
            + prob.w_sum * total - hidden)


def _cpsat(sub: _Sub, options: SolveOptions) -> ChainResult:
    big = _is_big(sub)
    kw: dict[str, Any] = {"time_limit_s": options.time_limit_s,
                          "deterministic_time": (min(options.deterministic_time,
                                                     _BIG_DETERMINISTIC_TIME) if big
                                                 else options.deterministic_time),
                          "band": 2 if big else None}
    res = solve_chain_cpsat(sub.problem, sub.seed, **kw)
    if big or res.status == "HINT":
        # CP-SAT's bound covers the band only, or CP-SAT stopped before searching: use the
        # subproblem's relaxation bound instead (see _global_bound).
        res = replace(res, bound=min(res.objective, _global_bound(sub.problem)))
    else:
        # Both are lower bounds on this subproblem; report the tighter.
        res = replace(res, bound=min(res.objective, max(res.bound, _global_bound(sub.problem))))
    if sub.problem.optimize == "memory":
        # Then the step time with the largest rank's memory held at its minimum.
        caps = tuple(min(c, res.objective) for c in sub.problem.rank_caps or (res.objective,)
                     * sub.problem.num_ranks)
        timed = replace(sub.problem, optimize="speed", rank_caps=caps)
        hint = replace(res.answer, objective=timed.time_objective(res.answer.cuts,
                                                                   res.answer.recompute))
        second = solve_chain_cpsat(timed, hint, **kw)
        res = replace(second, status=res.status, bound=res.bound,
                      answer=replace(second.answer, objective=res.objective),
                      wall_s=res.wall_s + second.wall_s)
    return res


def _answer(sub: _Sub) -> ChainAnswer:
    if sub.result is not None:
        return sub.result.answer
    assert sub.seed is not None
    return sub.seed


def _key(optimize: str):  # type: ignore[no-untyped-def]
    """Order of preference: the target, then the other measure, then the total memory of all
    ranks (of two equally fast plans with the same largest peak, e.g. GPipe and 1F1B at
    m = p, the one holding less on the other ranks), then fewer microbatches and stages."""
    order = {k: i for i, k in enumerate(SCHEDULE_KINDS)}
    if optimize == "speed":
        return lambda c: (round(c.step_us, 6), c.max_peak, sum(c.peaks), c.m, c.v, order[c.kind])
    return lambda c: (c.max_peak, round(c.step_us, 6), sum(c.peaks), c.m, c.v, order[c.kind])


def _baseline_cuts(costs: CostGraph, p: int) -> list[tuple[str, tuple[int, ...]]]:
    try:
        from autopart.solver.baselines import baseline_partitions
    except ImportError:  # pragma: no cover - the module lands separately
        return []
    if p < 2:
        return []
    try:
        return [(name, tuple(cuts)) for name, cuts in baseline_partitions(costs, p)]
    except PlanError:
        return []


def _baselines(model: CostModel, baselines: list[tuple[str, tuple[int, ...]]], p: int,
               caps: list[int], evaluated: list[Candidate], counts: tuple[int, ...],
               ) -> tuple[list[BaselineReport], list[Candidate]]:
    """Each baseline under 1F1B, v = 1, at the m of the best candidate.

    A baseline whose peak does not fit the caps is costed again with every stage
    recomputing (DeepSpeed's ``activation_checkpoint_interval``, torchgpipe's
    ``checkpoint="always"``): what its users turn on when memory runs out. It keeps that
    setting if it then fits.
    """
    if not baselines:
        return [], []
    fitting = [c for c in evaluated if c.fits] or evaluated
    m = min(fitting, key=_key("speed")).m if fitting else counts[0]
    reports, cands = [], []
    for name, cuts in baselines:
        kind = "1f1b" if model.training else "gpipe"
        cand = evaluate(model, None, kind, p, 1, m, cuts, caps, name=name)
        if not cand.fits and model.training:
            again = evaluate(model, None, kind, p, 1, m, cuts, caps, name=name, recompute=True)
            cand = again if again.fits else cand
        if m * p <= _SIMULATE_ABOVE:
            cand = cand.simulated()
        reports.append(BaselineReport(name=name, predicted_step_time_us=round(cand.step_us, 3),
                                      peak_memory_bytes=cand.max_peak,
                                      recompute=any(cand.recompute), fits=cand.fits))
        cands.append(cand)
    return reports, cands


def _report(res: ChainResult | None, options: SolveOptions, wall: float,
            best: Candidate) -> SolverReport:
    if res is None:
        name = "baseline" if best.name else "dp"
        return SolverReport(status="FEASIBLE", objective=round(best.step_us, 3),
                            bound=0.0, gap=1.0, wall_s=wall, name=f"cp-sat+{name}")
    scale = 1.0 if options.optimize == "memory" else 1.0 / TIME_UNITS_PER_US
    objective, bound = res.objective * scale, res.bound * scale
    gap = (objective - bound) / objective if objective > 0 else 0.0
    # A banded (big) solve's bound is _global_bound's relaxation of the chosen (kind, v, m)
    # chain problem, not CP-SAT's: the name says so.
    big = isinstance(best.sub, _Sub) and _is_big(best.sub) or res.status == "HINT"
    return SolverReport(status=res.status, objective=round(objective, 3), bound=round(bound, 3),
                        gap=round(gap, 6), wall_s=wall,
                        name="cp-sat-band+relaxation-bound" if big else "cp-sat")


def _memory_error(model: CostModel, cands: CutCandidates, caps: list[int],
                  configs: list[tuple[str, int]], counts: tuple[int, ...], p: int,
                  options: SolveOptions) -> InfeasiblePlanError:
    """Name the smallest peak any configuration reaches without a cap, and what would fit."""
    least: Candidate | None = None
    for kind, v in configs:
        for m in counts:
            if kind == "interleaved_1f1b" and m % p:
                continue
            mode = "none" if not options.training else (
                {None: "auto", True: "all", False: "none"}[options.recompute])
            prob = _chain_problem(model, cands, caps, kind, p, v, m, mode, options)
            seed = chain_dp_hint(replace(prob, rank_caps=None, optimize="memory"))
            if seed is None:
                continue
            cand = evaluate(model, cands, kind, p, v, m, seed, caps)
            if least is None or cand.max_peak < least.max_peak:
                least = cand
    if least is None:  # pragma: no cover - a chain always has some answer without caps
        return InfeasiblePlanError("no partition fits the memory cap")
    state_total = sum(model.state_bytes.values())
    need = max(math.ceil(state_total / max(min(caps), 1)), p + 1)
    rank = max(range(p), key=lambda r: least.peaks[r])
    return InfeasiblePlanError(
        f"no partition onto {p} ranks fits the memory cap: the smallest predicted peak is "
        f"{least.max_peak} bytes ({least.max_peak / _GIB:.3f} GiB, rank {rank}, "
        f"{least.kind}, v={least.v}, num_microbatches={least.m}, recompute="
        f"{sum(least.recompute)}/{len(least.recompute)} stages) but the cap is {min(caps)} bytes "
        f"({min(caps) / _GIB:.3f} GiB); use a memory cap of at least {least.max_peak} bytes "
        f"({math.ceil(least.max_peak / _GIB * 1000) / 1000:.3f} GiB), or more devices (at "
        f"least {need}: the parameter state alone is {state_total} bytes), or allow recompute")
