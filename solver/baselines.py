"""Baseline partitioners of other pipeline libraries, re-implemented on a CostGraph (no torch).

Each baseline turns a :class:`~autopart.core.costgraph.CostGraph` into cut positions (node indices
where a new stage starts) the way its library would, so that ``solve()`` can price them with the
same cost model as autopart's own plan. The four, and their sources:

* ``uniform_layers`` — torchtitan's default split points: the same number of repeated blocks
  (transformer layers) per stage (``generate_split_points`` in
  ``torchtitan/parallelisms/pipelining_utils.py``).
* ``deepspeed_parameters`` — DeepSpeed ``PipelineModule(partition_method="parameters")``: per-layer
  trainable parameter counts (``PipelineModule._count_layer_params``) split by
  ``deepspeed.runtime.utils.partition_balanced`` (a dynamic program over the linear-partition
  problem that minimises the spread max - min of the parts).
* ``pippy_equal_size`` — PiPPy / torch.distributed.pipelining ``split_into_equal_size``: a greedy
  walk over the graph's nodes that opens a new stage when the parameter and buffer elements
  of the current one would pass ``total // num_stages``
  (``_split_on_size_threshold_with_max_stages`` in ``pippy/ModelSplit.py``).
* ``torchgpipe_balance_by_time`` — torchgpipe ``balance_by_time``: per-layer forward + backward
  times split by ``torchgpipe/balance/blockpartition.solve``, the block-partition algorithm of
  Bárány and Grinberg, "Block partitions of sequences" (arXiv:1308.2452).

**Layers.** DeepSpeed and torchgpipe partition a list of layers, torchtitan counts transformer
blocks: :func:`autopart.solver.model_layers.model_layers` finds them.

**Valid cuts.** A layer that cannot start a stage (its first position is not a valid cut, see
:func:`autopart.solver.candidates.crossing_profile`) is merged into the layer before it for the
layer-level algorithms; node-level positions (torchtitan's block starts, PiPPy's greedy splits)
move forward to the next valid position.

**Not applicable.** A baseline that cannot make ``num_stages`` non-empty stages (fewer layers
than stages, for example) is skipped — it raises :class:`BaselineNotApplicable`, and
:func:`run_baselines` records the reason — rather than falling back to a node-level split the
library itself would not make.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from autopart.core.costgraph import CostGraph
from autopart.core.errors import BaselineNotApplicable, PlanError
from autopart.solver.candidates import crossing_profile
from autopart.solver.model_layers import model_layers
from autopart.solver.partition_algorithms import block_partition, partition_balanced

__all__ = [
    "BASELINE_NAMES",
    "BaselineCuts",
    "BaselineNotApplicable",
    "baseline_partitions",
    "deepspeed_parameters",
    "pippy_equal_size",
    "run_baselines",
    "torchgpipe_balance_by_time",
    "uniform_layers",
]

BASELINE_NAMES = ("uniform_layers", "deepspeed_parameters", "pippy_equal_size",
                  "torchgpipe_balance_by_time")


@dataclass(frozen=True, slots=True)
class BaselineCuts:
    """One baseline's answer: cut positions, or why it was skipped.

    Attributes:
        name: one of :data:`BASELINE_NAMES`.
        cuts: ``num_stages - 1`` strictly ascending valid cut positions, or None when skipped.
        reason: why it was skipped (``""`` when ``cuts`` is given).
    """

    name: str
    cuts: tuple[int, ...] | None
    reason: str = ""


# ---- layers that can start a stage, cut positions that are valid ------------------------------
def _valid_layers(costs: CostGraph, valid: list[bool]) -> list[tuple[int, int]]:
    """Layers as ``(start, stop)``, each one that cannot start a stage merged into the one before."""
    merged: list[tuple[int, int]] = []
    for layer in model_layers(costs):
        if merged and not valid[layer.start]:
            merged[-1] = (merged[-1][0], layer.stop)
        else:
            merged.append((layer.start, layer.stop))
    return merged


def _snap(costs: CostGraph, valid: list[bool], positions: Sequence[int], what: str) -> tuple[int, ...]:
    """Move each position forward to the next valid cut; raise if the cuts collide or run out."""
    n = len(costs.nodes)
    out: list[int] = []
    for p in positions:
        q = next((k for k in range(max(p, 1), n) if valid[k]), None)
        if q is None or (out and q <= out[-1]):
            raise BaselineNotApplicable(
                f"{what}: the cut before node {p} has no free valid cut position at or after it "
                f"(chosen so far: {out}); the graph cannot be cut there")
        out.append(q)
    return tuple(out)


def _check(num_stages: int, count: int, what: str, unit: str) -> None:
    if num_stages > count:
        raise BaselineNotApplicable(f"{what}: {num_stages} stages need at least {num_stages} "
                                    f"{unit}, but the graph has {count}")


# ---- the four baselines ---------------------------------------------------------------------
def uniform_layers(costs: CostGraph, num_stages: int) -> tuple[int, ...]:
    """torchtitan-style split: equal numbers of repeated blocks per stage.

    Source: torchtitan ``generate_split_points`` (``torchtitan/parallelisms/pipelining_utils.py``):
    with ``L`` blocks and ``S`` stages, ``base = L // S`` and ``extra = L % S``; stage 0 gets
    ``base`` blocks, the following stages ``base + 1`` while ``extra`` lasts, then ``base``; the
    last takes the rest. Each split is "before block k". Nodes before the first block (embeddings)
    go with stage 0, nodes after the last (norm, head) with the last stage. Without blocks the
    top-level-module layers are counted instead.

    Args:
        costs: the cost graph.
        num_stages: S >= 1.

    Returns:
        ``S - 1`` cut positions, ascending.

    Raises:
        BaselineNotApplicable: fewer blocks than stages (torchtitan raises "Total stages cannot
            be greater than the number of layers"), or a cut has no valid position.
    """
    _, valid = crossing_profile(costs)
    starts: dict[str, int] = {}
    for layer in model_layers(costs):
        if layer.is_block:
            starts.setdefault(layer.name, layer.start)
    first = list(starts.values()) or [layer.start for layer in model_layers(costs)]
    _check(num_stages, len(first), "uniform_layers", "layers")
    base, extra = divmod(len(first), num_stages)
    splits: list[int] = []
    current = 0
    for i in range(num_stages - 1):
        step = base + 1 if i > 0 and extra > 0 else base
        extra -= 1 if i > 0 and extra > 0 else 0
        current += step
        splits.append(first[current])
    return _snap(costs, valid, splits, "uniform_layers")


def deepspeed_parameters(costs: CostGraph, num_stages: int) -> tuple[int, ...]:
    """DeepSpeed ``PipelineModule(partition_method="parameters")``.

    Source: ``PipelineModule._partition_layers`` / ``_count_layer_params`` (each layer's
    trainable parameter elements) and ``deepspeed.runtime.utils.partition_balanced``.

    Raises:
        BaselineNotApplicable: fewer layers than stages (DeepSpeed would leave stages empty).
    """
    _, valid = crossing_profile(costs)
    layers = _valid_layers(costs, valid)
    _check(num_stages, len(layers), "deepspeed_parameters", "layers that can start a stage")
    weights = []
    for start, stop in layers:
        names = {p for nd in costs.nodes[start:stop] for p in nd.params if p in costs.trainable}
        weights.append(sum(costs.param_numel[p] for p in names))
    parts = partition_balanced(weights, num_stages)
    return tuple(layers[parts[j]][0] for j in range(1, num_stages))


def pippy_equal_size(costs: CostGraph, num_stages: int) -> tuple[int, ...]:
    """PiPPy ``split_into_equal_size(num_stages)``: greedy over nodes by parameter elements.

    Source: ``pippy/ModelSplit.py`` (pytorch/PiPPy), ``split_into_equal_size`` ->
    ``_split_on_size_threshold_with_max_stages(gm, total // num_stages, num_stages)``. The
    threshold is the elements of every parameter and buffer divided by S (floor). Walking the
    nodes that read parameters, a node's *new* elements are those of parameters not yet in the
    current stage: it joins the stage if the total stays within the threshold; a node alone over
    the threshold in an empty stage ends a stage after itself; otherwise a new stage starts before
    it (carrying the parameters it shares with the old one). Only the first S - 1 splits are kept.

    Raises:
        BaselineNotApplicable: fewer than S - 1 splits (PiPPy asserts ``rv_nstages == nstages``),
            or a split has no valid cut position.
    """
    _, valid = crossing_profile(costs)
    n = len(costs.nodes)
    threshold = sum(costs.param_numel.values()) // num_stages
    splits: list[int] = []
    acc_size = 0
    acc_params: dict[str, None] = {}
    for i, nd in enumerate(costs.nodes):
        if not nd.params:
            continue
        new = {p: None for p in nd.params if p not in acc_params}
        repeated = {p: None for p in nd.params if p in acc_params}
        new_size = sum(costs.param_numel[p] for p in new)
        if acc_size + new_size <= threshold:
            acc_size += new_size
            acc_params.update(new)
        elif acc_size == 0 and new_size > threshold:
            splits.append(i + 1)
        else:
            splits.append(i)
            acc_size = sum(costs.param_numel[p] for p in repeated) + new_size
            acc_params = {**repeated, **new}
    splits = [p for p in splits if p < n][: num_stages - 1]
    if len(splits) < num_stages - 1:
        raise BaselineNotApplicable(
            f"pippy_equal_size: the greedy walk made {len(splits) + 1} stages, not {num_stages} "
            f"(threshold {threshold} parameter elements per stage)")
    return _snap(costs, valid, splits, "pippy_equal_size")


def torchgpipe_balance_by_time(costs: CostGraph, num_stages: int) -> tuple[int, ...]:
    """torchgpipe ``balance_by_time``: block partition of per-layer forward + backward times.

    Source: ``torchgpipe/balance/__init__.py`` (``balance_cost`` -> ``blockpartition.solve``);
    times are the CostGraph's ``fwd_us + bwd_us`` summed per layer, µs.

    Raises:
        BaselineNotApplicable: fewer layers than stages (torchgpipe raises "sequence is shorter
            than intended partitions"), or the block partition left a stage empty.
    """
    _, valid = crossing_profile(costs)
    layers = _valid_layers(costs, valid)
    _check(num_stages, len(layers), "torchgpipe_balance_by_time", "layers that can start a stage")
    times = [sum(nd.fwd_us + nd.bwd_us for nd in costs.nodes[a:b]) for a, b in layers]
    stops = block_partition(times, num_stages)
    bounds = [0, *stops]
    if any(b <= a for a, b in itertools.pairwise(bounds)):
        raise BaselineNotApplicable(f"torchgpipe_balance_by_time: the block partition left a "
                                    f"stage empty (layer boundaries {stops})")
    return tuple(layers[k][0] for k in stops[:-1])


# ---- entry points -------------------------------------------------------------------------
_BASELINES: dict[str, Callable[[CostGraph, int], tuple[int, ...]]] = {
    "uniform_layers": uniform_layers,
    "deepspeed_parameters": deepspeed_parameters,
    "pippy_equal_size": pippy_equal_size,
    "torchgpipe_balance_by_time": torchgpipe_balance_by_time,
}


def run_baselines(costs: CostGraph, num_stages: int) -> tuple[BaselineCuts, ...]:
    """Every baseline in :data:`BASELINE_NAMES` order, with its cuts or the reason it was skipped.

    Args:
        costs: the cost graph (at least one op node).
        num_stages: S >= 1; S = 1 gives every baseline empty cuts.

    Raises:
        PlanError: ``num_stages < 1`` or the graph has no op nodes.
    """
    if num_stages < 1:
        raise PlanError(f"num_stages={num_stages}; it must be >= 1")
    if not costs.nodes:
        raise PlanError("the cost graph has no op nodes; there is nothing to partition")
    out: list[BaselineCuts] = []
    for name, fn in _BASELINES.items():
        if num_stages == 1:
            out.append(BaselineCuts(name, ()))
            continue
        try:
            cuts = fn(costs, num_stages)
        except BaselineNotApplicable as exc:
            out.append(BaselineCuts(name, None, str(exc)))
            continue
        assert len(cuts) == num_stages - 1 and all(a < b for a, b in itertools.pairwise(cuts))
        out.append(BaselineCuts(name, cuts))
    return tuple(out)


def baseline_partitions(costs: CostGraph, num_stages: int) -> list[tuple[str, tuple[int, ...]]]:
    """``(name, cut positions)`` of each baseline that applies, in :data:`BASELINE_NAMES` order.

    Cut positions index ``costs.nodes``: a new stage starts at each; they are strictly
    ascending, ``num_stages - 1`` of them, each a valid cut. Baselines that cannot make
    ``num_stages`` non-empty stages are left out (:func:`run_baselines` says why).

    Raises:
        PlanError: ``num_stages < 1`` or the graph has no op nodes.
    """
    return [(b.name, b.cuts) for b in run_baselines(costs, num_stages) if b.cuts is not None]
