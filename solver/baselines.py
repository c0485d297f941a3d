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
blocks. Here a *block* is a module whose path ends in an index of a repeated container
(``transformer.h.3``, ``model.layers.7``, ``bert.encoder.layer.2``; ResNet bottlenecks
``resnet.encoder.stages.1.layers.2``, found by descending while every node of a block sits
in one indexed child). Containers are grouped by their path with digits replaced by ``*``; the
group with the most nodes, and any other holding at least a quarter of the nodes, supply the
blocks. The graph's layers are then its blocks plus each maximal run of nodes between them (the
embeddings before the first block, the final norm and head after the last); without blocks, the
runs of each top-level module are the layers. Per-layer quantities are sums over its nodes
(parameters: each distinct parameter once per layer, as ``layer.parameters()`` counts them).

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
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from autopart.core.costgraph import CostGraph
from autopart.core.errors import BaselineNotApplicable, PlanError
from autopart.solver.candidates import crossing_profile

__all__ = [
    "BASELINE_NAMES",
    "BaselineCuts",
    "BaselineNotApplicable",
    "Layer",
    "baseline_partitions",
    "block_partition",
    "deepspeed_parameters",
    "model_layers",
    "partition_balanced",
    "pippy_equal_size",
    "run_baselines",
    "torchgpipe_balance_by_time",
    "uniform_layers",
]

BASELINE_NAMES = ("uniform_layers", "deepspeed_parameters", "pippy_equal_size",
                  "torchgpipe_balance_by_time")
_MAJOR_SHARE = 0.25  # a second block pattern counts when it holds this share of the nodes


@dataclass(frozen=True, slots=True)
class Layer:
    """Op nodes ``start .. stop - 1`` forming one layer of the model.

    Attributes:
        name: the block's module path (``"transformer.h.3"``), or for other runs the module
            path of their first node (``"(top level)"`` when it is empty).
        start: index of its first op node.
        stop: one past the index of its last op node.
        is_block: True for a repeated block (a transformer layer, a ResNet bottleneck).
    """

    name: str
    start: int
    stop: int
    is_block: bool


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


# ---- layers ---------------------------------------------------------------------------------
def _first_index_key(path: str) -> str | None:
    """``"transformer.h.3.attn"`` -> ``"transformer.h.3"``; None without a numeric component."""
    parts = path.split(".") if path else []
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return None


def _indexed_child(path: str, key: str) -> str | None:
    """``key.c.<int>`` when ``path`` lies under it (``key.c.<int>[.rest]``), else None."""
    rest = path[len(key) + 1:].split(".") if path.startswith(key + ".") else []
    if len(rest) >= 2 and rest[1].isdigit():
        return f"{key}.{rest[0]}.{rest[1]}"
    return None


def _block_keys(costs: CostGraph) -> list[str | None]:
    """Per node, the repeated block it belongs to (None outside every block)."""
    paths = [nd.module_path for nd in costs.nodes]
    keys = [_first_index_key(p) for p in paths]
    changed = True
    while changed:  # descend while all of a block's nodes sit in one indexed child container
        changed = False
        members: dict[str, list[int]] = {}
        for i, k in enumerate(keys):
            if k is not None:
                members.setdefault(k, []).append(i)
        for k, idxs in members.items():
            subs = [_indexed_child(paths[i], k) for i in idxs]
            if None not in subs and len({s.rsplit(".", 1)[0] for s in subs if s}) == 1:
                for i, s in zip(idxs, subs, strict=True):
                    keys[i] = s
                changed = True
    nodes_per: dict[str, int] = {}
    blocks_per: dict[str, set[str]] = {}
    for k in keys:
        if k is not None:
            pattern = re.sub(r"\d+", "*", k.rsplit(".", 1)[0] if "." in k else "")
            nodes_per[pattern] = nodes_per.get(pattern, 0) + 1
            blocks_per.setdefault(pattern, set()).add(k)
    ranked = sorted(nodes_per, key=lambda p: -nodes_per[p])  # stable: first seen wins ties
    if not ranked or len(blocks_per[ranked[0]]) < 2:
        return [None] * len(keys)
    n = len(keys)
    kept = {p for p in ranked
            if len(blocks_per[p]) >= 2 and (p == ranked[0] or nodes_per[p] >= _MAJOR_SHARE * n)}
    return [k if k is not None and re.sub(r"\d+", "*", k.rsplit(".", 1)[0] if "." in k else "")
            in kept else None for k in keys]


def model_layers(costs: CostGraph) -> tuple[Layer, ...]:
    """The graph's layers in order, covering every op node (see the module docstring).

    Args:
        costs: the cost graph.

    Returns:
        Contiguous layers; a block whose nodes are not contiguous gives one layer per run.
    """
    keys = _block_keys(costs)
    blocks = any(k is not None for k in keys)
    layers: list[Layer] = []
    start = 0
    for i in range(1, len(keys) + 1):
        if i < len(keys) and _run_key(costs, keys, i, blocks) == _run_key(costs, keys, start, blocks):
            continue
        key = keys[start]
        name = key if key is not None else (costs.nodes[start].module_path or "(top level)")
        layers.append(Layer(name, start, i, key is not None))
        start = i
    return tuple(layers)


def _run_key(costs: CostGraph, keys: list[str | None], i: int, blocks: bool) -> str | None:
    if blocks:
        return keys[i]
    return costs.nodes[i].module_path.split(".")[0]  # no blocks: runs of top-level modules


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


# ---- the published algorithms ---------------------------------------------------------------
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
