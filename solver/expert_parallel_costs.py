"""One GPU's share of a MoE model's costs at expert parallelism ep, as
``autopart/codegen/expert_parallel.py`` runs it.

:func:`expert_costs` finds each experts module in the cost graph as the codegen pass does
(the nodes under the module path of its two grouped GEMMs) and prices ep on one GPU:

- memory: the expert weights the module reads (``param_bytes``, ``param_sizes``,
  ``param_numel``) divided by ep (each GPU holds ``E / ep`` experts); their gradients and
  optimizer state follow the parameter bytes;
- compute: under balanced routing each GPU runs ``T * k / ep`` token-expert pairs of each
  of the ep GPUs' microbatches, ``T * k`` in all, the count it ran at ep = 1. Where the
  profile counted the tokens routed to each expert on its batch (``CostGraph.
  expert_tokens``, measured profiles), the layer's grouped GEMMs and the activation between
  them take :func:`routing_imbalance` times as long: every ep GPU waits for the most loaded
  one at the combine, so the layer runs at its pace (each ep GPU's microbatches assumed
  routed like the profiled batch; the imbalance at another microbatch size is the
  profiled one). Analytical profiles have no routing and are priced balanced, as
  Megatron-Bridge's published MoE runs force it;
- communication: per MoE layer and microbatch, the dispatch and combine all-to-alls of the
  ``T * k`` rows of ``H`` values each GPU sends (:func:`autopart.solver.collectives.
  all_to_all_us` on the ep group's link; the most loaded GPU receives the imbalance times
  as many), in line with the forward as the runtime runs them, and the same two in the
  backward; the exchange of per-expert counts before the dispatch is one latency. The
  runtime's fixed cost per collective (``collective_overhead``: on CPU ranks, mostly the
  wait for an ep partner still computing) is paid once per layer, by the counts' exchange,
  which blocks until both partners are in it: the dispatch follows it after a few µs of
  host work, the combine follows the experts' compute (whose imbalance is priced above),
  and the backward's two reuse the forward's splits with the partners in step. Measured on
  4 gloo ranks (2 cores, ``benchmarks/expert_parallel``'s Mixtral-like model, pp 2 x dp 2,
  2026-12-03 17:05 UTC, one traced step, core time per microbatch): a stage's backward ran
  0.55-0.7 ms longer at ep 2 than at ep 1 for its 4 all-to-alls, where the fixed cost on
  each priced 7.3 more; its forward 5.7-12.4 ms longer for its 6 collectives and the
  routing imbalance, priced 14.1 with the fixed cost on each (the last stage, 12.4, runs the
  most imbalanced layer). They are
  recorded apart too: under DualPipe-V, where the runtime runs a pair's two actions at once,
  each pair hides them under its other action's compute
  (:meth:`autopart.solver.stage_costs.StageCosts.pair_us`).
- activation memory: the received rows (as many as sent, balanced) are the same bytes the
  block saved at ep = 1: unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from autopart.core.costgraph import CostGraph, NodeCost
from autopart.core.op_names import GROUPED_MM_OPS
from autopart.solver.candidates import _per_graph
from autopart.solver.collectives import all_to_all_us

__all__ = ["expert_costs", "expert_module_paths", "expert_params", "routing_imbalance"]


def expert_module_paths(costs: CostGraph) -> list[str]:
    """The module paths of the experts modules in ``costs``: those running grouped GEMMs."""
    paths: list[str] = []
    for nd in costs.nodes:
        if nd.op in GROUPED_MM_OPS and nd.module_path not in paths:
            paths.append(nd.module_path)
    return paths


def expert_params(costs: CostGraph) -> frozenset[str]:
    """The FQNs the experts modules of ``costs`` read: their stacked expert weights (the
    pass refuses a module reading any other).

    Made once per graph (:func:`autopart.solver.candidates._per_graph`): the layout search
    asks once per layout and per priced plan about the same few sharded graphs (DeepSeek-V3's
    58 MoE layers took 264 of a 355 s profiled search to answer it afresh each time)."""
    return _per_graph("expert params", costs, _expert_params)  # type: ignore[no-any-return]


def _expert_params(costs: CostGraph) -> frozenset[str]:
    members = _members(costs.nodes, expert_module_paths(costs))
    return frozenset(p for idx in members.values() for i in idx for p in costs.nodes[i].params)


def _members(nodes: tuple[NodeCost, ...] | list[NodeCost], paths: list[str]
             ) -> dict[str, list[int]]:
    """For each module path in ``paths``, the indices of the nodes at it or inside it, in
    order: each node's own path and its parents looked up, not every path tried."""
    wanted = set(paths)
    out: dict[str, list[int]] = {path: [] for path in paths}
    for i, nd in enumerate(nodes):
        prefix = nd.module_path
        while True:
            if prefix in wanted:
                out[prefix].append(i)
            cut = prefix.rfind(".")
            if cut < 0:
                break
            prefix = prefix[:cut]
    return out


