"""What the solver's cost and memory models read of one cost graph alone, made once per
graph object (:func:`autopart.solver.candidates._per_graph`) and shared by every model of
that graph: the time tables (:class:`TimeTables`) and the memory tables
(:class:`MemoryTables`)."""

from __future__ import annotations

import numpy as np

from autopart.core.costgraph import CostGraph
from autopart.core.recompute_policy import CHECKPOINTED_POLICIES
from autopart.solver.candidates import _values, crossing_sums

__all__ = ["MemoryTables", "TimeTables", "two_point_line"]


def two_point_line(t0: float, t1: float, b0: int, b1: int) -> tuple[float, float]:
    """``(fixed, linear at b0)`` of the line through ``(b1, t1)`` and ``(b0, t0)``, its slope
    kept >= 0 (a figure measured lower at the larger batch is noise: held at ``t1``)."""
    slope = max((t0 - t1) / (b0 - b1), 0.0)
    return t1 - slope * b1, slope * b0



class TimeTables:
    """The prefix sums :class:`CostModel` reads, made of one graph (see its ``__init__``):
    per node the forward's and the backward's (fixed, linear) µs, per part and whole, and
    what a recomputing stage runs again; read-only once made, shared by every model of
    that graph, fixed time per op, training flag, policy and kept set."""

    def __init__(self, costs: CostGraph, kept: list[bool], ov: float, training: bool,
                 recompute_policy: str, selective_fixed_us: float) -> None:
        self.bwd_nodes = [0]  # prefix counts of the nodes with a backward
        # prefix counts of the nodes a recomputing stage keeps (checkpoints_selectively)
        self.kept_count = [0]
        for flag in kept:
            self.kept_count.append(self.kept_count[-1] + flag)
        self.fixed = [0.0]   # prefix sums of the batch-independent part of node time, µs
        self.linear = [0.0]  # prefix sums of the part linear in b / b0, µs
        # forward, input-gradient and weight-gradient parts, and the forward a recomputing
        # stage runs again (the forward less its kept nodes' under "selective"), (fixed,
        # linear) prefix sums, µs
        self.parts: dict[str, tuple[list[float], list[float]]] = {
            key: ([0.0], [0.0]) for key in ("fwd", "bwd_input", "bwd_weight", "recompute")}
        # per node (fixed, linear) of the forward and of the whole backward, µs
        self.node_fwd: list[tuple[float, float]] = []
        self.node_bwd: list[tuple[float, float]] = []
        b0, b1 = costs.batch_size, costs.low_batch_size
        # per node, (fixed, linear) µs of sequence parallelism's all-gathers its forward waits
        # for, which a stage recomputing under "selective" / "op" runs again whether or not
        # it keeps the node (CostGraph.recomputed_gathers)
        self.regather: dict[int, tuple[float, float]] = {
            i: two_point_line(t0, t1, b0, b1) if b1 else (0.0, t0)
            for i, t0, t1 in costs.recomputed_gathers}
        # expert parallelism's all-to-alls inside the node times (CostGraph.expert_exchanges):
        # per part ("fwd", "bwd"), (fixed, linear) prefix sums, µs
        self.exchange: dict[str, tuple[list[float], list[float]]] = {}
        if costs.expert_exchanges:
            by_node = {i: (two_point_line(f0, f1, b0, b1), two_point_line(g0, g1, b0, b1))
                       if b1 else ((0.0, f0), (0.0, g0))
                       for i, f0, g0, f1, g1 in costs.expert_exchanges}
            for k, part in enumerate(("fwd", "bwd")):
                fixed, linear = [0.0], [0.0]
                for i in range(len(costs.nodes)):
                    fx_, ln_ = by_node[i][k] if i in by_node else (0.0, 0.0)
                    fixed.append(fixed[-1] + fx_)
                    linear.append(linear[-1] + ln_)
                self.exchange[part] = (fixed, linear)
        for i, nd in enumerate(costs.nodes):
            times = (nd.fwd_us, nd.bwd_input_us, nd.bwd_weight_us)
            if b1:  # two profiled batches: the line through both, per part
                parts = [two_point_line(t0, t1, b0, b1)
                         for t0, t1 in zip(times, costs.low_times[i], strict=True)]
                bwd = (parts[1][0] + parts[2][0], parts[1][1] + parts[2][1])
            else:
                parts = [(min(t, ov), max(t - ov, 0.0)) for t in times]
                bwd = (min(nd.bwd_us, ov), max(nd.bwd_us - ov, 0.0))  # scaled as one op
            self.node_fwd.append(parts[0])
            self.node_bwd.append(bwd)
            fixed = parts[0][0] + (bwd[0] if training else 0.0)
            linear = parts[0][1] + (bwd[1] if training else 0.0)
            self.fixed.append(self.fixed[-1] + fixed)
            self.linear.append(self.linear[-1] + linear)
            self.bwd_nodes.append(self.bwd_nodes[-1] + (nd.bwd_us > 0))
            again = (0.0, 0.0) if kept[i] else parts[0]
            if recompute_policy in CHECKPOINTED_POLICIES:  # checkpointing's own cost
                again = (again[0] + selective_fixed_us, again[1])
                if kept[i] and i in self.regather:
                    again = (again[0] + self.regather[i][0], again[1] + self.regather[i][1])
            for key, (f, ln_) in zip(("fwd", "bwd_input", "bwd_weight", "recompute"),
                                     (*parts, again), strict=True):
                fx, ln = self.parts[key]
                fx.append(fx[-1] + f)
                ln.append(ln[-1] + ln_)
        # host issue times, per part: prefix sums, µs (none when the profile has none)
        self.host: dict[str, list[float]] = {}
        if costs.has_host_times:
            for k, key in enumerate(("fwd", "bwd_input", "bwd_weight")):
                sums = [0.0]
                for nd in costs.nodes:
                    sums.append(sums[-1] + nd.host_times[k])  # type: ignore[index]
                self.host[key] = sums
            again = [0.0]
            for i, nd in enumerate(costs.nodes):
                again.append(again[-1] + (0.0 if kept[i]
                                          else nd.host_times[0]))  # type: ignore[index]
            self.host["recompute"] = again
        # trainable parameters read by more than one node (GPT-2's tied wte / lm_head): the
        # nodes reading each, for tied_sync_us
        readers: dict[str, list[int]] = {}
        for i, nd in enumerate(costs.nodes):
            for p in nd.params:
                if p in costs.trainable:
                    readers.setdefault(p, []).append(i)
        self.shared = {p: idx for p, idx in readers.items() if len(idx) > 1}
        # microbatches measured segment by segment beside the two points (CostGraph.batch_scales):
        # rows -> prefix sums of each part's and of the whole node's time there, µs
        self.scaled: dict[float, dict[str, list[float]]] = {}
        for sc in costs.batch_scales:
            r = sc.batch_size / b0
            sums: dict[str, list[float]] = {key: [0.0] for key in ("fwd", "bwd_input",
                                                                   "bwd_weight", "recompute",
                                                                   "time")}
            for i, (ff, fb) in enumerate(sc.factors(len(costs.nodes))):
                at = {key: (fx[i + 1] - fx[i] + (ln[i + 1] - ln[i]) * r)
                      * (ff if key in ("fwd", "recompute") else fb)
                      for key, (fx, ln) in self.parts.items()}
                for key, t in at.items():
                    sums[key].append(sums[key][-1] + t)
                sums["time"].append(sums["time"][-1] + at["fwd"] + (
                    at["bwd_input"] + at["bwd_weight"] if training else 0.0))
            self.scaled[round(float(sc.batch_size), 6)] = sums


