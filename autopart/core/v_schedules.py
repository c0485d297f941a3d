"""V-shaped schedules (ZB-V, DualPipe-V): two stages per rank placed in a V, and their action lists."""

from __future__ import annotations

from autopart.core.errors import PlanError

__all__ = ["V_SCHEDULE_KINDS", "v_stage_ranks", "zbv_rank_actions", "dualpipev_rank_actions",
           "dualpipev_pairs"]

#: Schedule kinds that place two stages on each rank in a V (rank r: stages r and 2p - 1 - r).
V_SCHEDULE_KINDS = ("zbv", "dualpipev")

# An action as (stage_index, kind, mb_index); schedule.py turns these into Action objects
# (this module is what schedule.py imports, not the other way round).
_Act = tuple[int, str, int]


def v_stage_ranks(num_ranks: int) -> tuple[int, ...]:
    """Stage -> rank of the V placement of ``2 p`` stages on ``p`` ranks: stages ``0 .. p - 1``
    go down the ranks, stages ``p .. 2p - 1`` come back up, so rank ``r`` runs stages ``r`` and
    ``2p - 1 - r`` and rank 0 holds the first and the last stage.

    Equals torch's ``generate_stage_to_rank_mapping(p, 2p, style="v")``
    (torch.distributed.pipelining._utils, torch 2.6 - 2.13; tested).

    Raises:
        PlanError: ``num_ranks < 1``.
    """
    if num_ranks < 1:
        raise PlanError(f"num_ranks={num_ranks} must be >= 1")
    p = num_ranks
    return tuple(s if s < p else 2 * p - 1 - s for s in range(2 * p))


def zbv_rank_actions(num_ranks: int, num_microbatches: int, rank: int) -> list[_Act]:
    """ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, section 6): rank
    ``rank``'s actions, in the order torch 2.13's ``ScheduleZBVZeroBubble`` builds them
    (``_calculate_single_rank_operations``, the same algorithm; tested against it).

    Chunk 0 is stage ``r``, chunk 1 stage ``2p - 1 - r``. Warm-up: ``2 (p - r) - 1`` chunk-0
    forwards, ``r`` pairs of (chunk-1 F, chunk-0 F), ``p - r`` of (chunk-1 F, I, W); steady
    state: (chunk-0 F, I, W, chunk-1 F, I, W); cool-down: the input gradients first, the
    weight gradients filling the bubbles after. The schedule is built for
    ``max(m, 2p - 1)`` microbatches and the actions of microbatches ``>= m`` are dropped,
    as torch does.
    """
    p, r = num_ranks, rank
    n = max(2 * p - 1, num_microbatches)
    c0, c1 = r, 2 * p - 1 - r
    out: list[_Act] = []
    f0 = f1 = b0 = b1 = 0
    for _ in range(2 * (p - r) - 1):
        out.append((c0, "F", f0))
        f0 += 1
    for _ in range(r):
        out += [(c1, "F", f1), (c0, "F", f0)]
        f1 += 1
        f0 += 1
    for _ in range(p - r):
        out += [(c1, "F", f1), (c1, "I", b1), (c1, "W", b1)]
        f1 += 1
        b1 += 1
    while f1 < f0 or f0 < n:
        if f0 < n:
            out.append((c0, "F", f0))
            f0 += 1
        out += [(c0, "I", b0), (c0, "W", b0), (c1, "F", f1), (c1, "I", b1), (c1, "W", b1)]
        b0 += 1
        f1 += 1
        b1 += 1
    w0, w1 = b0, b1
    for _ in range(r):
        out += [(c0, "I", b0), (c1, "I", b1)]
        b0 += 1
        b1 += 1
    for _ in range(p - r):
        out += [(c0, "I", b0), (c0, "W", w0)]
        b0 += 1
        w0 += 1
    out += [(c1, "W", w) for w in range(w1, b1)]
    out += [(c0, "W", w) for w in range(w0, b0)]
    return [a for a in out if a[2] < num_microbatches]


def dualpipev_rank_actions(num_ranks: int, num_microbatches: int, rank: int) -> list[_Act]:
    """DualPipe-V's actions of rank ``rank`` (see :func:`_dualpipev`)."""
    return _dualpipev(num_ranks, num_microbatches, rank)[0]


