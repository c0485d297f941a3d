"""ParallelLayout: the (tp, pp, dp, ZeRO stage) degrees of a plan, checked against the cluster."""

from __future__ import annotations

from dataclasses import dataclass

from autopart.core.errors import PlanError

__all__ = ["ParallelLayout", "ZERO_STAGES", "divisors", "nearest", "check_zero_stage",
           "check_tp", "check_degrees", "check_global_batch", "layout_problem",
           "grad_bucket_elements"]

#: ZeRO stages: 0 none, 1 optimizer state, 2 + gradients, 3 + parameters (FSDP).
ZERO_STAGES = (0, 1, 2, 3)

def grad_bucket_elements(dp: int) -> int:
    """How many gradient elements one bucket of ZeRO-0's overlapped data-parallel all-reduce
    holds at most: Megatron-Core's default, ``max(40e6, 1e6 x dp)``
    (``DistributedDataParallelConfig.bucket_size``: "larger DP sizes need larger buckets to
    ensure collectives do not become latency-bound"). The runtime packs its buckets so
    (``autopart/runtime/distributed/_grad_buckets.py``) and the cost model prices them so
    (:func:`autopart.solver.data_parallel.overlapped_reduction_us`).

    Raises:
        PlanError: ``dp`` < 1.
    """
    if dp < 1:
        raise PlanError(f"dp={dp} must be >= 1")
    return max(40_000_000, 1_000_000 * dp)


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n`` (``n >= 1``), ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def nearest(value: int, valid: list[int], k: int = 2) -> list[int]:
    """Up to ``k`` entries of ``valid`` closest to ``value`` (ties: the smaller), ascending."""
    return sorted(sorted(valid, key=lambda x: (abs(x - value), x))[:k])


def check_zero_stage(zero_stage: int) -> None:
    """Raises PlanError when ``zero_stage`` is not one of :data:`ZERO_STAGES`."""
    if isinstance(zero_stage, bool) or zero_stage not in ZERO_STAGES:
        raise PlanError(f"zero_stage={zero_stage!r} is not a ZeRO stage; valid: 0 (none), "
                        "1 (optimizer state), 2 (+ gradients), 3 (+ parameters, FSDP)")


def check_tp(tp: int, *, gpus_per_host: int, num_heads: int | None = None) -> None:
    """A tensor-parallel degree must divide the GPUs of a host and the attention heads.

    Raises:
        PlanError: naming tp and the nearest valid degrees.
    """
    if tp < 1 or gpus_per_host % tp:
        raise PlanError(f"tp={tp} must divide the {gpus_per_host} GPUs per host (a tp group "
                        f"stays inside one host); nearest valid: "
                        f"{nearest(tp, divisors(gpus_per_host))}")
    if num_heads is not None and num_heads % tp:
        valid = [d for d in divisors(gpus_per_host) if num_heads % d == 0]
        raise PlanError(f"tp={tp} does not divide the model's {num_heads} attention heads; "
                        f"nearest valid: {nearest(tp, valid)}")


def check_degrees(tp: int, pp: int, dp: int, num_gpus: int) -> None:
    """``tp x pp x dp`` must be the GPU count.

    Raises:
        PlanError: naming the three degrees, their product and the nearest dp (or pp) that
            would make it.
    """
    if min(tp, pp, dp) < 1 or tp * pp * dp != num_gpus:
        hint = ""
        if tp >= 1 and pp >= 1 and num_gpus % (tp * pp) == 0:
            hint = f"; with tp={tp}, pp={pp} use dp={num_gpus // (tp * pp)}"
        elif tp >= 1 and num_gpus % tp == 0:
            rest = num_gpus // tp
            hint = (f"; with tp={tp}, pp must divide {rest}: nearest valid pp "
                    f"{nearest(pp, divisors(rest))}")
        raise PlanError(f"tp x pp x dp = {tp} x {pp} x {dp} = {tp * pp * dp}, but the cluster "
                        f"has {num_gpus} GPUs; the product must equal the GPU count{hint}")


def check_global_batch(batch_size: int, dp: int, num_microbatches: int | None = None) -> None:
    """The global batch must split over dp replicas (and m microbatches each).

    Raises:
        PlanError: naming the batch, dp, m and the nearest valid values.
    """
    if dp < 1 or batch_size % dp:
        valid = divisors(batch_size)
        raise PlanError(f"global batch {batch_size} does not split over dp={dp} replicas; "
                        f"nearest valid dp: {nearest(dp, valid)}, or a batch of "
                        f"{nearest(batch_size, [dp * k for k in range(1, batch_size // dp + 2)])}")
    per = batch_size // dp
    if num_microbatches is not None and (num_microbatches < 1 or per % num_microbatches):
        raise PlanError(f"global batch {batch_size} over dp={dp} gives {per} per replica, which "
                        f"m={num_microbatches} microbatches cannot split; nearest valid m: "
                        f"{nearest(num_microbatches, divisors(per))}")


def layout_problem(tp: int, dp: int, zero_stage: int, schema_version: int,
                   sharded: list[str]) -> str | None:
    """What is wrong with a plan file's tp, dp, zero_stage and sharded parameter names, or
    None (plan schema 1 has none of them: tp = dp = 1, ZeRO 0; only tp > 1 shards)."""
    if tp < 1 or dp < 1 or zero_stage > 3:
        return (f"tp={tp}, dp={dp}, zero_stage={zero_stage}: tp and dp must be >= 1 and "
                "zero_stage one of 0, 1, 2, 3")
    if schema_version == 1 and (tp, dp, zero_stage) != (1, 1, 0):
        return "schema_version 1 has no tp, dp or zero_stage; set schema_version 2"
    if sharded and tp == 1:
        return ("sharded_parameters listed with tp=1; tensor parallelism shards nothing at "
                "tp=1: drop them or set tp")
    if len(set(sharded)) != len(sharded):
        return "a parameter appears twice in sharded_parameters; list each once"
    return None


@dataclass(frozen=True, slots=True)
class ParallelLayout:
    """The degrees of a 3D plan: tp x pp x dp GPUs, with ZeRO ``zero_stage`` over dp.

    Attributes:
        tp: tensor-parallel degree (inside a host).
        pp: pipeline ranks.
        dp: data-parallel replicas.
        zero_stage: 0-3, what dp shards (:data:`ZERO_STAGES`).
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    zero_stage: int = 0

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlanError(f"{name}={value!r} must be an integer >= 1")
        check_zero_stage(self.zero_stage)

    @property
    def num_gpus(self) -> int:
        """tp x pp x dp."""
        return self.tp * self.pp * self.dp

    def describe(self) -> str:
        """E.g. ``"tp 8 x pp 4 x dp 32, ZeRO-1"``."""
        zero = f"ZeRO-{self.zero_stage}" if self.zero_stage else "no ZeRO"
        return f"tp {self.tp} x pp {self.pp} x dp {self.dp}, {zero}"