def routing_imbalance(tokens: tuple[int, ...] | None, ep: int) -> float:
    """The most loaded ep GPU's token-expert pairs over the mean, >= 1: expert ``e`` on GPU
    ``e // (E / ep)`` (``autopart/codegen/expert_parallel.py``'s contiguous placement),
    ``tokens[e]`` routed to it. 1.0 without counts, at ep = 1, or where ep does not divide
    the experts.

    >>> routing_imbalance((6, 2, 1, 3), 2)
    1.3333333333333333
    """
    if not tokens or ep <= 1 or len(tokens) % ep or sum(tokens) <= 0:
        return 1.0
    per = len(tokens) // ep
    loads = [sum(tokens[r * per:(r + 1) * per]) for r in range(ep)]
    return max(loads) * ep / sum(loads)


def expert_costs(costs: CostGraph, ep: int, *, bandwidth_bytes_per_s: float, latency_us: float,
                 collective_overhead: Callable[[float], float] | None = None) -> CostGraph:
    """One GPU's share of ``costs`` with each MoE layer's experts split over ``ep`` GPUs
    (see the module docstring). ``costs`` itself at ep = 1 or without experts.

    Args:
        costs: the model's (or one tp GPU's) cost graph; with a second profiled batch
            (``low_times``) its times get the same changes at that batch's rows.
        ep: the expert-parallel degree.
        bandwidth_bytes_per_s, latency_us: the ep group's link (bus bandwidth one way, one
            step's latency).
        collective_overhead: what one collective costs beyond its transfer after that much
            work, µs (``RuntimeDescription.collective_overhead_at``), or None.

    Returns:
        The cost graph one ep GPU runs, its all-to-alls also recorded apart
        (``CostGraph.expert_exchanges``) for DualPipe-V's pairs, which hide them where the
        layout's runtime overlaps them (a layout whose runtime does not drops the record:
        :func:`autopart.core.plan_rules.overlaps_expert_exchanges`).
    """
    paths = expert_module_paths(costs)
    if ep == 1 or not paths:
        return costs
    routed = dict(costs.expert_tokens)
    overhead = collective_overhead(0.0) if collective_overhead is not None else 0.0

    def exchange(rows_bytes: float) -> tuple[float, float]:
        """A layer's forward and backward all-to-alls of ``rows_bytes`` into the most loaded
        GPU, and the counts' exchange before the forward's, µs; the fixed cost per
        collective once, on the counts' exchange (see the module docstring)."""
        move = all_to_all_us(int(rows_bytes), ep, bandwidth_bytes_per_s, latency_us)
        return 2 * move + latency_us * (ep - 1) + overhead, 2 * move

    nodes = list(costs.nodes)
    # a second profiled batch (the batch line): its times get the same changes at its size
    low = list(costs.low_times)
    low_share = costs.low_batch_size / costs.batch_size if low and costs.batch_size else 0.0
    sizes, numel = dict(costs.param_sizes), dict(costs.param_numel)
    by_name = {nd.name: nd for nd in costs.nodes}
    exchanges: list[tuple[int, float, float, float, float]] = []
    inside = _members(nodes, paths)
    for path in paths:
        members = inside[path]
        first = next(i for i in members if nodes[i].op in GROUPED_MM_OPS)
        second = max(i for i in members if nodes[i].op in GROUPED_MM_OPS)
        mm = nodes[first]
        imbalance = routing_imbalance(routed.get(path), ep)
        # the rows the first grouped GEMM reads: T * k token-expert pairs of H values
        src = by_name.get(mm.inputs[0]) if mm.inputs else None
        rows_bytes = src.output_bytes if src is not None else 0
        fwd, bwd = exchange(rows_bytes * imbalance)
        for i in members:
            nd = nodes[i]
            if imbalance > 1.0 and first <= i <= second:  # the rows this GPU computes
                nd = replace(nd, fwd_us=nd.fwd_us * imbalance,
                             bwd_input_us=nd.bwd_input_us * imbalance,
                             bwd_weight_us=nd.bwd_weight_us * imbalance)
                nodes[i] = nd
                if low:
                    low[i] = tuple(t * imbalance for t in low[i])  # type: ignore[assignment]
            if nd.param_bytes:
                nodes[i] = replace(nd, param_bytes=nd.param_bytes // ep)
            for fqn in nd.params:  # the stacked expert weights (the pass refuses any other)
                sizes[fqn], numel[fqn] = costs.param_sizes[fqn] // ep, costs.param_numel[fqn] // ep
        last = members[-1]
        nodes[last] = replace(nodes[last], fwd_us=nodes[last].fwd_us + fwd,
                              bwd_input_us=nodes[last].bwd_input_us + bwd)
        low_fwd = low_bwd = 0.0
        if low:
            low_fwd, low_bwd = exchange(rows_bytes * imbalance * low_share)
            f, b_in, b_w = low[last]
            low[last] = (f + low_fwd, b_in + low_bwd, b_w)
        exchanges.append((last, fwd, bwd, low_fwd, low_bwd))
    return replace(costs, nodes=tuple(nodes), param_sizes=sizes, param_numel=numel,
                   low_times=tuple(low),
                   expert_exchanges=tuple(exchanges))

