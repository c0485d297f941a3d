"""Data parallelism and ZeRO: parameter state per GPU and the gradient / parameter collectives."""

from __future__ import annotations

from dataclasses import dataclass

from autopart.core.layout import check_zero_stage
from autopart.solver.collectives import all_gather_us, all_reduce_us, reduce_scatter_us

__all__ = ["state_multiplier", "DataParallelCost", "data_parallel_cost"]


def state_multiplier(zero_stage: int, dp: int, optimizer_factor: float,
                     gradient_factor: float = 1.0) -> float:
    """Bytes each GPU holds per byte of a trainable parameter it owns (after tp), under ZeRO.

    With weights 1x, gradients ``gradient_factor`` x and optimizer state ``optimizer_factor`` x
    the parameter's bytes (Rajbhandari et al., "ZeRO", SC'20, section 5.1):

    - stage 0: ``1 + g + k``
    - stage 1 (optimizer state sharded over dp): ``1 + g + k / dp``
    - stage 2 (+ gradients): ``1 + (g + k) / dp``
    - stage 3 (+ parameters, FSDP): ``(1 + g + k) / dp``

    E.g. bf16 weights with fp32 master weights and Adam moments (``k = 6``, ``g = 1``): 16
    bytes per parameter at stage 0, ``4 + 12 / dp`` at stage 1.

    Raises:
        PlanError: a ZeRO stage outside 0-3.
    """
    check_zero_stage(zero_stage)
    g, k = gradient_factor, optimizer_factor
    if zero_stage == 0:
        return 1.0 + g + k
    if zero_stage == 1:
        return 1.0 + g + k / dp
    if zero_stage == 2:
        return 1.0 + (g + k) / dp
    return (1.0 + g + k) / dp


@dataclass(frozen=True, slots=True)
class DataParallelCost:
    """What data parallelism adds to one rank's training step.

    Attributes:
        per_step_us: gradient reduction (and, under ZeRO 1-2, the all-gather of the updated
            parameters) once per step, after the last backward, µs.
        per_microbatch_us: ZeRO-3's parameter all-gathers (forward and backward) and gradient
            reduce-scatter, paid for every microbatch, µs.
        gathered_bytes: parameter bytes ZeRO-3 holds gathered at once (the largest layer's,
            twice: the one running and the one prefetched), 0 below stage 3.
    """

    per_step_us: float
    per_microbatch_us: float
    gathered_bytes: int

    def step_us(self, num_microbatches: int) -> float:
        """Total on one rank for ``num_microbatches`` microbatches, µs (none of it overlapped
        with compute: Megatron-LM's SC'21 runtime reduces gradients after the pipeline flush)."""
        return self.per_step_us + num_microbatches * self.per_microbatch_us


def data_parallel_cost(param_bytes: int, largest_layer_bytes: int, *, dp: int, zero_stage: int,
                       bandwidth_bytes_per_s: float, latency_us: float,
                       gradient_factor: float = 1.0) -> DataParallelCost:
    """The collectives one rank pays over its dp group.

    - stage 0: ring all-reduce of the gradients (``g x param_bytes``) once per step.
    - stages 1-2: reduce-scatter of the gradients, then all-gather of the updated parameters
      (ZeRO, SC'20, section 7: the same volume as an all-reduce).
    - stage 3: per microbatch, an all-gather of the parameters in forward and again in
      backward, and a reduce-scatter of the gradients (ZeRO's 1.5x of an all-reduce, paid
      per microbatch because a pipeline runs m forward/backward passes per step).

    Args:
        param_bytes: trainable parameter bytes this rank holds before ZeRO (after tp).
        largest_layer_bytes: the largest single node's parameter bytes on the rank (ZeRO-3
            gathers layer by layer).
        dp: replicas.
        zero_stage: 0-3.
        bandwidth_bytes_per_s: the dp group's link (bus bandwidth), bytes/s.
        latency_us: one ring step, µs.
        gradient_factor: gradient bytes per parameter byte (1.0: same dtype).

    Raises:
        PlanError: a ZeRO stage outside 0-3, or bad link figures.
    """
    check_zero_stage(zero_stage)
    grads = param_bytes * gradient_factor
    if zero_stage == 0:
        return DataParallelCost(all_reduce_us(grads, dp, bandwidth_bytes_per_s, latency_us),
                                0.0, 0)
    if zero_stage in (1, 2):
        return DataParallelCost(
            reduce_scatter_us(grads, dp, bandwidth_bytes_per_s, latency_us)
            + all_gather_us(param_bytes, dp, bandwidth_bytes_per_s, latency_us), 0.0, 0)
    per_mb = (2 * all_gather_us(param_bytes, dp, bandwidth_bytes_per_s, latency_us)
              + reduce_scatter_us(grads, dp, bandwidth_bytes_per_s, latency_us))
    gathered = 2 * largest_layer_bytes if dp > 1 else 0
    return DataParallelCost(0.0, per_mb if dp > 1 else 0.0, gathered)
