"""The search grid of solve(): cut candidates, and per (kind, v, m) a chain problem and its seed.

:func:`setup` gathers what every later step reads (:class:`Setup`): the cost model, the cut
candidates with the baselines' and a previous plan's cuts added, the per-rank caps and the
(kind, v) x m grid. :func:`subproblems` turns each allowed (kind, v, m) into a
:class:`~autopart.solver.chain.ChainProblem` and seeds it with the exact min-max DP (or a
previous plan's cuts when they fit and are no worse).
"""

from __future__ import annotations

from dataclasses import dataclass

from autopart.core.cluster import Cluster
from autopart.core.costgraph import CostGraph
from autopart.core.errors import InfeasiblePlanError, PlanError
from autopart.core.plan import Plan
from autopart.core.recompute_policy import CHECKPOINTED_POLICIES
from autopart.core.schedule import check_microbatches, splits_backward, stage_ranks
from autopart.core.v_schedules import V_SCHEDULE_KINDS
from autopart.solver._closed_form import in_flight, objective_weights
from autopart.solver._cost_model import TIME_UNITS_PER_US, CostModel
from autopart.solver.baselines import baseline_partitions
from autopart.solver.candidates import CutCandidates, add_positions, crossing_profile, find_candidates
from autopart.solver.chain import ChainAnswer, ChainProblem
from autopart.solver.chain_cpsat import ChainResult
from autopart.solver.chain_dp import chain_dp_hint
from autopart.solver.options import SolveOptions

__all__ = ["Setup", "Subproblem", "setup", "subproblems", "chain_problem", "runs_microbatches"]


@dataclass(frozen=True, slots=True, eq=False)
class Setup:
    """What every step of :func:`autopart.solver.solve` reads.

    Attributes:
        costs: the cost graph, profiled at ``costs.batch_size``.
        cluster: the devices; stages are placed as each schedule kind places them
            (:func:`autopart.core.schedule.stage_ranks`).
        options: the request.
        model: the cost model at ``options.batch_size``.
        cands: cut candidates, the baselines' and the hint's cut positions included.
        caps: per-rank memory cap, bytes.
        configs: the (schedule kind, v) pairs with at least p x v segments.
        counts: the microbatch counts m searched, ascending.
        mode: the chain problems' recompute mode (``"none"`` for inference).
        baselines: (name, cut positions) of every baseline that applies (none for p = 1).
    """

    costs: CostGraph
    cluster: Cluster
    options: SolveOptions
    model: CostModel
    cands: CutCandidates
    caps: list[int]
    configs: list[tuple[str, int]]
    counts: tuple[int, ...]
    mode: str
    baselines: list[tuple[str, tuple[int, ...]]]

    @property
    def p(self) -> int:
        """Number of ranks."""
        return self.cluster.num_ranks


@dataclass(frozen=True, slots=True)
class Subproblem:
    """One (kind, v, m) subproblem: its chain problem, seed and CP-SAT result."""

    kind: str
    v: int
    m: int
    problem: ChainProblem
    seed: ChainAnswer | None
    result: ChainResult | None = None

    @property
    def answer(self) -> ChainAnswer:
        """CP-SAT's answer, or the seed where CP-SAT was not run (or found nothing)."""
        if self.result is not None:
            return self.result.answer
        assert self.seed is not None
        return self.seed


def setup(costs: CostGraph, cluster: Cluster, options: SolveOptions,
          kept_nodes: frozenset[str] = frozenset()) -> Setup:
    """The cost model, candidates, caps and search grid of one :func:`solve` call.

    Raises:
        PlanError: bad options (see :class:`~autopart.solver.options.SolveOptions`).
        InfeasiblePlanError: fewer candidate segments than ranks.
    """
    p = cluster.num_ranks
    configs = options.configurations(p)
    counts = options.microbatch_counts()
    caps = [dev.memory_bytes if options.memory_cap_bytes is None else options.memory_cap_bytes
            for dev in cluster.devices]
    model = CostModel.for_options(costs, cluster, options, kept_nodes=kept_nodes)
    baselines = _baseline_cuts(costs, p) if options.baselines else []
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
    return Setup(costs, cluster, options, model, cands, caps, configs, counts, mode, baselines)


def subproblems(st: Setup) -> list[Subproblem]:
    """Every allowed (kind, v, m) with its chain problem and seed, in grid order.

    Equal chain problems are seeded once (1F1B and ZB-H1 share theirs for inference; in
    training ZB-H1's hides W and may pay a split cost).

    Raises:
        PlanError: interleaving is the only kind asked for and no m is a multiple of p.
    """
    p = st.p
    grid = [(kind, v, m) for kind, v in st.configs for m in st.counts
            if runs_microbatches(kind, p, m)]
    problems = {key: chain_problem(st, *key) for key in grid}
    seeds: dict[ChainProblem, ChainAnswer | None] = {}
    # seeded count by count (a pure function of the problem, so the order changes nothing
    # but speed): the kinds of one m share the DP's band tables (chain_dp._LAST_ARRAYS)
    for key in sorted(grid, key=lambda k: k[2]):
        prob = problems[key]
        if prob not in seeds:
            seeds[prob] = _seed(prob, st.cands, st.options.hint, st.costs)
    subs = [Subproblem(kind, v, m, problems[kind, v, m], seeds[problems[kind, v, m]])
            for kind, v, m in grid]
    if not subs:
        kinds = sorted({kind for kind, _ in st.configs})
        if kinds == ["interleaved_1f1b"]:
            raise PlanError(f"no microbatch count in {list(st.counts)} is a multiple of the {p} "
                            "ranks that interleaved_1f1b needs; allow another m or schedule")
        raise PlanError(f"no microbatch count in {list(st.counts)} suits the schedule(s) "
                        f"{kinds} on {p} ranks (interleaved_1f1b needs a multiple of the ranks, "
                        f"dualpipev at least {2 * p}); allow another m or schedule")
    return subs