class MemoryTables:
    """What :class:`MemoryModel` reads of one graph alone (and whether it trains), made
    once per graph object (:func:`autopart.solver.candidates._per_graph`) and read-only but
    for the memo of :meth:`needs`."""

    def __init__(self, costs: CostGraph, training: bool) -> None:
        # for held_parts: where each node's output is last read (n: a graph output), whether
        # every node says which saved storages other nodes returned, and per position
        # 0 .. n the bytes of the non-contiguous node outputs crossing it
        values = _values(costs)
        self.last_use = [v.last_use for v in values if v.produced >= 0]
        self.producers_known = all(nd.saved_from is not None for nd in costs.nodes)
        # per position, the bytes of the crossing values that carry a gradient back: a node
        # output does when the node reads a trainable parameter or such a value (graph
        # inputs do not); a mask or a rotary table built from buffers does not, and torch's
        # stages neither allocate nor send its gradient
        needs_grad: dict[str, bool] = {}
        for nd in costs.nodes:
            needs_grad[nd.name] = (any(p in costs.trainable for p in nd.params)
                                   or any(needs_grad.get(x, False) for x in nd.inputs))
        self.grad_crossing = crossing_sums(
            costs, values, lambda v: v.nbytes if v.produced >= 0 and needs_grad[v.name] else 0)
        self.strided_crossing = crossing_sums(
            costs, values,
            lambda v: costs.nodes[v.produced].strided_output_bytes if v.produced >= 0 else 0)
        self.saved = [0]  # prefix sums of saved bytes at b0
        self.first_use: dict[str, int] = {}
        for i, nd in enumerate(costs.nodes):
            self.saved.append(self.saved[-1] + nd.saved_bytes)
            for p in nd.params:
                self.first_use.setdefault(p, i)
        # per node, the gradient its backward returns for each trainable parameter it reads,
        # alive beside .grad until AccumulateGrad adds it in (every microbatch but a step's
        # first, whose gradient .grad takes over): not scaled with the batch
        new_grad = [sum(costs.param_sizes[p] for p in nd.params if p in costs.trainable)
                    if training else 0 for nd in costs.nodes]
        # per node, its backward's measured allocation peak at both profiled batches as
        # (fixed, linear at b0): the weight gradients and the kernel's copies of them do not
        # grow with the batch, the activations' gradients do
        b0, b1 = costs.batch_size, costs.low_batch_size
        bwd_peak = ([two_point_line(float(nd.backward_peak_bytes), float(lo), b0, b1)
                     for nd, lo in zip(costs.nodes, costs.low_backward_peaks, strict=True)]
                    if training and b1 and costs.low_backward_peaks else [])
        nodes = costs.nodes
        self.training = training
        self._output = np.array([nd.output_bytes for nd in nodes], dtype=np.float64)
        self._grads = np.array([nd.transient_bytes for nd in nodes], dtype=np.float64)
        self._new_grad = np.array(new_grad, dtype=np.int64)
        measured = [bool(bwd_peak) and bool(nd.backward_peak_bytes) for nd in nodes]
        self._measured = np.array(measured, dtype=bool)
        self._fixed = np.array([bwd_peak[i][0] if m else 0.0 for i, m in enumerate(measured)],
                               dtype=np.float64)
        self._linear = np.array([bwd_peak[i][1] if m else 0.0 for i, m in enumerate(measured)],
                                dtype=np.float64)
        # ratio -> each node's working set and the largest, computed once per microbatch
        # size: a layout search asks for thousands of stage spans at a few sizes
        self._needs: dict[float, tuple[list[int], int]] = {}

    def needs(self, ratio: float) -> tuple[list[int], int]:
        """Every node's working set at ``ratio`` (``b / b0``; :meth:`MemoryModel.
        transient_bytes` of the node alone) and the largest, bytes: its output, or when
        training the larger of its gradients and its backward's peak (the two-point line
        plus its outputs, where measured at both profiled batches) or its gradients plus the
        new gradients of the parameters it reads; each scaled figure rounded up as
        :meth:`MemoryModel.scale_bytes` rounds it (the same float64 arithmetic)."""
        hit = self._needs.get(ratio)
        if hit is not None:
            return hit
        output = np.ceil(self._output * ratio - 1e-9).astype(np.int64)
        if self.training:
            grads = np.ceil(self._grads * ratio - 1e-9).astype(np.int64)
            peak = np.ceil(self._fixed + self._linear * ratio).astype(np.int64) + output
            need = np.where(self._measured, np.maximum(np.maximum(output, grads), peak),
                            np.maximum(output, grads + self._new_grad))
        else:
            need = output
        values = need.tolist()
        hit = self._needs[ratio] = (values, max(values, default=0))
        return hit
