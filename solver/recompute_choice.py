"""Op-level recompute (``recompute_policy="op"``): which node outputs each recomputing stage
keeps, chosen under the ranks' memory caps.

The candidate's cuts, microbatches, schedule and recompute flags are fixed; what is chosen
is, per recomputing stage, the set of nodes whose outputs torch's selective checkpointing
keeps from the forward to the backward (every other node runs again in the backward).
Keeping node ``i`` saves its forward time in the recomputation and costs its output bytes
for every microbatch the rank holds in flight at its peak. Both sums are additive over the
nodes, so the choice for one rank is a 0/1 knapsack: maximise the forward time kept, within
the rank's room under its cap. It is solved by OR-Tools' dynamic-programming knapsack solver
on weights in units of 1/20000 of the room, each rounded up (so the choice always fits; what
the rounding gives away is at most one unit per kept node). Exact branch and bound on the
bytes took about 1 s per rank on the 5550-node 1008B GPT's stages. This is Checkmate's
problem (Jain et al., "Checkmate: Breaking the Memory Wall with Optimal Tensor
Rematerialization", MLSys 2020) restricted to what
selective checkpointing can run: a node is either kept or run again once, in the stage's
single recomputation.

How many microbatches' worth each kept byte costs at the rank's peak is read from the cost
model (the peak with all of one stage's candidates kept, against none), and every choice is
checked on the exact evaluation; a rank found over its cap gets a smaller room and is
solved again. On measured costs (speed target) the choice then gives way to torch's
selective-op policy's set where that fits, holds less and is predicted within
``TIE_TOLERANCE`` of it: the knapsack fills its room however little a byte saves.

A stage never holds more per microbatch than it would without recompute
(:func:`keep_bounds`): keeping every node's output skips the
recomputation but holds every output, where autograd saves only some; such a stage would
be slower and larger than one that does not recompute. Measured on 2 gloo ranks (Llama,
4 layers, hidden 256, 4 x 1024 tokens, 1F1B m 4, every stage forced to recompute, no cap),
the unbounded choice held 274.9 MiB on the first rank where the same cut without recompute
held 184.1. Where a rank's choice breaks a stage's bound, that stage is solved alone within
it and the rank's other stages share what room is left (exact for one recomputing stage a
rank; for more, a stage fixed first may take room another would have used better). No torch
here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from ortools.algorithms.python import knapsack_solver

from autopart.core.op_names import VIEW_OPS
from autopart.core.recompute_policy import SELECTIVE_KEPT_NODE_OPS, op_keepable
from autopart.core.schedule import stage_ranks
from autopart.solver._candidate import TIE_TOLERANCE, Candidate, evaluate
from autopart.solver._cost_model import CostModel

__all__ = ["KeepItem", "keep_items", "keep_bounds", "choose_kept"]

#: Rounds of "solve, check on the exact evaluation, shrink the room of a rank found over".
_ROUNDS = 6
#: A rank found over its cap gets this share of its room in the next round.
_SHRINK = 0.8
#: The room of a rank in knapsack weight units (weights are rounded up to whole units).
_UNITS = 20000


@dataclass(frozen=True, slots=True)
class KeepItem:
    """One node a recomputing stage may keep.

    Attributes:
        node: index in ``costs.nodes``.
        stage: the stage it belongs to.
        time_us: its forward time at the microbatch size (what keeping it saves), µs.
        nbytes: what keeping it adds to the stage's held activations per microbatch, bytes
            (0: the stage holds that output anyway).
    """

    node: int
    stage: int
    time_us: float
    nbytes: int


def keep_items(model: CostModel, cand: Candidate) -> list[KeepItem]:
    """The nodes of ``cand``'s recomputing stages that ``"op"`` may keep: tensor outputs of
    ops with a forward time that are neither views, in place nor dropout
    (:func:`autopart.core.recompute_policy.op_keepable`), and that ``model`` does not keep
    already (tp's reductions)."""
    nodes = model.costs.nodes
    ratio = model.ratio(cand.m)
    bounds = [0, *cand.positions, len(nodes)]
    items = []
    for s, rc in enumerate(cand.recompute):
        if not rc:
            continue
        a, z = bounds[s], bounds[s + 1]
        costs = model.keep_costs(a, z)
        # what the recomputation does not run again (past the stage's last saved tensor,
        # CostModel.recompute_stop) saves nothing kept
        for i in range(a, model.recompute_stop(a, z)):
            nd = nodes[i]
            if model.kept[i] or not nd.output_is_tensor or not op_keepable(nd.op, VIEW_OPS):
                continue
            # keeping it saves its forward, less sequence parallelism's all-gathers before it
            # (gathered again either way)
            t = model.part_us("fwd", i, i + 1, ratio) - model.regather_us(i, ratio)
            if t > 0.0:
                items.append(KeepItem(i, s, t, model.scale_bytes(costs[i], ratio)))
    return items


def keep_bounds(model: CostModel, none: Candidate) -> dict[int, int]:
    """Per recomputing stage of ``none``, the most its kept nodes may add to what it holds per
    microbatch, bytes at ``none``'s microbatch size (the units of :attr:`KeepItem.nbytes`):
    what the stage holds per microbatch without recompute less what it holds recomputing
    and keeping nothing (``StageCosts.saved_bytes``), at least 0. ``none`` is the candidate
    evaluated on ``model`` with nothing kept (``model.with_kept(frozenset())``). With
    torch's stages that is what its nodes save for the backward (the inputs the
    recomputation starts from are its receive buffers, held either way)."""
    plain = evaluate(model, None, none.kind, len(none.peaks), none.v, none.m, none.positions,
                     None, sub=none.sub, recompute=False, name=none.name).costs.saved_bytes
    return {s: max(plain[s] - none.costs.saved_bytes[s], 0)
            for s, rc in enumerate(none.recompute) if rc}


def choose_kept(model: CostModel, cand: Candidate, caps: tuple[int, ...] | None,
                optimize: str) -> tuple[CostModel, Candidate]:
    """``cand`` under ``"op"`` with the nodes each recomputing stage keeps chosen.

    A rank's room is its cap less its peak with nothing kept (``optimize="speed"``); under
    ``"memory"``, or without caps, the plan's largest peak with nothing kept is every rank's
    limit, so the choice never raises the plan's largest peak.

    Args:
        model: the cost model ``cand`` was evaluated on (its ``"op"`` kept set is replaced).
        cand: a candidate whose recomputing stages are to keep what fits.
        caps: per-rank memory caps, bytes, or None.
        optimize: ``"speed"`` or ``"memory"``.

    Returns:
        The model with the chosen kept nodes and ``cand`` evaluated and simulated on it.
    """
    base = model.with_kept(frozenset())
    p = len(cand.peaks)

    def run(kept: frozenset[str]) -> tuple[CostModel, Candidate]:
        m = base.with_kept(kept)
        c = evaluate(m, None, cand.kind, p, cand.v, cand.m, cand.positions, caps,
                     sub=cand.sub, recompute=cand.recompute, name=cand.name).simulated()
        return m, c

    none_model, none = run(frozenset())
    items = keep_items(base, cand)
    if not items:
        return none_model, none
    names = [nd.name for nd in base.costs.nodes]
    rank_of = stage_ranks(cand.kind, p, cand.v)
    limit = ([min(cap, max(none.peaks)) if optimize == "memory" else cap for cap in caps]
             if caps is not None else [max(none.peaks)] * p)
    # per stage, bytes of peak per kept byte: its rank's peak with all the stage's items
    # kept against none; ranks' peaks do not depend on each other's kept nodes, so the k-th
    # recomputing stage of every rank is measured in one evaluation (v of them at most)
    stages = sorted({it.stage for it in items})
    order = {s: sum(rank_of[t] == rank_of[s] for t in stages if t < s) for s in stages}
    per_byte: dict[int, float] = {}
    for k in sorted(set(order.values())):
        group = [s for s in stages if order[s] == k]
        _, full = run(frozenset(names[it.node] for it in items if order[it.stage] == k))
        for s in group:
            total = sum(it.nbytes for it in items if it.stage == s)
            r = rank_of[s]
            per_byte[s] = max(full.peaks[r] - none.peaks[r], 0) / total if total else 0.0
    room = [max(limit[r] - none.peaks[r], 0) for r in range(p)]
    by_rank: dict[int, list[KeepItem]] = {}
    for it in items:
        by_rank.setdefault(rank_of[it.stage], []).append(it)
    bound = keep_bounds(base, none)
    chosen = {r: _rank_choice(mine, per_byte, room[r], bound) for r, mine in by_rank.items()}
    best = (none_model, none)
    for _ in range(_ROUNDS):
        kept = frozenset(names[it.node] for mine in chosen.values() for it in mine)
        m, c = run(kept)
        over = [r for r in by_rank if c.peaks[r] > limit[r]]
        if not over:
            best = (m, c)
            break
        for r in over:
            room[r] = int(room[r] * _SHRINK)
            chosen[r] = _rank_choice(by_rank[r], per_byte, room[r], bound)
    else:  # still over: keep only what costs nothing at the peak (within each stage's bound)
        kept = frozenset(names[it.node] for mine in by_rank.values()
                         for it in _rank_choice(mine, per_byte, 0, bound))
        best = run(kept)
    if optimize == "speed" and base.costs.source.startswith("measured"):
        best = _selective_on_a_tie(base, items, best, run, limit)
    # keeping nothing runs plain checkpointing (CostModel.checkpoints_selectively): where
    # selective checkpointing's cost per node outweighs what the kept nodes save, that
    # is faster, and it never holds more
    if none.step_us <= best[1].step_us:
        return none_model, none
    return best


def _selective_on_a_tie(base: CostModel, items: list[KeepItem],
                        best: tuple[CostModel, Candidate],
                        run: Callable[[frozenset[str]], tuple[CostModel, Candidate]],
                        limit: list[int]) -> tuple[CostModel, Candidate]:
    """``best``, or torch's selective-op policy's set (its kept node kinds among ``items``)
    where that fits ``limit`` per rank, holds less (largest peak, then all ranks') and
    ``best`` is not predicted more than :data:`TIE_TOLERANCE` faster (speed target, measured
    costs: a smaller gain is not known to be one).

    The knapsack fills the room it has with whatever saves time, however little a byte:
    on the demo's GPT-2 (2 gloo ranks, 1F1B m 4, the first stage recomputing) it kept 85
    nodes, their residual adds and GELU products among them, for a predicted 0.3 % over
    the selective set, and measured 1.7-2.1 % slower at 81 MiB more (the kernels between
    kept nodes run again either way)."""
    nodes = base.costs.nodes
    other = run(frozenset(nodes[it.node].name for it in items
                          if nodes[it.node].op in SELECTIVE_KEPT_NODE_OPS))
    c, mine = other[1], best[1]
    fits = all(peak <= cap for peak, cap in zip(c.peaks, limit, strict=True))
    less = (max(c.peaks), sum(c.peaks)) < (max(mine.peaks), sum(mine.peaks))
    if fits and less and mine.step_us * (1 + TIE_TOLERANCE) >= c.step_us:
        return other
    return best


def _rank_choice(items: list[KeepItem], per_byte: dict[int, float], room: int,
                 bound: dict[int, int]) -> list[KeepItem]:
    """The items of one rank that keep the most forward time within ``room`` bytes of its
    peak (each weighing its bytes times its stage's peak bytes per kept byte), no stage's
    kept bytes above its ``bound``. The rank's knapsack is solved whole; a stage found over
    its bound is then solved alone within it and the room it leaves, and the others again
    in what remains, until none is over."""
    def weight(it: KeepItem) -> int:
        return math.ceil(it.nbytes * per_byte[it.stage])

    fixed: list[KeepItem] = []
    rest = items
    while True:
        left = room - sum(weight(it) for it in fixed)
        chosen = _knapsack(rest, weight, left)
        held: dict[int, int] = {}
        for it in chosen:
            held[it.stage] = held.get(it.stage, 0) + it.nbytes
        over = [s for s in sorted(held) if held[s] > bound[s]]
        if not over:
            return fixed + chosen
        s = max(over, key=lambda t: (held[t] - bound[t], -t))
        mine = [it for it in rest if it.stage == s]
        # alone, the stage's weights are its bytes times one factor: both limits in bytes
        pb = per_byte[s]
        cap = min(bound[s], int(left / pb)) if pb > 0 else bound[s]
        fixed += _knapsack(mine, lambda it: it.nbytes, cap)
        rest = [it for it in rest if it.stage != s]


def _knapsack(items: list[KeepItem], weight: Callable[[KeepItem], int],
              room: int) -> list[KeepItem]:
    """The ``items`` that keep the most forward time within ``room`` (in ``weight``'s
    units); items that weigh nothing are always taken. OR-Tools' dynamic-programming solver
    on weights in units of ``room / 20000`` (at least 1), each rounded up."""
    weights = [weight(it) for it in items]
    free = [it for it, w in zip(items, weights, strict=True) if w == 0]
    rest = [(it, w) for it, w in zip(items, weights, strict=True) if 0 < w <= room]
    if not rest:
        return free
    unit = max(room / _UNITS, 1.0)
    solver = knapsack_solver.KnapsackSolver(
        knapsack_solver.SolverType.KNAPSACK_DYNAMIC_PROGRAMMING_SOLVER, "autopart-recompute")
    solver.init([max(1, round(it.time_us * 1000)) for it, _ in rest],
                [[math.ceil(w / unit) for _, w in rest]], [int(room / unit)])
    solver.solve()
    return free + [it for k, (it, _) in enumerate(rest) if solver.best_solution_contains(k)]