def runs_microbatches(kind: str, p: int, m: int) -> bool:
    """Whether schedule ``kind`` runs ``m`` microbatches on ``p`` ranks
    (:func:`autopart.core.schedule.check_microbatches`)."""
    try:
        check_microbatches(kind, p, m)
    except PlanError:
        return False
    return True


def chain_problem(st: Setup, kind: str, v: int, m: int) -> ChainProblem:
    """The chain problem of (kind, v, m): segment times and memory at the microbatch size,
    sends, caps less the largest transient (and ZeRO layer units' bound per stage,
    :meth:`MemoryModel.layer_units_bound_bytes`), and the kind's closed-form objective
    weights."""
    model, cands, options, p = st.model, st.cands, st.options, st.p
    ratio = model.ratio(m)
    seg_t, out_t, in_t = model.chain_time(cands, m)
    seg_w: list[int] | None = None
    seg_x: list[int] | None = None
    if options.training and splits_backward(kind, False) and kind not in V_SCHEDULE_KINDS:
        # (ZB-H1's closed form; the V schedules' is the interleaved one, without hidden W:
        # their split cost is priced exactly when candidates are costed)
        # the stages after the first split their backward at the measured cost (stage 0's
        # inputs need no gradient, so it runs its backward whole; a recomputed stage does not
        # split either) and run their W off the critical path (ChainProblem.hides_weight)
        if model.charges_split:
            seg_x = [int(round(TIME_UNITS_PER_US * model.split_overhead_us(s.start, s.stop, ratio)))
                     for s in cands.segments]
        seg_w = [int(round(TIME_UNITS_PER_US * (
            model.part_us("bwd_weight", s.start, s.stop, ratio)
            + model.split_overhead_us(s.start, s.stop, ratio)))) for s in cands.segments]
    # what recomputing adds: the forward run again (all of it, or its unkept nodes' under the
    # selective policy), and what such a stage still keeps (selective)
    seg_f = [int(round((model.part_us("recompute", s.start, s.stop, ratio)
                        + model.recompute_fwd_extra_us(s.start, s.stop)) * TIME_UNITS_PER_US))
             for s in cands.segments]
    rc_parts = [model.chain_kept_bytes(s.start, s.stop) for s in cands.segments] \
        if options.training and model.recompute_policy in CHECKPOINTED_POLICIES else None
    # state of the parameters first read in each segment; saved bytes at the microbatch size
    state = [model.first_use_state_bytes(s.start, s.stop) for s in cands.segments]
    saved = [model.scale_bytes(model.saved_bytes(s.start, s.stop), ratio) if options.training
             else 0 for s in cands.segments]
    cut_b = [model.scale_bytes(c, ratio) for c in cands.crossing_bytes]
    n = len(model.costs.nodes)
    # the largest single-node working set, and ZeRO layer units' gathered layers per stage
    # (their bound: not a sum over segments)
    transient = model.max_transient_bytes(ratio) + v * model.layer_units_bound_bytes()
    w_stage, w_rank, w_sum = objective_weights(kind, p, m, v)
    speed = tuple(model.speed(r) for r in range(p))
    return ChainProblem(
        seg_time=tuple(seg_t), seg_fwd=tuple(seg_f if options.training else [0] * len(seg_f)),
        cut_out=tuple(out_t), cut_in=tuple(in_t), num_ranks=p, stages_per_rank=v,
        speed=None if all(f == 1.0 for f in speed) else speed,
        w_stage=w_stage, w_rank=w_rank, w_sum=w_sum, seg_state=tuple(state),
        seg_saved=tuple(saved), cut_bytes=tuple(cut_b),
        first_in_bytes=model.scale_bytes(model.crossing[0], ratio),
        last_out_bytes=model.scale_bytes(model.crossing[n], ratio),
        in_flight=in_flight(kind, p, m, v, options.training),
        outputs_held=options.training and model.held_bytes_cover_outputs,
        rank_caps=tuple(max(c - transient, 0) for c in st.caps), recompute=st.mode,
        optimize=options.optimize, seg_bwd_weight=None if seg_w is None else tuple(seg_w),
        seg_split=None if seg_x is None else tuple(seg_x),
        placement=stage_ranks(kind, p, v) if kind in V_SCHEDULE_KINDS else None,
        seg_rc_kept=None if rc_parts is None else tuple(model.scale_bytes(a, ratio)
                                                        for a in rc_parts))


def _baseline_cuts(costs: CostGraph, p: int) -> list[tuple[str, tuple[int, ...]]]:
    """(name, cut positions) of every baseline partitioner that applies onto p ranks."""
    if p < 2:
        return []
    try:
        return [(name, tuple(cuts)) for name, cuts in baseline_partitions(costs, p)]
    except PlanError:
        return []


def _valid_count(costs: CostGraph, p: int) -> int:
    """How many stages the graph's valid cut positions allow (at least p)."""
    _, valid = crossing_profile(costs)
    return max(p, sum(valid[1:len(costs.nodes)]) + 1)


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
