"""Per-microbatch costs of segments and stages: time and communication (µs), peak memory (bytes)."""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from autopart.core.cluster import Cluster
from autopart.core.costgraph import CostGraph
from autopart.solver.candidates import CutCandidates, _values, crossing_profile, crossing_sums

if TYPE_CHECKING:
    from autopart.solver.options import SolveOptions

#: CP-SAT time unit: chain costs are integers in tenths of a µs (round half to even).
TIME_UNITS_PER_US = 10


def to_time_units(us: float) -> int:
    """µs -> integer CP-SAT time units (0.1 µs)."""
    return int(round(us * TIME_UNITS_PER_US))


@dataclass(frozen=True, slots=True)
class StageEstimate:
    """Predicted per-microbatch cost of op nodes ``start .. stop - 1`` run as stage ``stage``.

    Attributes:
        stage: stage index (= rank).
        start: first op node index.
        stop: one past the last op node index.
        fwd_us: forward time, µs.
        bwd_us: backward time, µs (0 for inference).
        comm_us: forward send of the outgoing cut plus, when training, the gradient send of the
            incoming cut, µs.
        peak_memory_bytes: parameter state + saved activations of all microbatches + largest
            single-node output + incoming and outgoing crossing bytes.
        param_bytes: bytes of every parameter and buffer its nodes read.
        num_parameters: elements of the trainable parameters its nodes read.
    """

    stage: int
    start: int
    stop: int
    fwd_us: float
    bwd_us: float
    comm_us: float
    peak_memory_bytes: int
    param_bytes: int
    num_parameters: int

    @property
    def time_us(self) -> float:
        """Stage time per microbatch, µs: fwd + bwd + comm."""
        return self.fwd_us + self.bwd_us + self.comm_us


def _two_point(t0: float, t1: float, b0: int, b1: int) -> tuple[float, float]:
    """``(fixed, linear at b0)`` of the line through ``(b1, t1)`` and ``(b0, t0)``, its slope
    kept >= 0 (a time measured lower at the larger batch is noise: held at ``t1``)."""
    slope = max((t0 - t1) / (b0 - b1), 0.0)
    return t1 - slope * b1, slope * b0


