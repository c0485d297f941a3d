"""Ports of the partition algorithms other pipeline libraries publish (DeepSpeed, torchgpipe)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from autopart.core.errors import BaselineNotApplicable, PlanError

__all__ = ["partition_balanced", "block_partition"]


def partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """DeepSpeed's ``partition_balanced``: boundaries of ``num_parts`` contiguous parts.

    Port of ``deepspeed.runtime.utils.partition_balanced`` (the dynamic-programming version):
    ``cost[i][j]`` is the spread (largest minus smallest part) of the best ``j``-part split of the
    first ``i`` weights, keeping one ``(max, min)`` per state; ties go to the later split point
    (DeepSpeed's ``>=``). With ``len(weights) <= num_parts`` it falls back to
    ``partition_uniform`` as DeepSpeed does.

    Args:
        weights: per-item weights (parameter counts), >= 0.
        num_parts: number of parts, >= 1.

    Returns:
        ``num_parts + 1`` boundaries: part ``j`` is ``weights[parts[j]:parts[j + 1]]``.
    """
    n, m = len(weights), num_parts
    if n <= m:
        return [min(p, n) for p in range(m + 1)]
    inf = float("inf")
    prefix = [0.0, *itertools.accumulate(float(w) for w in weights)]
    dp_max = [[inf] * (m + 1) for _ in range(n + 1)]
    dp_min = [[inf] * (m + 1) for _ in range(n + 1)]
    dp_cost = [[inf] * (m + 1) for _ in range(n + 1)]
    position = [[0] * (m + 1) for _ in range(n + 1)]
    dp_max[0][0] = dp_cost[0][0] = 0.0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                part = prefix[i] - prefix[k]
                max_sum = max(dp_max[k][j - 1], part)
                min_sum = min(dp_min[k][j - 1], part)
                cost = max_sum - min_sum
                if dp_cost[i][j] >= cost:
                    dp_cost[i][j], dp_max[i][j], dp_min[i][j] = cost, max_sum, min_sum
                    position[i][j] = k
    parts = [n]
    for j in range(m, 0, -1):
        parts.append(position[parts[-1]][j])
    return parts[::-1]


def block_partition(sequence: Sequence[float], partitions: int) -> list[int]:
    """torchgpipe's ``blockpartition.solve``, returning the stop index of each block.

    Port of ``torchgpipe/balance/blockpartition.py`` (Bárány and Grinberg, "Block partitions of
    sequences", arXiv:1308.2452): normalise the sequence to [0, 1]; start from blocks of
    ``n // k`` items (the last takes the rest); repeatedly take a largest block p (ties: the
    later) and a smallest block q (ties: the earlier); stop when ``size(p) <= size(q) + 1`` in
    normalised units, else move one item into q from its neighbour on p's side. "The result
    might not be optimal" (torchgpipe's docstring).

    Args:
        sequence: per-layer costs.
        partitions: number of blocks k, ``1 <= k <= len(sequence)``.

    Returns:
        ``k`` stop indices, the last ``len(sequence)``.

    Raises:
        PlanError: ``partitions < 1`` or more than the sequence's items (where torchgpipe
            raises ValueError).
        BaselineNotApplicable: no convergence within ``100 * n * k`` moves (a guard torchgpipe
            does not have).
    """
    if partitions < 1:
        raise PlanError(f"block_partition: partitions={partitions} must be >= 1; ask for at "
                        "least one block")
    n = len(sequence)
    if n < partitions:
        raise PlanError(f"block_partition: partitions={partitions} but the sequence has only {n} "
                        f"items (each block needs one); use at most {n} partitions")
    low = min(sequence)
    span = max(sequence) - low
    norm = [0.0] * n if span == 0 else [(x - low) / span for x in sequence]
    splits = [n // partitions * (x + 1) for x in range(partitions - 1)] + [n]

    def block_size(i: int) -> float:
        return sum(norm[splits[i - 1] if i > 0 else 0: splits[i]])

    def board() -> list[tuple[float, int]]:
        return [(block_size(i), i) for i in range(partitions)]

    for _ in range(100 * n * partitions):
        max_size, p = max(board())
        while True:
            min_size, q = min(board())
            if max_size <= min_size + 1:
                return splits
            if p < q:
                h = q - 1
                splits[h] -= 1
            else:
                h = q + 1
                splits[q] += 1
            if p == h:
                break
    raise BaselineNotApplicable(f"block partition did not converge for {n} layers into "
                                f"{partitions} blocks")