def dualpipev_pairs(num_ranks: int, num_microbatches: int, rank: int,
                    ) -> frozenset[tuple[_Act, _Act]]:
    """The overlapped forward-backward pairs of rank ``rank``'s DualPipe-V actions: each
    ``(F of one chunk, B of the other)`` that torch 2.13's ``ScheduleDualPipeV`` writes as
    one ``OVERLAP_F_B`` action, the forward immediately followed by its backward in
    :func:`dualpipev_rank_actions`. The last rank's first main-step forward and backward are
    not a pair (torch keeps them apart to shorten the bubble), nor is any action of the
    warm-up or the tail.

    Raises:
        PlanError: ``m < 2p`` (as :func:`dualpipev_rank_actions`).
    """
    return frozenset(_dualpipev(num_ranks, num_microbatches, rank)[1])


def _dualpipev(num_ranks: int, num_microbatches: int, rank: int,
               ) -> tuple[list[_Act], list[tuple[_Act, _Act]]]:
    """DualPipe-V (DeepSeek-V3 report, arXiv 2412.19437; the V variant of
    github.com/deepseek-ai/DualPipe): rank ``rank``'s actions, in the order torch 2.13's
    ``ScheduleDualPipeV`` builds them (``_calculate_single_rank_operations``, the same
    algorithm; tested against it), with each overlapped forward-backward pair
    (``OVERLAP_F_B``) written as its forward then its full backward, and listed as a pair:
    torch's runtime runs the pair's two sub-actions one after the other unless a custom
    overlap function is registered, as the distributed runtime does for expert parallelism
    (:func:`autopart.core.plan_rules.overlaps_expert_exchanges`).

    Steps: ``2 (p - r - 1)`` chunk-0 forwards; ``r + 1`` (F0, F1); ``p - r - 1`` (I1, a
    pending W, F1); ``m - 2p + r + 1`` main pairs (F0 + B1, F1 + B0); ``p - r - 1``
    (B1, F1 + B0); ``r + 1`` (B1, B0) switching to I from the middle; ``p - r - 1``
    (pending W, B0 or I0); then every pending W.

    Raises:
        PlanError: fewer microbatches than stages (``m < 2p``; torch refuses them too).
    """
    p, r, m = num_ranks, rank, num_microbatches
    if m < 2 * p:
        raise PlanError(f"dualpipev needs at least as many microbatches as stages: "
                        f"num_microbatches={m} < 2 x {p} ranks; choose m >= {2 * p}")
    c0, c1 = r, 2 * p - 1 - r
    out: list[_Act] = []
    pairs: list[tuple[_Act, _Act]] = []
    count: dict[tuple[int, str], int] = {}
    weights: list[tuple[int, int]] = []  # (stage, microbatch) whose W is still to run

    def add(stage: int, kind: str) -> None:
        key = (stage, "I" if kind == "B" else kind)
        mb = count.get(key, 0)
        out.append((stage, kind, mb))
        count[key] = mb + 1
        if kind == "I":
            weights.append((stage, mb))

    def add_weight() -> None:
        if weights:
            stage, mb = weights.pop(0)
            out.append((stage, "W", mb))

    for _ in range(2 * (p - r - 1)):
        add(c0, "F")
    for _ in range(r + 1):
        add(c0, "F")
        add(c1, "F")
    for _ in range(p - r - 1):
        add(c1, "I")
        add_weight()
        add(c1, "F")
    def pair(forward: int, backward: int, overlapped: bool = True) -> None:
        add(forward, "F")
        add(backward, "B")
        if overlapped:
            pairs.append((out[-2], out[-1]))

    for i in range(m - 2 * p + r + 1):
        pair(c0, c1, overlapped=not (i == 0 and r == p - 1))  # as torch: shorter bubble
        pair(c1, c0)
    for _ in range(p - r - 1):
        add(c1, "B")
        pair(c1, c0)
    split = False
    steps = r + 1
    for i in range(steps):
        if i == steps // 2 and r % 2 == 1:
            split = True
        add(c1, "I" if split else "B")
        if i == steps // 2 and r % 2 == 0:
            split = True
        add(c0, "I" if split else "B")
    for _ in range(p - r - 1):
        add_weight()
        add(c0, "I" if split else "B")
    for _ in range(r + 1):
        add_weight()
    return out, pairs