class CostModel:
    """The cost model of DESIGN.md evaluated at microbatch size ``b = batch_size / m``.

    Time of one node at batch ``b`` from its profiled time ``t0`` at ``b0``, with ``ov`` the
    device's ``op_overhead_us``: ``t(b) = min(t0, ov) + max(t0 - ov, 0) * b / b0``. For
    ``t0 >= ov`` this is ``DeviceSpec``'s ``ov + (t0 - ov) * b / b0``; ops cheaper than the
    overhead (views, getitem) stay at ``t0`` instead of being raised to ``ov``. The backward of a
    node (input + weight gradient) is scaled as one op. Activation bytes (outputs, saved,
    crossing, graph inputs) scale as ``ceil(bytes * b / b0)``; parameter bytes do not scale.

    When the graph was also profiled at a smaller batch ``b1`` (``CostGraph.low_batch_size``),
    each part of each node (forward, input gradient, weight gradient) is the line through
    its two measured times instead: ``t(b) = t1 + s * (b - b1)`` with
    ``s = max((t0 - t1) / (b0 - b1), 0)``. This holds the costs that do not shrink with the
    batch (reading a layer's weights, dispatch), which a single profile at the full batch
    scales away: on this project's 2-core CPU, single-point scaling put a GPT-2-like
    model's 1F1B step 11 % under at 16 microbatches and 14 % over at 2
    (``benchmarks/fidelity``). The solver's microbatches are never smaller than ``b1``
    (the smallest candidate), so the line is only used between its two points.

    At a microbatch the profiler also measured segment by segment (``CostGraph.batch_scales``),
    each node's time on the line is multiplied by its segment's measured-over-line factor
    there, per forward and backward: kernels choose their algorithm by shape, and the
    fidelity CNN's forward and backward at 4 rows ran 5.6 % under the line through 2 and 8.

    Args:
        costs: the cost graph, profiled at ``costs.batch_size``.
        cluster: devices; ``op_overhead_us`` is read from ``cluster.devices[0]``.
        batch_size: the full batch the plan is for.
        training: include backward time, gradient sends, saved activations and optimizer state.
        state_factor: optimizer state bytes per trainable parameter byte (AdamW: 2.0); a
            trainable parameter then holds ``(2 + state_factor) x`` its bytes (weight, gradient,
            state); buffers, and every parameter when not training, hold 1x.
        split_factor: measured ``(I + W) / B`` of a backward run as ``I`` then ``W``, applied
            to the stages whose backward splits (:func:`autopart.core.schedule.splits_backward`;
            default 1.0).
        split_us_per_node: what splitting a backward adds per node that has a backward, per
            microbatch, µs, whatever the microbatch's size (default 0.0); see
            :meth:`split_overhead_us`.
        split_points: ``(rows, µs per node)`` where that cost was measured at several
            microbatch sizes (default ``()``); when given it replaces ``split_us_per_node``
            (:meth:`split_us_per_node_at`).
        receive_buffers_per_microbatch: training stages hold m receive buffers for their
            input and m for their outputs' gradient (torch.distributed.pipelining's stages
            allocate one per microbatch up front; default False: one of each), and keep
            each microbatch's sent output and input gradient until the step ends.
        transfer_overhead_us: added to an F's, B's or I's duration once per transfer between
            ranks it posts or waits on, µs (default 0.0; ``SolveOptions.transfer_overhead_us``).
    """

    def __init__(self, costs: CostGraph, cluster: Cluster, *, batch_size: int, training: bool,
                 state_factor: float, split_factor: float = 1.0, split_us_per_node: float = 0.0,
                 receive_buffers_per_microbatch: bool = False,
                 transfer_overhead_us: float = 0.0,
                 split_points: Sequence[tuple[float, float]] = ()) -> None:
        self.costs = costs
        self.split_factor = split_factor  # (I + W) / B where splits_backward(kind, recompute)
        self.split_us_per_node = split_us_per_node
        self.split_points = tuple(sorted(split_points))
        self._bwd_nodes = [0]  # prefix counts of the nodes with a backward
        self.receive_buffers_per_microbatch = receive_buffers_per_microbatch
        self.transfer_overhead_us = transfer_overhead_us
        self.cluster = cluster
        self.batch_size = batch_size
        self.training = training
        self.overhead_us = cluster.devices[0].op_overhead_us
        self.crossing, _ = crossing_profile(costs)
        # for held_parts: where each node's output is last read (n: a graph output), whether
        # every node says which saved storages other nodes returned, and per position
        # 0 .. n the bytes of the non-contiguous node outputs crossing it
        values = _values(costs)
        self._last_use = [v.last_use for v in values if v.produced >= 0]
        self._producers_known = all(nd.saved_from is not None for nd in costs.nodes)
        self._held: dict[tuple[int, int], tuple[int, int, int]] = {}
        self._strided_crossing = crossing_sums(
            costs, values,
            lambda v: costs.nodes[v.produced].strided_output_bytes if v.produced >= 0 else 0)
        ov = self.overhead_us
        self._fixed = [0.0]   # prefix sums of the batch-independent part of node time, µs
        self._linear = [0.0]  # prefix sums of the part linear in b / b0, µs
        self._saved = [0]     # prefix sums of saved bytes at b0
        # forward, input-gradient and weight-gradient parts, (fixed, linear) prefix sums, µs
        self._parts: dict[str, tuple[list[float], list[float]]] = {
            key: ([0.0], [0.0]) for key in ("fwd", "bwd_input", "bwd_weight")}
        # per node (fixed, linear) of the forward and of the whole backward, µs
        self._node_fwd: list[tuple[float, float]] = []
        self._node_bwd: list[tuple[float, float]] = []
        b0, b1 = costs.batch_size, costs.low_batch_size
        first_use: dict[str, int] = {}
        for i, nd in enumerate(costs.nodes):
            times = (nd.fwd_us, nd.bwd_input_us, nd.bwd_weight_us)
            if b1:  # two profiled batches: the line through both, per part
                parts = [_two_point(t0, t1, b0, b1)
                         for t0, t1 in zip(times, costs.low_times[i], strict=True)]
                bwd = (parts[1][0] + parts[2][0], parts[1][1] + parts[2][1])
            else:
                parts = [(min(t, ov), max(t - ov, 0.0)) for t in times]
                bwd = (min(nd.bwd_us, ov), max(nd.bwd_us - ov, 0.0))  # scaled as one op
            self._node_fwd.append(parts[0])
            self._node_bwd.append(bwd)
            fixed = parts[0][0] + (bwd[0] if training else 0.0)
            linear = parts[0][1] + (bwd[1] if training else 0.0)
            self._fixed.append(self._fixed[-1] + fixed)
            self._linear.append(self._linear[-1] + linear)
            self._saved.append(self._saved[-1] + nd.saved_bytes)
            self._bwd_nodes.append(self._bwd_nodes[-1] + (nd.bwd_us > 0))
            for key, (f, ln_) in zip(("fwd", "bwd_input", "bwd_weight"), parts, strict=True):
                fx, ln = self._parts[key]
                fx.append(fx[-1] + f)
                ln.append(ln[-1] + ln_)
            for p in nd.params:
                first_use.setdefault(p, i)
        mult = (2.0 + state_factor) if training else 1.0
        self.state_bytes = {
            p: int(math.ceil(nbytes * mult)) if p in costs.trainable else nbytes
            for p, nbytes in costs.param_sizes.items()}
        self._first_state = [0] * (len(costs.nodes) + 1)  # prefix sums of first-use state bytes
        per_node = [0] * len(costs.nodes)
        for p, i in first_use.items():
            per_node[i] += self.state_bytes[p]
        # trainable parameters read by more than one node (GPT-2's tied wte / lm_head): the
        # nodes reading each, for tied_sync_us
        readers: dict[str, list[int]] = {}
        for i, nd in enumerate(costs.nodes):
            for p in nd.params:
                if p in costs.trainable:
                    readers.setdefault(p, []).append(i)
        self._shared = {p: idx for p, idx in readers.items() if len(idx) > 1}
        # per node, the gradient its backward returns for each trainable parameter it reads,
        # alive beside .grad until AccumulateGrad adds it in (every microbatch but a step's
        # first, whose gradient .grad takes over): not scaled with the batch
        self._new_grad = [sum(costs.param_sizes[p] for p in nd.params if p in costs.trainable)
                          if training else 0 for nd in costs.nodes]
        # per node, its backward's measured allocation peak at both profiled batches as
        # (fixed, linear at b0): the weight gradients and the kernel's copies of them do not
        # grow with the batch, the activations' gradients do
        self._bwd_peak = ([_two_point(float(nd.backward_peak_bytes), float(lo), b0, b1)
                           for nd, lo in zip(costs.nodes, costs.low_backward_peaks, strict=True)]
                          if training and b1 and costs.low_backward_peaks else [])
        for i, v in enumerate(per_node):
            self._first_state[i + 1] = self._first_state[i] + v
        # microbatches measured segment by segment beside the two points (CostGraph.batch_scales):
        # rows -> prefix sums of each part's and of the whole node's time there, µs
        self._scaled: dict[float, dict[str, list[float]]] = {}
        for sc in costs.batch_scales:
            r = sc.batch_size / b0
            sums: dict[str, list[float]] = {key: [0.0] for key in ("fwd", "bwd_input",
                                                                   "bwd_weight", "time")}
            for i, (ff, fb) in enumerate(sc.factors(len(costs.nodes))):
                at = {key: (fx[i + 1] - fx[i] + (ln[i + 1] - ln[i]) * r) * (ff if key == "fwd"
                                                                            else fb)
                      for key, (fx, ln) in self._parts.items()}
                for key, t in at.items():
                    sums[key].append(sums[key][-1] + t)
                sums["time"].append(sums["time"][-1] + at["fwd"] + (
                    at["bwd_input"] + at["bwd_weight"] if training else 0.0))
            self._scaled[round(float(sc.batch_size), 6)] = sums

    # ---- scaling -------------------------------------------------------------------
    def ratio(self, m: int) -> float:
        """``b / b0`` for ``m`` microbatches."""
        return self.batch_size / m / self.costs.batch_size

    @staticmethod
    def scale_bytes(nbytes: int, ratio: float) -> int:
        """Activation bytes at the scaled batch, rounded up."""
        return int(math.ceil(nbytes * ratio - 1e-9))

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

    def part_us(self, part: str, start: int, stop: int, ratio: float) -> float:
        """Time of ``part`` (``"fwd"``, ``"bwd_input"``, ``"bwd_weight"``) of nodes
        ``start .. stop - 1`` at ``ratio = b / b0``, µs (each part scaled as its own op)."""
        at = self._measured_at(ratio)
        if at is not None:
            return at[part][stop] - at[part][start]
        fx, ln = self._parts[part]
        return fx[stop] - fx[start] + (ln[stop] - ln[start]) * ratio

    @property
    def charges_split(self) -> bool:
        """Whether splitting a backward costs anything per node at some microbatch size."""
        return self.split_us_per_node > 0.0 or any(us > 0.0 for _, us in self.split_points)

    def split_us_per_node_at(self, rows: float) -> float:
        """What splitting a backward adds per node with a backward at a microbatch of
        ``rows`` rows, µs: ``split_us_per_node`` without ``split_points``; with one point its
        cost; else read off the piecewise line through the points (the end pieces extended
        beyond the first and last rows), at least 0.

        The split's extra work grows with the microbatch: timed as profiled (caches flushed
        before each part), the fidelity GPT-2's piece measured 22, 52 and 70.5 µs per node
        at 2, 4 and 8 rows (2-core CPU, torch 2.13.0+cpu, medians of 4), and its ZB-H1 plan
        at m = 4 (8 rows) paid 5.8 ms a microbatch on its second rank for the split
        against 2.6 ms charged at the 2-row figure."""
        pts = self.split_points
        if not pts:
            return self.split_us_per_node
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

    def tied_sync_us(self, positions: Sequence[int], p: int) -> float:
        """End-of-step all-reduce of the gradients of trainable parameters that stages on
        more than one rank read (a tied embedding and LM head), µs; 0 when not training.

        Each such parameter of ``b`` bytes, held by ``k`` ranks, is summed with one
        all-reduce (the runtimes' ``reduce_grads``): a ring's ``2 (k - 1) / k * b`` bytes
        each way per rank, charged as a send and a receive one after the other over the
        slowest link between those ranks (:meth:`autopart.core.cluster.Cluster.transfer_us`).
        On the gloo host link here (2-core CPU, torch 2.13.0+cpu) an 8 MiB tied embedding's
        all-reduce measured 7-12 ms per step and a 16 MiB one 13.5 ms; this charges 7.6 and
        15.2 ms at the link's measured 2.2 GB/s.

        Args:
            positions: the cut positions (``p * v - 1``, ascending); stage ``s`` runs on
                rank ``s % p``.
            p: ranks.
        """
        if not self.training or p < 2 or not self._shared:
            return 0.0
        total = 0.0
        for param, nodes in self._shared.items():
            ranks = sorted({bisect.bisect_right(positions, i) % p for i in nodes})
            k = len(ranks)
            if k < 2:
                continue
            nbytes = int(math.ceil(2 * (k - 1) / k * self.costs.param_sizes[param]))
            total += 2 * max(self.cluster.transfer_us(nbytes, a, b)
                             for a, b in itertools.pairwise(ranks))
        return total

    @classmethod
    def for_options(cls, costs: CostGraph, cluster: Cluster, options: SolveOptions,
                    batch_size: int | None = None) -> CostModel:
        """The model a :class:`autopart.solver.SolveOptions` describes (its batch unless
        ``batch_size`` is given)."""
        return cls(costs, cluster, batch_size=options.batch_size if batch_size is None
                   else batch_size, training=options.training,
                   state_factor=options.optimizer_state_bytes_per_param_byte,
                   split_factor=options.split_backward_factor,
                   split_us_per_node=options.split_backward_us_per_node,
                   split_points=options.split_backward_points,
                   receive_buffers_per_microbatch=options.receive_buffers_per_microbatch,
                   transfer_overhead_us=options.transfer_overhead_us)

    def speed(self, rank: int) -> float:
        """Time multiplier of ``rank`` against the profiled device: peak FLOP/s of rank 0 over
        that of ``rank`` (1.0 on a uniform cluster)."""
        return self.cluster.devices[0].peak_flops / self.cluster.devices[rank].peak_flops

    def saved_bytes(self, start: int, stop: int) -> int:
        """Saved activations of nodes ``start .. stop - 1`` at the profiled batch, bytes."""
        return self._saved[stop] - self._saved[start]

    @property
    def held_bytes_cover_outputs(self) -> bool:
        """Whether :meth:`held_bytes` counts a stage's outputs (the profile says which saved
        storages the nodes returned)."""
        return self._producers_known

    def held_bytes(self, start: int, stop: int) -> int:
        """What a stage of nodes ``start .. stop - 1`` holds for one microbatch from its
        forward to its backward, at the profiled batch, bytes.

        A runtime keeps each stage's outputs (to start its backward from them, and until the
        send completes), whether or not autograd saved them: the outputs of nodes in the
        stage read at ``stop`` or later that no node of the stage saved are added to the
        stage's saved bytes. Measured on the fidelity GPT-2 (2 gloo ranks, interleaved 1F1B,
        m = 4): every forward of a stage ending at a residual add held 1 MiB (its two
        outputs) more than its saved bytes, and the last rank's peak came out 0.33 % under.
        With torch's stages (``receive_buffers_per_microbatch``) the inputs a stage
        saves are its receive buffers, counted in its static bytes: the saved storages that
        an earlier stage returned are taken out (:attr:`NodeCost.saved_from`). The local
        runtime hands a stage's outputs on as they are (or copied to another device, where
        the receiving stage holds the copy): they stay counted where they are saved.
        Without ``saved_from`` (profiles from before it), the saved bytes alone.

        torch's stages also move dense buffers only (``autopart.runtime.distributed``): a
        non-contiguous output (:attr:`NodeCost.strided_output_bytes`) is sent as a
        contiguous copy, held like the outputs, and a stage copies such an input back into
        its captured layout, counted as held until the backward (the stage's nodes may save
        it). Measured on the same GPT-2: a stage sending a transposed attention output held
        0.5 MiB a microbatch more, and so did the stage receiving it.
        """
        inside, outputs, strided = self.held_parts(start, stop)
        return inside + outputs + strided

    def held_parts(self, start: int, stop: int) -> tuple[int, int, int]:
        """The three parts of :meth:`held_bytes`, at the profiled batch, bytes: what the
        stage's nodes save (less, with torch's stages, the inputs they save from receive
        buffers); its outputs no node of it saves; the copies of strided values crossing its
        cuts (torch's stages). Without ``saved_from``: ``(saved bytes, 0, 0)``."""
        key = (start, stop)
        if key in self._held:
            return self._held[key]
        inside, outputs, strided = self.saved_bytes(start, stop), 0, 0
        if self._producers_known:
            nodes = self.costs.nodes
            saved_here: set[int] = set()  # producers (node indices) whose output is saved here
            outside = 0
            for j in range(start, stop):
                for dist, nbytes in nodes[j].saved_from or ():
                    if j - dist >= start:
                        saved_here.add(j - dist)
                    else:
                        outside += nbytes
            if self.receive_buffers_per_microbatch:
                inside -= outside
                strided = self.strided_bytes(start, stop)
            outputs = sum(nodes[i].output_bytes for i in range(start, stop)
                          if self._last_use[i] >= stop and i not in saved_here)
        self._held[key] = (inside, outputs, strided)
        return self._held[key]

    def strided_bytes(self, start: int, stop: int) -> int:
        """Non-contiguous values crossing into and out of a stage of nodes ``start .. stop -
        1`` at the profiled batch, bytes: the copies torch's stages make of them (see
        :meth:`held_bytes`). 0 unless ``receive_buffers_per_microbatch``."""
        if not self.receive_buffers_per_microbatch:
            return 0
        n = len(self.costs.nodes)
        return ((self._strided_crossing[start] if start > 0 else 0)
                + (self._strided_crossing[stop] if stop < n else 0))

    def split_held_bytes(self, start: int, stop: int, ratio: float) -> int:
        """What a split backward of nodes ``start .. stop - 1`` keeps from ``I`` to ``W``,
        scaled, bytes: the gradient of each node where a trainable parameter's path joins
        the activations' (a matmul reading its weight, a norm reading its scale), as big as
        that node's output (:class:`autopart.codegen.split_backward.SplitBackward`'s
        intermediates). Not for the first stage, where the model's inputs need no gradient:
        there ``I`` computes nothing and ``W`` runs the whole backward from the stage's
        outputs and their gradients, which is what the solver charges it
        (``solver._evaluate``). Charging this figure there put the first rank's peak 49 %
        over a CNN's measured ZB-H1 peak (2 gloo ranks, ``benchmarks/fidelity``)."""
        nodes = self.costs.nodes[start:stop]
        trainable = self.costs.trainable
        weight_only: set[str] = set()  # nodes computed from parameters alone
        held = 0
        for nd in nodes:
            reads_weight = any(p in trainable for p in nd.params) or any(
                i in weight_only for i in nd.inputs)
            reads_activation = any(i not in weight_only for i in nd.inputs)
            if reads_weight and not reads_activation:
                weight_only.add(nd.name)
            elif reads_weight:
                held += nd.output_bytes
        return self.scale_bytes(held, ratio)

    def state_of(self, start: int, stop: int) -> tuple[int, int, int]:
        """(state bytes, parameter bytes, trainable elements) of every parameter read by
        nodes ``start .. stop - 1`` (a tied parameter counts on every stage reading it)."""
        params = sorted({p for nd in self.costs.nodes[start:stop] for p in nd.params})
        return (sum(self.state_bytes[p] for p in params),
                sum(self.costs.param_sizes[p] for p in params),
                sum(self.costs.param_numel[p] for p in params if p in self.costs.trainable))

    def transient_bytes(self, start: int, stop: int, ratio: float) -> int:
        """Largest single-node working set of nodes ``start .. stop - 1``, bytes: its output
        or, when training, its backward's:

        - where the profile measured it at two batches (``NodeCost.backward_peak_bytes``,
          ``CostGraph.low_backward_peaks``), the line through both at ``b`` plus its
          outputs' gradients, or its gradients (``NodeCost.transient_bytes``, scaled; the
          loss's working set, folded into the last node, is there) if more. The new weight
          gradients and what the kernel allocates beside them are in the measured figure.
          Measured on the fidelity CNN's last stage (1F1B, m = 8): its last convolution's
          backward held 2 x its 2.25 MiB weight (oneDNN writes the weight's gradient twice)
          and 0.5 MiB of activation gradients, 2 MiB more than the gradients and the new
          weight gradient;
        - otherwise its gradients (scaled) plus the new gradients of the trainable
          parameters it reads (not scaled: they live beside ``.grad`` until added to it).
        """
        nodes = self.costs.nodes
        out = 0
        for i in range(start, stop):
            nd = nodes[i]
            output = self.scale_bytes(nd.output_bytes, ratio)
            need = output
            if self.training:
                grads = self.scale_bytes(nd.transient_bytes, ratio)
                if self._bwd_peak and nd.backward_peak_bytes:
                    fixed, linear = self._bwd_peak[i]
                    need = max(need, grads, int(math.ceil(fixed + linear * ratio)) + output)
                else:
                    need = max(need, grads + self._new_grad[i])
            out = max(out, need)
        return out

    def whole_backward_bytes(self, start: int, stop: int, ratio: float) -> int:
        """Most a backward of nodes ``start .. stop - 1`` run as one autograd call that returns
        every trainable parameter's gradient holds above what it started from, bytes.

        The call keeps each gradient until it returns, while each node's backward frees what
        that node saved: at each node, its working set (:meth:`transient_bytes`) plus what
        the gradients of the parameters read only after it (their backward ran first) exceed
        the saved bytes of the nodes after it, scaled."""
        trainable, nodes = self.costs.trainable, self.costs.nodes
        done: set[str] = set()  # parameters whose gradient the call holds already
        freed = out = 0
        for i in range(stop - 1, start - 1, -1):
            own = {p for p in nodes[i].params if p in trainable}
            grads = sum(self.costs.param_sizes[p] for p in done - own)
            out = max(out, self.transient_bytes(i, i + 1, ratio) + max(grads - freed, 0))
            done |= own
            freed += self.scale_bytes(nodes[i].saved_bytes, ratio)
        return out

    def max_transient_bytes(self, ratio: float) -> int:
        """:meth:`transient_bytes` over the whole graph."""
        return self.transient_bytes(0, len(self.costs.nodes), ratio)

    # ---- chain data for the partition solvers --------------------------------------
    def chain_time(self, cands: CutCandidates, m: int) -> tuple[list[int], list[int], list[int]]:
        """Integer chain costs at ``m`` microbatches: (segment time, cut out-charge, cut in-charge).

        The out-charge is the forward activation send (sender's stage), the in-charge the gradient
        send (receiver's stage, training only); both in 0.1 µs units.
        """
        r = self.ratio(m)
        seg = [to_time_units(self.time_us(s.start, s.stop, r)) for s in cands.segments]
        out = [to_time_units(self.link_us(self.scale_bytes(c, r))) for c in cands.crossing_bytes]
        cin = out if self.training else [0] * len(out)
        return seg, out, cin

    def chain_memory(self, cands: CutCandidates, m: int) -> tuple[list[int], list[int]]:
        """Additive memory weights at ``m`` microbatches, bytes: (segment, cut).

        Segment weight = state of the parameters first read in it + ``m x`` its saved activations
        (training); cut weight = its crossing bytes (``2 m x`` with torch's stages: one
        receive buffer per microbatch, and each microbatch's sent tensor kept until the step
        ends), held by both neighbouring stages. Tied
        parameters count once here (the exact check in :meth:`evaluate` counts every replica).
        """
        r = self.ratio(m)
        seg = []
        for s in cands.segments:
            saved = m * self.scale_bytes(self._saved[s.stop] - self._saved[s.start], r)
            state = self._first_state[s.stop] - self._first_state[s.start]
            seg.append(state + (saved if self.training else 0))
        per_cut = 2 * m if self.training and self.receive_buffers_per_microbatch else 1
        cut = [per_cut * self.scale_bytes(c, r) for c in cands.crossing_bytes]
        return seg, cut

    def chain_memory_caps(self, caps_bytes: Sequence[int], m: int) -> list[int]:
        """Per-stage caps for :meth:`chain_memory` weights, bytes.

        From each device cap it subtracts what the additive weights leave out: the graph's
        largest single-node output (a conservative transient), the device's workspaces
        (``DeviceSpec.workspace_bytes``), the graph inputs on the first stage and the graph
        outputs on the last.
        """
        r = self.ratio(m)
        n = len(self.costs.nodes)
        transient = max((self.scale_bytes(nd.output_bytes, r) for nd in self.costs.nodes),
                        default=0)
        caps = []
        for s, cap in enumerate(caps_bytes):
            # cuBLAS workspaces of the stage's stream (one stage per rank here)
            room = cap - transient - self.cluster.devices[s % self.cluster.num_ranks].workspace_bytes
            if s == 0:
                room -= self.scale_bytes(self.crossing[0], r)
            if s == len(caps_bytes) - 1:
                room -= self.scale_bytes(self.crossing[n], r)
            caps.append(max(room, 0))
        return caps

    # ---- exact evaluation ----------------------------------------------------------
    def evaluate(self, positions: Sequence[int], m: int) -> list[StageEstimate]:
        """Predicted time and memory of every stage for cuts at node ``positions`` and ``m``.

        Communication uses the actual link between the two ranks of each cut.
        """
        costs, r = self.costs, self.ratio(m)
        n = len(costs.nodes)
        bounds = [0, *positions, n]
        out: list[StageEstimate] = []
        for s, (a, z) in enumerate(itertools.pairwise(bounds)):
            if self._measured_at(r) is not None:
                fwd = self.part_us("fwd", a, z, r)
                bwd = (self.part_us("bwd_input", a, z, r) + self.part_us("bwd_weight", a, z, r)
                       if self.training else 0.0)
            else:
                fwd = sum(f + ln * r for f, ln in self._node_fwd[a:z])
                bwd = sum(f + ln * r for f, ln in self._node_bwd[a:z]) if self.training else 0.0
            cross_in = self.scale_bytes(self.crossing[a], r)
            cross_out = self.scale_bytes(self.crossing[z], r)
            comm = self.cluster.transfer_us(cross_out, s, s + 1) if z < n else 0.0
            if self.training and a > 0:
                comm += self.cluster.transfer_us(cross_in, s, s - 1)
            params = sorted({p for nd in costs.nodes[a:z] for p in nd.params})
            state = sum(self.state_bytes[p] for p in params)
            saved = m * self.scale_bytes(self._saved[z] - self._saved[a], r) if self.training else 0
            transient = max(self.scale_bytes(nd.output_bytes, r) for nd in costs.nodes[a:z])
            out.append(StageEstimate(
                stage=s, start=a, stop=z, fwd_us=fwd, bwd_us=bwd, comm_us=comm,
                peak_memory_bytes=(state + saved + transient + cross_in + cross_out
                                   + self.cluster.devices[s % self.cluster.num_ranks]
                                   .workspace_bytes),
                param_bytes=sum(costs.param_sizes[p] for p in params),
                num_parameters=sum(costs.param_numel[p] for p in params if p in costs.trainable),
            ))
        return out
