"""Collective costs (ring all-reduce, reduce-scatter, all-gather; all-to-all) on one link, in µs."""

from __future__ import annotations

from autopart.core.errors import PlanError

__all__ = ["all_reduce_us", "reduce_scatter_us", "all_gather_us", "all_to_all_us"]


def _check(nbytes: float, group: int, bandwidth_bytes_per_s: float, latency_us: float) -> None:
    if nbytes < 0 or group < 1 or bandwidth_bytes_per_s <= 0 or latency_us < 0:
        raise PlanError(f"collective of {nbytes} bytes over {group} ranks at "
                        f"{bandwidth_bytes_per_s} bytes/s, {latency_us} µs per step: need "
                        "bytes >= 0, ranks >= 1, bandwidth > 0 and latency >= 0")


def reduce_scatter_us(nbytes: float, group: int, bandwidth_bytes_per_s: float,
                      latency_us: float = 0.0) -> float:
    """Ring reduce-scatter of a buffer of ``nbytes`` (the whole, unsharded buffer) over
    ``group`` ranks: ``group - 1`` steps, each sending ``nbytes / group`` per rank.

    ``t = (n - 1) / n * nbytes / bw + (n - 1) * latency`` (Thakur, Rabenseifner and Gropp,
    "Optimization of Collective Communication Operations in MPICH", IJHPCA 2005; NCCL's
    ring). 0 for one rank or no bytes.

    Args:
        nbytes: the full buffer, bytes.
        group: ranks in the ring.
        bandwidth_bytes_per_s: each rank's link, one direction, bytes/s (bus bandwidth).
        latency_us: one ring step's fixed cost, µs.

    Returns:
        µs.

    Raises:
        PlanError: negative bytes or latency, fewer than one rank, or no bandwidth.
    """
    _check(nbytes, group, bandwidth_bytes_per_s, latency_us)
    if group == 1 or nbytes == 0:
        return 0.0
    steps = group - 1
    return steps / group * nbytes / bandwidth_bytes_per_s * 1e6 + steps * latency_us


def all_gather_us(nbytes: float, group: int, bandwidth_bytes_per_s: float,
                  latency_us: float = 0.0) -> float:
    """Ring all-gather producing a buffer of ``nbytes`` on every rank (each contributes
    ``nbytes / group``): the same cost as :func:`reduce_scatter_us`."""
    return reduce_scatter_us(nbytes, group, bandwidth_bytes_per_s, latency_us)


def all_reduce_us(nbytes: float, group: int, bandwidth_bytes_per_s: float,
                  latency_us: float = 0.0) -> float:
    """Ring all-reduce of ``nbytes``: a reduce-scatter then an all-gather,
    ``t = 2 (n - 1) / n * nbytes / bw + 2 (n - 1) * latency``."""
    return 2.0 * reduce_scatter_us(nbytes, group, bandwidth_bytes_per_s, latency_us)


def all_to_all_us(nbytes: float, group: int, bandwidth_bytes_per_s: float,
                  latency_us: float = 0.0) -> float:
    """All-to-all of ``nbytes`` per rank spread evenly over ``group`` ranks: each rank sends
    ``(n - 1) / n * nbytes`` to the others and receives as much,
    ``t = (n - 1) / n * nbytes / bw + (n - 1) * latency`` (the pairwise-exchange algorithm:
    Thakur, Rabenseifner and Gropp, IJHPCA 2005, section 3.6; NCCL runs all-to-all as
    ``n - 1`` concurrent sends and receives). 0 for one rank or no bytes."""
    return reduce_scatter_us(nbytes, group, bandwidth_bytes_per_s, latency_us)
