"""Data parallelism and ZeRO: parameter state per GPU and the gradient / parameter collectives."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from autopart.core.errors import PlanError
from autopart.core.layout import check_zero_stage
from autopart.solver.collectives import all_gather_us, all_reduce_us

__all__ = ["state_multiplier", "held_state_multiplier", "DataParallelCost", "data_parallel_cost",
           "gradient_all_reduce_us", "bucket_sizes", "overlapped_reduction_us",
           "sharded_state_multiplier", "layer_unit_factors", "fsdp_collective_us",
           "UnitSegment", "layer_units_exposed_us"]


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


def held_state_multiplier(zero_stage: int, dp: int, optimizer_factor: float,
                          gradient_factor: float = 1.0) -> float:
    """Bytes a rank holds at its step's peak per byte of a trainable parameter of its stages
    (after tp), as autopart's runtime runs ZeRO: the per-stage peak's parameter-state term.

    :func:`state_multiplier` is what the ZeRO paper's runtime holds at rest. autopart runs
    ZeRO 1-3 with FSDP2; with one ``fully_shard`` unit per stage (``Plan.zero_layer_units``
    False, ``autopart/runtime/distributed/_sharding.py``; per layer see
    :func:`layer_unit_factors`) during a stage's backward the rank holds,
    beside its shards (weights ``1 / dp``, optimizer state ``k / dp`` and, at ZeRO 2-3, whose
    gradients are reduce-scattered after every microbatch, gradients ``g / dp``):

    - the whole stage's parameters gathered (``1``): ZeRO-1/2 keep them from the forward to
      the backward (``reshard_after_forward=False``), ZeRO-3 gathers them again for the
      backward;
    - the stage's unsharded gradients (``g``): FSDP2 accumulates them unsharded until the
      reduce-scatter (once per step at ZeRO-1, after each backward at ZeRO 2-3);
    - the collectives' buffers FSDP2 keeps beside them (torch 2.13,
      ``_fsdp_param_group.py``): the reduce-scatter's input, a copy of the stage's gradients
      (``g``), is kept until the stage's next reduce-scatter (``reduce_scatter_states``),
      and an all-gather's output (``1``) that a forward's pre-hook ran is kept until the
      next all-gather's copy-out (``all_gather_state``). ZeRO 2-3 reduce and re-gather every
      microbatch, so a backward can find both (``1 + g``): on the 2-core CPU runs of
      ``benchmarks/zero_memory`` pp rank 0's ZeRO-2/3 peak was, in some runs, two stages'
      parameters above the others. ZeRO-1 gathers once, before the first forward, and
      reduces once, after the last backward: one of them (``max(1, g)``; a pp rank 1 peak
      one stage's parameters high in some runs).

    So ZeRO-1: ``(1 + k) / dp + 1 + g + max(1, g)``; ZeRO 2-3:
    ``(1 + g + k) / dp + 1 + g + 1 + g``; ZeRO-0 or ``dp == 1`` (nothing sharded):
    ``1 + g + k``. E.g. float32 AdamW (``k = 2``, ``g = 1``) at dp = 2: 4 (ZeRO-0), 4.5
    (ZeRO-1), 6 (ZeRO 2-3): more than ZeRO-0 at dp = 2 with whole stages as FSDP units.
    A rank with several stages is charged every stage's gathered copy and buffers (ZeRO-1
    holds every gathered copy; ZeRO 2-3 one stage's at a time: an upper bound there).

    ZeRO-1's reduce-scatter, at the step's end, also creates the sharded gradients
    (``g / dp``) beside the unsharded ones and its input; the activations are freed by then,
    which this term does not see (a rank whose activations held less than ``g / dp`` of its
    parameters would peak there, above this figure).

    Raises:
        PlanError: a ZeRO stage outside 0-3.
    """
    check_zero_stage(zero_stage)
    g, k = gradient_factor, optimizer_factor
    if zero_stage == 0 or dp == 1:
        return 1.0 + g + k
    if zero_stage == 1:
        return (1.0 + k) / dp + 1.0 + g + max(1.0, g)
    return (1.0 + g + k) / dp + 1.0 + g + 1.0 + g


def sharded_state_multiplier(dp: int, optimizer_factor: float,
                             gradient_factor: float = 1.0) -> float:
    """Bytes a rank holds at rest per byte of a trainable parameter of its stages when ZeRO
    1-3 run one FSDP unit per layer (``Plan.zero_layer_units``): its shards of the weights,
    gradients and optimizer state, ``(1 + g + k) / dp``; what the layers gathered during the
    step add is :func:`layer_unit_factors`'s.
    """
    return (1.0 + gradient_factor + optimizer_factor) / dp


def layer_unit_factors(zero_stage: int, gradient_factor: float = 1.0,
                       ) -> tuple[float, float, float, float]:
    """What a stage holds gathered at its peak beyond its shards when ZeRO 1-3 shard each
    layer as its own FSDP unit (``autopart/runtime/distributed/_sharding.py``), as
    ``(a, b, c, d)``: ``a`` bytes per byte of the stage's trainable parameters, ``b`` per byte
    of those outside every layer (``R``: the root unit, embeddings, final norm, head), ``c``
    per byte of its largest layer (``L``), ``d`` per byte of the larger of the two
    (``max(R, L)``).

    As the runtime runs it (torch 2.13's FSDP2), with ``g`` gradient bytes per parameter byte:

    - the root unit stays gathered from its pre-forward to its post-forward and from its
      pre-backward to its post-backward at the stage's end, beside its unsharded gradients
      (``(1 + g) R``);
    - ZeRO-3 (``reshard_after_forward``): one layer runs gathered with its unsharded
      gradients while the next layer's all-gather is prefetched (``(2 + g) L``); ZeRO-2 keeps
      every layer gathered from its forward to its backward (``1 x`` the stage, root
      included) and one layer's unsharded gradients (``g L``) beside the root's (``g R``);
      ZeRO-1 keeps every layer gathered and its gradients unsharded from the step's first
      forward to its last backward (``(1 + g) x`` the stage);
    - FSDP2 keeps the last all-gather's output and the last reduce-scatter's input until the
      next one of its kind (``all_gather_state``, ``reduce_scatter_states`` in
      ``_fsdp_param_group.py``): one unit's each, at most the larger unit's
      (``(1 + g) max(R, L)``).

    So ZeRO-3: ``(0, 1 + g, 2 + g, 1 + g)``; ZeRO-2: ``(1, g, g, 1 + g)``; ZeRO-1:
    ``(1 + g, 0, 0, 1 + g)`` (against :func:`held_state_multiplier`'s whole-stage buffers,
    ``max(1, g)`` x the stage, one unit's). Against one unit
    per stage (:func:`held_state_multiplier`: ``2 (1 + g)`` per byte of the stage) ZeRO-3
    holds less as soon as a stage has two layers; float32 AdamW (``g = 1``):
    ``2 R + 3 L + 2 max(R, L)`` against ``4 (R + n L)``.

    Raises:
        PlanError: a ZeRO stage other than 1, 2 or 3.
    """
    if zero_stage not in (1, 2, 3):
        raise PlanError(f"zero_stage={zero_stage}: layer units are for ZeRO 1-3")
    g = gradient_factor
    if zero_stage == 3:
        return 0.0, 1.0 + g, 2.0 + g, 1.0 + g
    if zero_stage == 2:
        return 1.0, g, g, 1.0 + g
    return 1.0 + g, 0.0, 0.0, 1.0 + g


@dataclass(frozen=True, slots=True)
class DataParallelCost:
    """What data parallelism adds to one rank's training step.

    Attributes:
        per_step_us: gradient all-reduce (ZeRO-0), or ZeRO-1's parameter all-gather and
            gradient reduce-scatter, once per step, µs.
        per_microbatch_us: ZeRO 2-3's parameter all-gathers and gradient reduce-scatter,
            paid for every microbatch, µs.
        forward_us: the part of ``per_microbatch_us`` a stage's forward runs (its
            parameters' all-gather); the rest runs in its backward (ZeRO-3's second
            all-gather and the reduce-scatter). Default 0.0.
    """

    per_step_us: float
    per_microbatch_us: float
    forward_us: float = 0.0

    def step_us(self, num_microbatches: int) -> float:
        """Total on one rank for ``num_microbatches`` microbatches, µs (none of it overlapped
        with compute: Megatron-LM's SC'21 runtime reduces gradients after the pipeline flush)."""
        return self.per_step_us + num_microbatches * self.per_microbatch_us


def data_parallel_cost(param_bytes: int, *, dp: int, zero_stage: int,
                       bandwidth_bytes_per_s: float, latency_us: float,
                       gradient_factor: float = 1.0,
                       overhead_us: float = 0.0,
                       copy_bytes_per_s: float = 0.0, units: int = 1,
                       reduce_scatter_as_all_reduce: bool = False) -> DataParallelCost:
    """The collectives one rank pays over its dp group, as autopart's runtime runs them
    (``autopart/runtime/distributed/_sharding.py``: FSDP2, one unit per stage).

    - stage 0: ring all-reduce of the gradients (``g x param_bytes``) once per step.
    - stage 1: one all-gather of the parameters (before the stage's first action) and one
      reduce-scatter of the accumulated gradients (after its last backward) per step: the
      volume of an all-reduce (ZeRO, SC'20, section 7).
    - stage 2: per microbatch, an all-gather of the parameters (in the forward) and a
      reduce-scatter of the gradients (in the backward): the runtime reduce-scatters and
      reshards after every backward, so the next forward gathers its parameters again.
    - stage 3: per microbatch, an all-gather of the parameters in forward and again in
      backward, and a reduce-scatter of the gradients (ZeRO's 1.5x of an all-reduce, paid
      per microbatch because a pipeline runs m forward/backward passes per step).

    ZeRO 2-3's ``forward_us`` is the forward's all-gather.

    Args:
        param_bytes: trainable parameter bytes this rank holds before ZeRO (after tp).
        dp: replicas.
        zero_stage: 0-3.
        bandwidth_bytes_per_s: the dp group's link (bus bandwidth), bytes/s.
        latency_us: one ring step, µs.
        gradient_factor: gradient bytes per parameter byte (1.0: same dtype).
        overhead_us: what each collective costs beyond its ring steps, µs (default 0.0;
            ``RuntimeDescription.collective_overhead_at``): charged once per all-reduce,
            all-gather and reduce-scatter above.
        copy_bytes_per_s: stage 0 packs the gradients into its bucket, divides and copies
            them back: three copies of them at this rate, bytes/s (default 0.0: not charged;
            ``RuntimeDescription.copy_bytes_per_s``). Stages 1-3 (FSDP2): an all-gather copies
            the shard in and the gathered parameters out (``(1 + 1 / dp) x`` the bytes), a
            reduce-scatter copies the gradients in and its shard out (the same).
        units: FSDP units the collectives run per (``Plan.zero_layer_units``: the layers
            and the root of the rank's stages; default 1): stages 1-3 pay the fixed cost and
            the ring's latency once per unit for each all-gather and reduce-scatter above.
        reduce_scatter_as_all_reduce: a reduce-scatter costs the ring all-reduce of its
            buffer (``RuntimeDescription.reduce_scatter_as_all_reduce``: gloo; default
            False).

    Raises:
        PlanError: a ZeRO stage outside 0-3, or bad link figures.
    """
    check_zero_stage(zero_stage)
    if not overhead_us >= 0.0:
        raise PlanError(f"overhead_us={overhead_us} must be >= 0 (µs per collective)")
    grads = param_bytes * gradient_factor
    if dp == 1 or param_bytes == 0:
        return DataParallelCost(0.0, 0.0)
    if zero_stage == 0:
        return DataParallelCost(gradient_all_reduce_us(grads, dp, bandwidth_bytes_per_s,
                                                       latency_us, overhead_us,
                                                       copy_bytes_per_s), 0.0)
    if units < 1:
        raise PlanError(f"units={units} must be >= 1 (FSDP units per rank)")
    # each further unit: its ring steps and the fixed cost again
    extra = (units - 1) * ((dp - 1) * latency_us + overhead_us)
    link = (dp, bandwidth_bytes_per_s, latency_us, overhead_us, copy_bytes_per_s)
    gather = fsdp_collective_us(param_bytes, *link) + extra
    scatter = fsdp_collective_us(grads, *link) + extra
    if reduce_scatter_as_all_reduce:  # the ring's second half again
        scatter += all_gather_us(grads, dp, bandwidth_bytes_per_s, latency_us)
    if zero_stage == 1:
        return DataParallelCost(scatter + gather, 0.0)
    gathers = 1 if zero_stage == 2 else 2
    return DataParallelCost(0.0, gathers * gather + scatter, gather)


def fsdp_collective_us(nbytes: float, dp: int, bandwidth_bytes_per_s: float,
                       latency_us: float, overhead_us: float = 0.0,
                       copy_bytes_per_s: float = 0.0) -> float:
    """One FSDP2 all-gather of ``nbytes`` of parameters, or reduce-scatter of ``nbytes`` of
    gradients, over ``dp`` ranks, µs: the ring (:func:`autopart.solver.collectives.
    all_gather_us`, the same as the reduce-scatter's), the runtime's fixed cost per collective
    and FSDP2's copies at ``copy_bytes_per_s`` (the shard in and the whole out, or the whole
    in and the shard out: ``(1 + 1 / dp) x nbytes``; 0.0: not charged).

    Raises:
        PlanError: bad link figures.
    """
    copies = (1.0 + 1.0 / dp) * nbytes / copy_bytes_per_s * 1e6 if copy_bytes_per_s > 0 else 0.0
    return all_gather_us(nbytes, dp, bandwidth_bytes_per_s, latency_us) + overhead_us + copies


def gradient_all_reduce_us(grad_bytes: float, dp: int, bandwidth_bytes_per_s: float,
                           latency_us: float, overhead_us: float = 0.0,
                           copy_bytes_per_s: float = 0.0) -> float:
    """ZeRO-0's all-reduce of one flat bucket of ``grad_bytes`` gradient bytes over ``dp``
    ranks, µs: the ring (:func:`autopart.solver.collectives.all_reduce_us`), the runtime's
    fixed cost per collective (``overhead_us``) and the bucket's three copies at
    ``copy_bytes_per_s`` (pack, divide, copy back; 0.0: not charged). The whole of a rank's
    gradients after the flush (:func:`data_parallel_cost`) or one bucket of the overlapped
    reduction (:func:`overlapped_reduction_us`).

    Raises:
        PlanError: bad link figures (:func:`autopart.solver.collectives.all_reduce_us`).
    """
    pack = 3 * grad_bytes / copy_bytes_per_s * 1e6 if copy_bytes_per_s > 0 else 0.0
    return all_reduce_us(grad_bytes, dp, bandwidth_bytes_per_s, latency_us) + overhead_us + pack


def bucket_sizes(elements: int, bucket_elements: int) -> list[int]:
    """A stage's gradient elements as the runtime packs them: ``ceil(elements /
    bucket_elements)`` buckets, all full but the last, elements (``[]`` for none)."""
    if elements <= 0:
        return []
    full, rest = divmod(elements, bucket_elements)
    return [bucket_elements] * full + ([rest] if rest else [])


def overlapped_reduction_us(stage_grad_bytes: Sequence[int], stage_elements: Sequence[int],
                            stage_rank: Sequence[int], bwd_us: Sequence[float],
                            bucket_us: Callable[[float], float], *, split_backward: bool,
                            bucket_elements: int) -> tuple[float, ...]:
    """What ZeRO-0's overlapped gradient all-reduce adds to a pipeline step on each rank, µs:
    the part that ends after the last action of the schedule.

    As the runtime runs it (``autopart/runtime/distributed/_grad_buckets.py``, Megatron-LM's
    ``--overlap-grad-reduce``, DDP's buckets): each stage's gradients are packed into buckets
    of ``bucket_elements`` (:func:`autopart.core.layout.grad_bucket_elements`), a bucket is
    all-reduced as soon as its gradients are final during the stage's last backward of the
    step, and one rank's buckets go over its dp link one after another, in the order they are
    ready. Modelled:

    - the step's tail is the last microbatch's backward running through the stages from the
      last to the first (what 1F1B, interleaved 1F1B, GPipe and the V schedules end with):
      stage 0's last backward ends when the schedule does (time 0 here), and stage s's last
      backward ends where stage s - 1's begins, ``-(bwd_0 + ... + bwd_{s-1})``. Sends are not
      counted in that spacing (the real tail is longer: the overlap is under-, never
      over-stated);
    - during a full backward, a stage's gradients become final at an even rate, the last
      layer's first: bucket k (cumulative elements ``c_k`` of the stage's ``E``) is ready at
      ``start + bwd * c_k / E``;
    - with a split backward (ZB-H1, ZB-V, DualPipe-V) torch adds the weight gradients up
      outside autograd's hooks, so the buckets launch after the stage's last ``W``, which
      these schedules run at their very end: every bucket is ready at time 0 (nothing
      overlapped);
    - a rank's buckets run one at a time: each starts when it is ready and the previous one
      is done, and takes ``bucket_us(bytes)``.

    The compute a collective shares the device with is not slowed (NCCL's reductions run on
    their own SMs); a runtime whose collectives run on the ranks' own compute (CPU ranks)
    hides nothing, which the caller prices as the serialized reduction instead
    (``RuntimeDescription.collectives_share_compute``).

    Args:
        stage_grad_bytes: per stage, the gradient bytes its rank all-reduces over dp.
        stage_elements: per stage, those gradients' elements.
        stage_rank: per stage, its pipeline rank.
        bwd_us: per stage, one microbatch's backward (``I + W``), µs.
        bucket_us: one bucket's reduction over dp by its bytes, µs: ZeRO-0's all-reduce,
            its packing included, or a layer unit's reduce-scatter for ZeRO-1 with layer
            units (``solver.layout_dp``).
        split_backward: the schedule splits backwards into ``I`` and ``W``.
        bucket_elements: a bucket's largest size, elements (>= 1).

    Returns:
        Per pipeline rank (``0 .. max(stage_rank)``), ``max(0, when its last bucket is
        done)``, µs; the step grows by the largest.

    Raises:
        PlanError: the per-stage sequences differ in length, or ``bucket_elements`` < 1.
    """
    n = len(stage_grad_bytes)
    if len(stage_elements) != n or len(stage_rank) != n or len(bwd_us) != n:
        raise PlanError(f"overlapped_reduction_us: {n} stages of gradient bytes, "
                        f"{len(stage_elements)} of elements, {len(stage_rank)} ranks and "
                        f"{len(bwd_us)} backward times; give one per stage")
    if bucket_elements < 1:
        raise PlanError(f"bucket_elements={bucket_elements} must be >= 1")
    ready: dict[int, list[tuple[float, float]]] = {}
    end = 0.0
    for s in range(n):
        start = end - bwd_us[s]
        total = stage_elements[s]
        per_element = stage_grad_bytes[s] / total if total > 0 else 0.0
        done = 0
        for b in bucket_sizes(total, bucket_elements):
            done += b
            at = 0.0 if split_backward else start + bwd_us[s] * done / total
            ready.setdefault(stage_rank[s], []).append((at, b * per_element))
        end = start
    tails = [0.0] * (max(stage_rank, default=-1) + 1)
    for rank, buckets in ready.items():
        t = -math.inf
        for at, nbytes in sorted(buckets, key=lambda x: x[0]):
            t = max(t, at) + bucket_us(nbytes)
        tails[rank] = max(0.0, t)
    return tuple(tails)


@dataclass(frozen=True, slots=True)
class UnitSegment:
    """A run of consecutive ops of one stage that belong to one FSDP unit, for one
    microbatch: ``unit`` indexes the stage's units, ``fwd_us`` / ``bwd_us`` its forward and
    backward (``I + W``, any recompute included) time, µs."""

    unit: int
    fwd_us: float
    bwd_us: float


def layer_units_exposed_us(segments: Sequence[UnitSegment], gather_us: Sequence[float],
                           scatter_us: Sequence[float], *, zero_stage: int,
                           root: int | None) -> tuple[float, float]:
    """What ZeRO 2-3's per-layer FSDP units leave exposed in one microbatch's forward and
    backward of one stage, µs, on a runtime whose collectives run beside its compute
    (NCCL on GPUs): ``(forward, backward)``, the time the stage's compute waits for
    all-gathers plus, at the backward's end, for its last reduce-scatters.

    As autopart's runtime runs it (``autopart/runtime/distributed/_sharding.py``,
    torch 2.13's FSDP2 with one unit per layer and the stage's graph module as the root, as
    torchtitan shards a model per transformer block):

    - forward: the root's all-gather first (its pre-forward waits for it), then each unit's
      pre-forward launches the next unit's all-gather (``set_modules_to_forward_prefetch``:
      the root prefetches the first layer, each layer the one after it). FSDP2 starts an
      all-gather only once the previous one is consumed, so unit k + 1's gather starts no
      earlier than unit k's compute; unit k's first op waits for its own gather;
    - backward (ZeRO-3; the root and every layer were resharded after the forward): the
      root's all-gather first, then each unit's pre-backward launches the previous layer's
      (the root's: the last layer's, FSDP2's implicit prefetch); each unit's post-backward
      (after its last op's backward) launches its gradients' reduce-scatter; the root's,
      after the stage's last op; the backward returns when the last reduce-scatter is done
      (the root's post-backward callback waits for them);
    - ZeRO-2 (``reshard_after_forward=False``): the forward's gathers as above (the previous
      microbatch's backward resharded every unit), no gathers in the backward; the
      reduce-scatters as above;
    - the all-gathers and reduce-scatters share the rank's link: modelled as one queue, each
      collective starting when it is launched and the previous one is done (FSDP2 runs them
      on two streams; over one network link their transfers take turns, so the queue is
      the bandwidth-bound case).

    The compute of a unit is its segments' times in order; the root's segments (embeddings
    before the layers, final norm and head after) need the root gathered from the stage's
    pre-forward to its post-forward and likewise in the backward.

    Args:
        segments: the stage's ops in forward order, grouped in runs by unit.
        gather_us: per unit, its parameters' all-gather, µs
            (:func:`fsdp_collective_us`).
        scatter_us: per unit, its gradients' reduce-scatter, µs.
        zero_stage: 2 or 3.
        root: the root unit's index (None: the stage has no parameters outside its layers).

    Returns:
        ``(forward, backward)`` exposed µs, each >= 0.

    Raises:
        PlanError: ``zero_stage`` other than 2 or 3, or a segment's unit with no figures.
    """
    if zero_stage not in (2, 3):
        raise PlanError(f"zero_stage={zero_stage}: per-microbatch layer-unit collectives are "
                        "ZeRO 2-3's (ZeRO-1 gathers once per step)")
    n = len(gather_us)
    if len(scatter_us) != n or any(not 0 <= s.unit < n for s in segments) or (
            root is not None and not 0 <= root < n):
        raise PlanError(f"layer_units_exposed_us: {n} units' gathers, {len(scatter_us)} "
                        "scatters; every segment's unit (and the root) must index them")
    fwd = _units_pass([(s.unit, s.fwd_us) for s in segments], gather_us, None, root)
    bwd = _units_pass([(s.unit, s.bwd_us) for s in reversed(segments)],
                      gather_us if zero_stage == 3 else None, scatter_us, root)
    return fwd, bwd


def _units_pass(runs: Sequence[tuple[int, float]], gather_us: Sequence[float] | None,
                scatter_us: Sequence[float] | None, root: int | None) -> float:
    """One pass of :func:`layer_units_exposed_us` over ``runs`` (``(unit, compute µs)`` in
    the order they run), gathering by ``gather_us`` (None: nothing gathered) and
    reduce-scattering by ``scatter_us`` (None: nothing); the exposed µs."""
    layers = list(dict.fromkeys(u for u, _ in runs if u != root))
    chain = ([root] if root is not None else []) + layers
    following = dict(zip(chain, chain[1:], strict=False))
    last_run = {u: i for i, (u, _) in enumerate(runs)}
    queue = 0.0  # when the link's queue is free
    ready: dict[int, float] = {}

    def launch(cost: float, at: float) -> float:
        nonlocal queue
        queue = max(queue, at) + cost
        return queue

    t = busy = 0.0
    started: set[int] = set()

    def begin(unit: int) -> None:
        nonlocal t
        started.add(unit)
        if gather_us is not None:
            if unit not in ready:
                ready[unit] = launch(gather_us[unit], t)
            t = max(t, ready[unit])
            nxt = following.get(unit)
            if nxt is not None and nxt not in ready:
                ready[nxt] = launch(gather_us[nxt], t)

    if root is not None:
        begin(root)  # the stage module's pre-forward / pre-backward
    for i, (unit, compute) in enumerate(runs):
        if unit not in started:
            begin(unit)
        t += compute
        busy += compute
        if scatter_us is not None and last_run[unit] == i and unit != root:
            launch(scatter_us[unit], t)  # the unit's post-backward
    if scatter_us is not None:
        if root is not None:
            launch(scatter_us[root], t)
        t = max(t, queue)
    return max(0.0, t - busy)
