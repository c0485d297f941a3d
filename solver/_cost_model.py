"""The solver's cost model: per-microbatch time and communication of segments and stages (µs)."""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from autopart.core.cluster import Cluster
from autopart.core.costgraph import CostGraph
from autopart.core.runtime_model import RuntimeDescription
from autopart.solver._graph_tables import TimeTables
from autopart.solver._memory_model import MemoryModel
from autopart.solver.candidates import CutCandidates, _per_graph

if TYPE_CHECKING:
    from autopart.solver.options import SolveOptions

#: CP-SAT time unit: chain costs are integers in tenths of a µs (round half to even).
TIME_UNITS_PER_US = 10


#: A runtime that costs nothing beyond the profiled ops (CostModel's default).
_FREE_RUNTIME = RuntimeDescription()


def to_time_units(us: float) -> int:
    """µs -> integer CP-SAT time units (0.1 µs)."""
    return int(round(us * TIME_UNITS_PER_US))


class CostModel(MemoryModel):
    """The cost model of DESIGN.md evaluated at microbatch size ``b = batch_size / m``: time
    here, memory in :class:`~autopart.solver._memory_model.MemoryModel`.

    Time of one node at batch ``b`` from its profiled time ``t0`` at ``b0``, with ``ov`` the
    device's ``op_overhead_us``: ``t(b) = min(t0, ov) + max(t0 - ov, 0) * b / b0``. For
    ``t0 >= ov`` this is ``DeviceSpec``'s ``ov + (t0 - ov) * b / b0``; ops cheaper than the
    overhead (views, getitem) stay at ``t0`` instead of being raised to ``ov``. The backward of a
    node (input + weight gradient) is scaled as one op.

    When the graph was also profiled at a smaller batch ``b1`` (``CostGraph.low_batch_size``),
    each part of each node (forward, input gradient, weight gradient) is the line through
    its two measured times instead: ``t(b) = t1 + s * (b - b1)`` with
    ``s = max((t0 - t1) / (b0 - b1), 0)``. This holds the costs that do not shrink with the
    batch (reading a layer's weights, dispatch), which a single profile at the full batch
    scales away. The solver's microbatches are never smaller than ``b1``
    (the smallest candidate), so the line is only used between its two points.

    At a microbatch the profiler also measured segment by segment (``CostGraph.batch_scales``),
    each node's time on the line is multiplied by its segment's measured-over-line factor
    there, per forward and backward: kernels choose their algorithm by shape.

    Where the profile carries the host's issue times (``CostGraph.has_host_times``, measured
    on CUDA), :meth:`host_part_us` sums them; they are not scaled with the batch (issuing a
    kernel costs the same whatever its shape) nor by a rank's speed. Without them (the CPU,
    where the host runs the ops) nothing here or in the solver reads a host figure.

    Args:
        costs: the cost graph, profiled at ``costs.batch_size``.
        cluster: devices; ``op_overhead_us`` is read from ``cluster.devices[0]``.
        batch_size: the full batch the plan is for.
        training: include backward time, gradient sends, saved activations and optimizer state.
        state_factor: optimizer state bytes per trainable parameter byte (AdamW: 2.0); a
            trainable parameter then holds ``(2 + state_factor) x`` its bytes (weight, gradient,
            state); buffers, and every parameter when not training, hold 1x.
        runtime: the runtime's costs and buffers (default: none beyond the ops): its split
            backward's cost per node (:meth:`split_us_per_node_at`), its cost per transfer
            and its receive buffers (:meth:`held_parts`).
    """

    def __init__(self, costs: CostGraph, cluster: Cluster, *, batch_size: int, training: bool,
                 state_factor: float,
                 runtime: RuntimeDescription = _FREE_RUNTIME,
                 layer_unit_factors: tuple[float, float, float, float] | None = None,
                 recompute_policy: str = "full",
                 whole_state: tuple[frozenset[str], float] = (frozenset(), 0.0),
                 kept_nodes: frozenset[str] = frozenset()) -> None:
        super().__init__(costs, batch_size=batch_size, training=training,
                         state_factor=state_factor, runtime=runtime,
                         layer_unit_factors=layer_unit_factors,
                         recompute_policy=recompute_policy, whole_state=whole_state,
                         kept_nodes=kept_nodes)
        self._init_args = (cluster, batch_size, training, state_factor, runtime,
                           layer_unit_factors, whole_state)
        self._split_points = tuple(sorted(runtime.split_backward_points))
        self.cluster = cluster
        self.overhead_us = cluster.devices[0].op_overhead_us
        # the prefix sums below read the graph, the device's fixed time per op, training, the
        # policy and what it keeps, and checkpointing's own cost per node: made once per graph
        # and those (a layout search builds a model per layout on the same few graphs)
        key = (self.overhead_us, training, recompute_policy, self.kept_nodes,
               runtime.selective_us_per_node[1])
        made = _per_graph("cost model tables", costs, lambda _: {})
        tables = made.get(key)
        if tables is None:
            tables = made[key] = TimeTables(costs, self.kept, self.overhead_us, training,
                                             recompute_policy, runtime.selective_us_per_node[1])
        self._bwd_nodes = tables.bwd_nodes
        self._kept_count = tables.kept_count
        self._fixed, self._linear = tables.fixed, tables.linear
        self._parts = tables.parts
        self._node_fwd, self._node_bwd = tables.node_fwd, tables.node_bwd
        self._regather = tables.regather
        self._exchange = tables.exchange
        self._host = tables.host
        self._shared = tables.shared
        self._scaled = tables.scaled

    def _measured_at(self, ratio: float) -> dict[str, list[float]] | None:
        """Prefix sums of the node times at ``ratio = b / b0`` where ``b`` was measured
        segment by segment (``CostGraph.batch_scales``), else None (the line)."""
        return self._scaled.get(round(ratio * self.costs.batch_size, 6)) if self._scaled else None

    def time_us(self, start: int, stop: int, ratio: float) -> float:
        """Compute time (fwd, + bwd when training) of nodes ``start .. stop - 1``, µs."""
        at = self._measured_at(ratio)
        if at is not None:
            return at["time"][stop] - at["time"][start]
        return (self._fixed[stop] - self._fixed[start]
                + (self._linear[stop] - self._linear[start]) * ratio)

    def link_us(self, nbytes: int) -> float:
        """Slowest neighbour link's time for ``nbytes`` (what the chain model charges), µs."""
        n = self.cluster.num_ranks
        if n < 2 or nbytes <= 0:
            return 0.0
        links = getattr(self, "_links", None)
        if links is None:
            # Distinct (bandwidth, latency) of the neighbour links, as Cluster.transfer_us
            # takes them: the max over these equals the max over every link.
            devs = self.cluster.devices
            links = sorted({(min(devs[r].link_bandwidth_bytes_per_s,
                                 devs[r + 1].link_bandwidth_bytes_per_s),
                             max(devs[r].link_latency_us, devs[r + 1].link_latency_us))
                            for r in range(n - 1)})
            self._links = links
        return max(nbytes / bw * 1e6 + lat for bw, lat in links)

    def recompute_fwd_extra_us(self, start: int, stop: int) -> float:
        """What a recomputing stage of nodes ``start .. stop - 1`` adds to its forward, µs:
        where it runs under selective checkpointing (:meth:`checkpoints_selectively`), its
        cost per node (``RuntimeDescription.selective_us_per_node``); else 0.0."""
        if not self.checkpoints_selectively(start, stop):
            return 0.0
        return (stop - start) * self.runtime.selective_us_per_node[0]

    def checkpoints_selectively(self, start: int, stop: int) -> bool:
        """Whether a recomputing stage of nodes ``start .. stop - 1`` runs under torch's
        selective checkpointing, as ``codegen.recompute.run_recomputed`` runs it: always
        under ``"selective"``; under ``"op"`` where the stage keeps an output (a node the
        choice kept, or one of tp's reductions); else (``"full"``, and an ``"op"`` stage
        keeping nothing) under plain checkpointing, without selective checkpointing's cost
        per node, so that ``"op"`` keeping nothing is ``"full"``."""
        if self.recompute_policy == "selective":
            return True
        return (self.recompute_policy == "op"
                and self._kept_count[stop] - self._kept_count[start] > 0)

    def recompute_stop(self, start: int, stop: int) -> int:
        """Where the recomputation of a stage of nodes ``start .. stop - 1`` ends (exclusive):
        torch's non-reentrant checkpoint stops (``early_stop``, its default) once it has
        packed as many saved tensors as the forward did, so nothing after the stage's last
        node that saves anything runs again, nor that node's kernel where what it saves is
        only its inputs (autograd packs those before the kernel runs; a node saving its own
        output or statistics, or one whose profile does not say, runs). ``start`` where no
        node saves anything.

        Measured on 2 gloo ranks (the demo's GPT-2, 12 layers, n_embd 768, vocabulary 50257,
        2 x 128 tokens per microbatch, 1F1B m 4): both stages recomputing were priced at
        10.273 s against 9.229 s measured while the last stage's recomputation counted the
        LM head's matmul (256 x 768 x 50257 per microbatch), which torch does not run again.
        """
        i = self.last_saving_node(start, stop)
        if i is None:
            return start
        nd = self.costs.nodes[i]
        runs = (nd.saved_from is None or self._own_saved(i) > 0
                or any(dist == 0 for dist, _ in nd.saved_from))
        return i + 1 if runs else i

    def part_us(self, part: str, start: int, stop: int, ratio: float) -> float:
        """Time of ``part`` (``"fwd"``, ``"bwd_input"``, ``"bwd_weight"``, or ``"recompute"``:
        the forward a recomputing stage runs again, its kept nodes' left out, with selective
        checkpointing's cost per node where it runs under it: :meth:`checkpoints_selectively`)
        of nodes ``start .. stop - 1`` at ``ratio = b / b0``, µs (each part scaled as its own
        op)."""
        if part == "recompute" and not self.checkpoints_selectively(start, stop):
            part = "fwd"  # plain checkpointing runs the whole forward again, nothing more
        at = self._measured_at(ratio)
        if at is not None:
            return at[part][stop] - at[part][start]
        fx, ln = self._parts[part]
        return fx[stop] - fx[start] + (ln[stop] - ln[start]) * ratio

    @property
    def has_exchanges(self) -> bool:
        """Whether the costs record expert parallelism's all-to-alls apart
        (``CostGraph.expert_exchanges``: a layout whose DualPipe-V pairs hide them)."""
        return bool(self._exchange)

    def exchange_us(self, part: str, start: int, stop: int, ratio: float) -> float:
        """Expert parallelism's all-to-alls inside the ``part`` (``"fwd"``, or ``"bwd"``:
        the input-gradient part) times of nodes ``start .. stop - 1`` at ``ratio = b / b0``
        (``CostGraph.expert_exchanges``), µs; 0.0 without them."""
        sums = self._exchange.get(part)
        if sums is None:
            return 0.0
        fixed, linear = sums
        return fixed[stop] - fixed[start] + (linear[stop] - linear[start]) * ratio

    def regather_us(self, i: int, ratio: float) -> float:
        """The part of node ``i``'s forward time at ``ratio = b / b0`` that is sequence
        parallelism's all-gathers of its token-split inputs
        (``CostGraph.recomputed_gathers``), µs: a stage recomputing under ``"selective"`` or
        ``"op"`` runs it again even where it keeps the node's output. 0 for most nodes."""
        fixed, linear = self._regather.get(i, (0.0, 0.0))
        return fixed + linear * ratio

    @property
    def has_host_times(self) -> bool:
        """Whether the profile carries the host's issue times (then :meth:`host_part_us`)."""
        return bool(self._host)

    def host_part_us(self, part: str, start: int, stop: int) -> float:
        """Host issue time of ``part`` (``"fwd"``, ``"bwd_input"``, ``"bwd_weight"``) of nodes
        ``start .. stop - 1``, µs, the same at every microbatch size (0.0 without host times)."""
        sums = self._host.get(part)
        return sums[stop] - sums[start] if sums else 0.0

    def host_time_us(self, start: int, stop: int) -> float:
        """Host issue time of nodes ``start .. stop - 1`` (forward, + backward when
        training), µs (0.0 without host times)."""
        return self.host_part_us("fwd", start, stop) + (
            self.host_part_us("bwd_input", start, stop)
            + self.host_part_us("bwd_weight", start, stop) if self.training else 0.0)

    @property
    def charges_split(self) -> bool:
        """Whether splitting a backward costs anything per node at some microbatch size."""
        return (self.runtime.split_backward_us_per_node > 0.0
                or any(us > 0.0 for _, us in self._split_points))

    def split_us_per_node_at(self, rows: float) -> float:
        """What splitting a backward adds per node with a backward at a microbatch of
        ``rows`` rows, µs: the runtime's ``split_backward_us_per_node`` without
        ``split_backward_points``; with one point its
        cost; else read off the piecewise line through the points (the end pieces extended
        beyond the first and last rows), at least 0: the split's extra work grows with the
        microbatch."""
        pts = self._split_points
        if not pts:
            return self.runtime.split_backward_us_per_node
        if len(pts) == 1:
            return pts[0][1]
        k = min(max(bisect.bisect_left([r for r, _ in pts], rows), 1), len(pts) - 1)
        (r0, u0), (r1, u1) = pts[k - 1], pts[k]
        return max(0.0, u0 + (u1 - u0) * (rows - r0) / (r1 - r0))

    def split_overhead_us(self, start: int, stop: int, ratio: float = 1.0) -> float:
        """What splitting the backward of nodes ``start .. stop - 1`` into I and W adds to
        one microbatch's ``I + W`` at ``ratio = b / b0``, µs: the cost per node at that
        microbatch's rows (:meth:`split_us_per_node_at`) times the nodes that have a
        backward. The split walks the autograd graph twice (hooks on I's intermediates,
        then W from them)."""
        per_node = self.split_us_per_node_at(ratio * self.costs.batch_size)
        return per_node * (self._bwd_nodes[stop] - self._bwd_nodes[start])

    def tied_sync_us(self, positions: Sequence[int], p: int,
                     rank_of: Sequence[int] | None = None) -> float:
        """End-of-step all-reduce of the gradients of trainable parameters that stages on
        more than one rank read (a tied embedding and LM head), µs; 0 when not training.

        Each such parameter of ``b`` bytes, held by ``k`` ranks, is summed with one
        all-reduce (the runtimes' ``reduce_grads``): a ring's ``2 (k - 1) / k * b`` bytes
        each way per rank, charged as a send and a receive one after the other over the
        slowest link between those ranks (:meth:`autopart.core.cluster.Cluster.transfer_us`),
        plus the runtime's fixed cost of a collective after no work
        (``RuntimeDescription.collective_overhead_at(0)``); on ranks that share cores the
        whole is ``ranks_per_core`` times longer (every rank reduces at once, as the layout
        search charges the dp collectives).

        Args:
            positions: the cut positions (``p * v - 1``, ascending).
            p: ranks.
            rank_of: stage -> rank; default: stage ``s`` on rank ``s % p``.
        """
        if not self.training or p < 2 or not self._shared:
            return 0.0
        total = 0.0
        for param, nodes in self._shared.items():
            stages = {bisect.bisect_right(positions, i) for i in nodes}
            ranks = sorted({rank_of[s] if rank_of else s % p for s in stages})
            k = len(ranks)
            if k < 2:
                continue
            nbytes = int(math.ceil(2 * (k - 1) / k * self.costs.param_sizes[param]))
            total += 2 * max(self.cluster.transfer_us(nbytes, a, b)
                             for a, b in itertools.pairwise(ranks))
            total += self.runtime.collective_overhead_at(0.0)
        return total * max(1.0, self.runtime.ranks_per_core)

    @classmethod
    def for_options(cls, costs: CostGraph, cluster: Cluster, options: SolveOptions,
                    batch_size: int | None = None,
                    kept_nodes: frozenset[str] = frozenset()) -> CostModel:
        """The model a :class:`autopart.solver.SolveOptions` describes (its batch unless
        ``batch_size`` is given; under ``recompute_policy="op"`` recomputing stages keep
        ``kept_nodes``, default none)."""
        return cls(costs, cluster, batch_size=options.batch_size if batch_size is None
                   else batch_size, training=options.training,
                   state_factor=(options.optimizer_state_bytes_per_param_byte
                                 if options.state_bytes_per_param_byte is None
                                 else options.state_bytes_per_param_byte - 2.0),
                   runtime=options.runtime, layer_unit_factors=options.layer_unit_factors,
                   recompute_policy=options.recompute_policy,
                   whole_state=(options.whole_state_params,
                                options.optimizer_state_bytes_per_param_byte),
                   kept_nodes=kept_nodes)

    def with_kept(self, kept_nodes: frozenset[str]) -> CostModel:
        """This model under ``recompute_policy="op"`` with recomputing stages keeping the
        outputs of ``kept_nodes`` (names): everything else as it is."""
        cluster, batch_size, training, state_factor, runtime, units, whole = self._init_args
        return CostModel(self.costs, cluster, batch_size=batch_size, training=training,
                         state_factor=state_factor, runtime=runtime,
                         layer_unit_factors=units, recompute_policy="op", whole_state=whole,
                         kept_nodes=kept_nodes)

    def speed(self, rank: int) -> float:
        """Time multiplier of ``rank``'s compute against the profiled device: peak FLOP/s of
        rank 0 over that of ``rank`` (1.0 on a uniform cluster), times the runtime's
        ``time_sharing_factor`` where rank processes share cores (``ranks_per_core`` > 1:
        each computes slower after the others ran on its core)."""
        shared = (self.runtime.time_sharing_factor if self.runtime.ranks_per_core > 1.0
                  else 1.0)
        return shared * self.cluster.devices[0].peak_flops / self.cluster.devices[rank].peak_flops

    # ---- chain data for the partition solvers --------------------------------------
    def chain_time(self, cands: CutCandidates, m: int) -> tuple[list[int], list[int], list[int]]:
        """Integer chain costs at ``m`` microbatches: (segment time, cut out-charge, cut in-charge).

        The out-charge is the forward activation send (sender's stage), the in-charge the gradient
        send (receiver's stage, training only); both in 0.1 µs units.
        """
        r = self.ratio(m)
        # with host issue times a segment costs the slower of its device and host sides (the
        # candidates are then costed action by action, :func:`autopart.solver._stage_costing`)
        seg = [to_time_units(max(self.time_us(s.start, s.stop, r),
                                 self.host_time_us(s.start, s.stop))
                             if self._host else self.time_us(s.start, s.stop, r))
               for s in cands.segments]
        out = [to_time_units(self.link_us(self.scale_bytes(c, r))) for c in cands.crossing_bytes]
        cin = out if self.training else [0] * len(out)
        return seg, out, cin
