"""CostGraph: per-node costs of a captured graph, the contract between profiler and solver."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from autopart.core.errors import PlanError
from autopart.core.jsonio import dumps, write_text_atomic

__all__ = ["NodeCost", "CostGraph", "BatchScale", "COSTGRAPH_SCHEMA_VERSION", "HOST_FIELDS",
           "path_pattern", "layer_of_path"]

COSTGRAPH_SCHEMA_VERSION = 1


_INDEX = re.compile(r"^(.*?)\.(\d+)(?:\.|$)")


def path_pattern(module_path: str) -> tuple[str, int] | None:
    """Split a module path at its first integer component: the layer of a stack it is in.

    ``"model.layers.3.mlp.act_fn"`` -> ``("model.layers", 3)``; a path without one -> None.
    """
    m = _INDEX.match(module_path)
    if m is None:
        return None
    return m.group(1), int(m.group(2))


def layer_of_path(path: str) -> str | None:
    """The layer a module path (or a parameter's FQN) is in: ``"<stack>.<i>"``
    (``"model.layers.3"`` for ``"model.layers.3.mlp.up_proj.weight"``), or None outside
    every stack (embeddings, final norm, head)."""
    found = path_pattern(path)
    return None if found is None else f"{found[0]}.{found[1]}"




@dataclass(frozen=True, slots=True)
class NodeCost:
    """Costs of one FX node (an op of the captured graph), for one profiled batch.

    Attributes:
        name: FX node name, unique in the graph.
        op: the op it calls, e.g. ``"aten.linear.default"``.
        module_path: innermost ``nn_module_stack`` FQN (``""`` at the model's top level).
        fwd_us: forward time, µs.
        bwd_input_us: backward time for the gradient w.r.t. its tensor inputs, µs.
        bwd_weight_us: backward time for the gradient w.r.t. its parameters, µs.
        flops: floating-point operations of the forward (0 when not counted).
        bytes_accessed: bytes read + written by the forward (0 when not counted).
        output_bytes: bytes of the tensors it returns.
        saved_bytes: bytes autograd keeps from this node for the backward, parameters excluded.
        param_bytes: bytes of the parameters this node is the first to read.
        inputs: names of the nodes or graph inputs whose values it reads, in order.
        params: FQNs of the parameters and buffers it reads (any use, not just the first).
        output_is_tensor: False when it returns a tuple, list, scalar or None; such a value
            never crosses a cut.
        transient_bytes: bytes live only while this node's backward runs: the gradients
            of its outputs and of its differentiable tensor inputs (0 when not training);
            a stage's largest is its transient working set. Optional (default 0).
        backward_peak_bytes: the most its whole backward (input and weight gradients, from
            given gradients of its outputs) held allocated at once: the new gradients, and
            what the kernel makes beside them (oneDNN's convolution backward on the CPU
            writes the weight's gradient twice). Measured once by the profiler
            (``autopart.core.memory.allocated_peak_bytes``). Optional (default 0: not
            measured).
        saved_from: of the storages this node is the first to save (``saved_bytes``), the
            ones another node (or this one) returned: ``(distance, bytes)`` pairs, the
            producer being the node ``distance`` places earlier in ``nodes`` (0: this node;
            more than this node's index: a graph input). The rest of ``saved_bytes`` is
            what the op keeps of its own (a mask, a softmax's statistics). With it, a
            stage's held activations follow the runtime that sends between processes: the
            producer's stage keeps what it sent until its backward, and the receiving stage
            saves the copy in its receive buffer (``autopart.solver._memory_model``). Optional
            (None: not recorded, as in profiles from before it existed).
        strided_output_bytes: bytes of its output tensors that are not contiguous (a
            transposed attention output, an ``expand``ed mask). A runtime that sends between
            processes moves dense buffers: it sends a contiguous copy of such an output, and
            the receiving stage copies it back into the captured layout. Optional (default 0).
        host_fwd_us, host_bwd_input_us, host_bwd_weight_us: the host's issue time of each
            part, µs (``perf_counter`` around the call, no synchronize; measured on CUDA).
            Optional, on every node or on none (default None: the host runs the op itself,
            as on the CPU). Independent of the batch: on one H100 a GPT-2 microbatch cost
            30-45 ms of host time at every size (``benchmarks/gpu/README.md``).
    """

    name: str
    op: str
    module_path: str
    fwd_us: float
    bwd_input_us: float
    bwd_weight_us: float
    flops: int
    bytes_accessed: int
    output_bytes: int
    saved_bytes: int
    param_bytes: int
    inputs: tuple[str, ...] = ()
    params: tuple[str, ...] = ()
    output_is_tensor: bool = True
    transient_bytes: int = 0
    backward_peak_bytes: int = 0
    saved_from: tuple[tuple[int, int], ...] | None = None
    strided_output_bytes: int = 0
    host_fwd_us: float | None = None
    host_bwd_input_us: float | None = None
    host_bwd_weight_us: float | None = None

    def __post_init__(self) -> None:
        for attr in ("fwd_us", "bwd_input_us", "bwd_weight_us", "flops", "bytes_accessed",
                     "output_bytes", "saved_bytes", "param_bytes", "transient_bytes",
                     "backward_peak_bytes", "strided_output_bytes"):
            if getattr(self, attr) < 0:
                raise PlanError(f"node {self.name!r}: {attr} must be >= 0, got {getattr(self, attr)}")
        host = [getattr(self, a) for a in HOST_FIELDS]
        if any(h is not None for h in host) and not all(h is not None and h >= 0 for h in host):
            raise PlanError(f"node {self.name!r}: host times {host} must all be >= 0 µs or all "
                            "None (not measured); re-profile the model")
        if self.saved_from is not None and (
                any(d < 0 or b < 0 for d, b in self.saved_from)
                or sum(b for _, b in self.saved_from) > self.saved_bytes):
            raise PlanError(f"node {self.name!r}: saved_from {list(self.saved_from)[:4]} needs "
                            "(distance >= 0, bytes >= 0) pairs adding up to at most saved_bytes "
                            f"({self.saved_bytes}); re-profile the model")

    @property
    def bwd_us(self) -> float:
        """Full backward time, µs (input-gradient plus weight-gradient part)."""
        return self.bwd_input_us + self.bwd_weight_us

    @property
    def host_times(self) -> tuple[float, float, float] | None:
        """``(host_fwd_us, host_bwd_input_us, host_bwd_weight_us)``; None: not measured."""
        f, i, w = self.host_fwd_us, self.host_bwd_input_us, self.host_bwd_weight_us
        return None if f is None or i is None or w is None else (f, i, w)


#: NodeCost's optional host issue times, µs (None: not measured).
HOST_FIELDS = ("host_fwd_us", "host_bwd_input_us", "host_bwd_weight_us")


@dataclass(frozen=True, slots=True)
class BatchScale:
    """How far a batch's measured times are from the two-point line, segment by segment.

    The two-point line (:func:`autopart.core.batch_lines.through_two_batches`) holds a node's
    time linear in the batch.
    Kernels choose their algorithm by shape, so a model's time need not be: the fidelity CNN
    (ResNet-like, 64 x 64, 1 CPU thread, torch 2.13.0+cpu) ran forward and backward in 42.6,
    77.9 and 161.4 ms at 2, 4 and 8 rows, and the line through 2 and 8 rows says 82.2 ms at
    4 (+5.6 %), which made its plans at 8 microbatches look slower than at 4.

    Attributes:
        batch_size: the microbatch these factors are for, rows.
        positions: the segments' cut positions (op-node positions, ascending).
        fwd: per segment (``len(positions) + 1``), measured forward time over the line's, > 0.
        bwd: per segment, measured backward time over the line's (1.0 where the segment has
            no backward), > 0.
    """

    batch_size: int
    positions: tuple[int, ...]
    fwd: tuple[float, ...]
    bwd: tuple[float, ...]

    def __post_init__(self) -> None:
        segments = len(self.positions) + 1
        if self.batch_size < 1 or list(self.positions) != sorted(set(self.positions)):
            raise PlanError(f"BatchScale: batch_size must be >= 1 and positions ascending, got "
                            f"{self.batch_size} and {list(self.positions)[:8]}; re-profile")
        if (len(self.fwd) != segments or len(self.bwd) != segments
                or not all(f > 0 for f in (*self.fwd, *self.bwd))):
            raise PlanError(f"BatchScale at {self.batch_size} rows: need one forward and one "
                            f"backward factor > 0 per segment ({segments}), got "
                            f"{len(self.fwd)} and {len(self.bwd)}; re-profile the model")

    def factors(self, num_nodes: int) -> list[tuple[float, float]]:
        """Per node of a graph of ``num_nodes`` nodes, its segment's ``(fwd, bwd)`` factor."""
        bounds = [0, *self.positions, num_nodes]
        out: list[tuple[float, float]] = []
        for k in range(len(bounds) - 1):
            out.extend([(self.fwd[k], self.bwd[k])] * (bounds[k + 1] - bounds[k]))
        return out


@dataclass(frozen=True, slots=True, weakref_slot=True)
class CostGraph:
    """Nodes of a captured graph in topological order, with their costs.

    Attributes:
        nodes: op nodes in topological order (placeholders and parameters excluded).
        graph_inputs: name -> bytes of each (flattened) graph input, in call order.
        graph_outputs: names of the nodes or graph inputs the graph returns (flattened);
            every one of them must reach the last stage.
        param_sizes: FQN -> bytes of every parameter and buffer the graph reads.
        param_numel: FQN -> number of elements, same keys as ``param_sizes``.
        trainable: FQNs in ``param_sizes`` that are trainable parameters (the rest are buffers).
        source: where the numbers came from, ``"measured:<device>"`` or ``"analytical:<spec>"``.
        bwd_source: ``"measured"`` or ``"estimated:<rule>"`` for the backward columns.
        batch_size: leading dimension of the inputs that were profiled.
        fingerprint: hash of the graph's structure (see ``autopart.core.capture.graph_fingerprint``).
        profile_wall_s: seconds the profiling took.
        low_batch_size: a second, smaller profiled batch (0: none). With it, each node's
            time at a batch ``b`` between the two is interpolated between its two measured
            times instead of scaled from one (see ``autopart.solver._cost_model.CostModel``).
        low_times: per node, in ``nodes`` order, ``(fwd_us, bwd_input_us, bwd_weight_us)``
            measured at ``low_batch_size`` (empty when ``low_batch_size`` is 0).
        low_backward_peaks: per node, ``backward_peak_bytes`` measured at
            ``low_batch_size`` (empty when not measured).
        loss_saved_bytes: of the last node's ``saved_bytes``, what the loss added to it
            (``autopart.profiler.loss_cost.with_loss_cost``): what the loss keeps from its forward to
            its backward, outside any recomputed stage. Optional (default 0).
        batch_scales: with a second profiled batch, microbatches measured as well, segment
            by segment: at such a microbatch each node's time on the line is multiplied by
            its segment's factor (:class:`BatchScale`,
            :func:`autopart.core.batch_lines.segment_scales`). Optional
            (default none: the line everywhere).
        no_cut: positions (``1 .. len(nodes) - 1``; ``k`` cuts before ``nodes[k]``) that no
            plan may cut, beside those a non-tensor crossing rules out: inside a
            tensor-parallel column/row pair, whose sharded activations exist only between
            its collectives. Optional (default none).
        collective_outputs: ``(node index, bytes)`` of the values tensor parallelism's
            forward collectives return after a node (all-reduce, reduce-scatter, the
            all-gather of a vocab-parallel head's logits; set by
            ``solver.tensor_parallel_costs.shard_costs``), which a stage recomputing under
            the ``"selective"`` or ``"op"`` policy keeps (``Plan.recompute_policy``).
            Optional (default none).
        recomputed_gathers: ``(node index, µs at batch_size, µs at low_batch_size)`` of
            sequence parallelism's all-gathers of token-split values that a node's forward
            waits for (part of its ``fwd_us``; set by ``shard_costs``). A stage recomputing
            under ``"selective"`` or ``"op"`` does not keep what they return: it gathers
            again in its backward, whether or not it keeps the node's own output (as
            Megatron-LM's sequence-parallel linear keeps its input split and re-gathers it,
            Korthikanti et al. 2022, section 4.2.2). The low-batch time is 0 without a low
            batch. Optional (default none).
        causal_attention: names of the attention nodes run with ``is_causal`` and no mask,
            whose kernel skips the blocks above the diagonal (their FLOPs count the pairs
            kept; ``autopart.core._capture_rewrites.attention_masks_as_flags``). Any other
            attention computes every block (a materialised mask). Context parallelism's
            price reads it (``solver.context_parallel_costs``). Optional (default none, as
            in profiles from before it: their attention ran with masks).
        expert_tokens: ``(experts module path, tokens routed to each of its experts)`` per
            MoE layer, counted on the profiled batch (token-expert pairs: ``batch x seq x
            top-k`` in all) where the profile ran real values; expert parallelism's price
            reads the load of the most loaded ep rank from it
            (``solver.expert_parallel_costs``). Optional (default none: analytical profiles
            and those from before it, priced as balanced routing).
        expert_exchanges: ``(node index, forward µs, backward µs, forward µs, backward µs)``
            of expert parallelism's all-to-alls folded into that node's ``fwd_us`` and
            ``bwd_input_us`` (first pair at ``batch_size``, second at ``low_batch_size``,
            0 without a low batch), where a DualPipe-V pair may hide them under its other
            action's compute (``solver.expert_parallel_costs.expert_costs``). Optional
            (default none: a profile, or a layout whose runtime does not overlap them).
    """

    nodes: tuple[NodeCost, ...]
    graph_inputs: dict[str, int]
    graph_outputs: tuple[str, ...]
    param_sizes: dict[str, int]
    param_numel: dict[str, int]
    trainable: frozenset[str]
    source: str
    bwd_source: str
    batch_size: int
    fingerprint: str
    profile_wall_s: float = 0.0
    schema_version: int = field(default=COSTGRAPH_SCHEMA_VERSION)
    low_batch_size: int = 0
    low_times: tuple[tuple[float, float, float], ...] = ()
    low_backward_peaks: tuple[int, ...] = ()
    loss_saved_bytes: int = 0
    batch_scales: tuple[BatchScale, ...] = ()
    no_cut: frozenset[int] = frozenset()
    collective_outputs: tuple[tuple[int, int], ...] = ()
    recomputed_gathers: tuple[tuple[int, float, float], ...] = ()
    causal_attention: frozenset[str] = frozenset()
    expert_tokens: tuple[tuple[str, tuple[int, ...]], ...] = ()
    expert_exchanges: tuple[tuple[int, float, float, float, float], ...] = ()

    def __post_init__(self) -> None:
        seen: set[str] = set(self.graph_inputs)
        for node in self.nodes:
            if node.name in seen:
                raise PlanError(f"CostGraph: node name {node.name!r} appears twice")
            for inp in node.inputs:
                if inp not in seen:
                    raise PlanError(
                        f"CostGraph: node {node.name!r} reads {inp!r}, which is neither a graph "
                        "input nor an earlier node; nodes must be in topological order")
            for p in node.params:
                if p not in self.param_sizes:
                    raise PlanError(f"CostGraph: node {node.name!r} reads unknown parameter {p!r}")
            seen.add(node.name)
        if not self.causal_attention <= seen:
            raise PlanError(f"CostGraph: causal_attention names "
                            f"{sorted(self.causal_attention - seen)[:5]}, which are not nodes; "
                            "re-profile the model")
        for out in self.graph_outputs:
            if out not in seen:
                raise PlanError(f"CostGraph: graph output {out!r} is not a node or graph input")
        if set(self.param_numel) != set(self.param_sizes):
            differ = sorted(set(self.param_numel) ^ set(self.param_sizes))
            raise PlanError(f"CostGraph: param_numel and param_sizes must have the same keys; "
                            f"{differ[:5]} are in only one; re-profile the model")
        if not self.trainable <= set(self.param_sizes):
            extra = sorted(set(self.trainable) - set(self.param_sizes))
            raise PlanError(f"CostGraph: trainable names {extra[:5]}, missing from param_sizes; "
                            "re-profile the model")
        if self.batch_size < 1:
            raise PlanError(f"CostGraph: batch_size must be >= 1, got {self.batch_size}")
        if self.low_batch_size or self.low_times:
            if not 1 <= self.low_batch_size < self.batch_size:
                raise PlanError(f"CostGraph: low_batch_size must be in [1, batch_size = "
                                f"{self.batch_size}), got {self.low_batch_size}")
            if len(self.low_times) != len(self.nodes) or any(
                    len(t) != 3 or min(t) < 0 for t in self.low_times):
                raise PlanError(f"CostGraph: low_times needs one (fwd, bwd_input, bwd_weight) "
                                f"triple of times >= 0 per node ({len(self.nodes)}), got "
                                f"{len(self.low_times)}; re-profile the model")
        if any(not 1 <= k < len(self.nodes) for k in self.no_cut):
            raise PlanError(f"CostGraph: no_cut positions {sorted(self.no_cut)[:5]} must lie in "
                            f"1 .. {len(self.nodes) - 1} (between two nodes)")
        if not 0 <= self.loss_saved_bytes <= (self.nodes[-1].saved_bytes if self.nodes else 0):
            raise PlanError(f"CostGraph: loss_saved_bytes={self.loss_saved_bytes} must be >= 0 and "
                            "at most the last node's saved_bytes, which include it; re-profile "
                            "the model")
        if self.low_backward_peaks and (
                len(self.low_backward_peaks) != len(self.low_times)
                or min(self.low_backward_peaks) < 0):
            raise PlanError(f"CostGraph: low_backward_peaks needs one byte count >= 0 per node "
                            f"({len(self.nodes)}) at low_batch_size, got "
                            f"{len(self.low_backward_peaks)}; re-profile the model")
        if len({n.host_times is None for n in self.nodes}) > 1:
            raise PlanError(f"CostGraph: host issue times on some nodes but not on "
                            f"{[n.name for n in self.nodes if n.host_times is None][:4]}; a "
                            "profile has them on every node (CUDA) or on none: re-profile")
        if self.batch_scales:
            rows = [sc.batch_size for sc in self.batch_scales]
            if not self.low_batch_size or len(set(rows)) != len(rows) or any(
                    sc.positions and sc.positions[-1] >= len(self.nodes)
                    for sc in self.batch_scales):
                raise PlanError(f"CostGraph: batch_scales at {rows} rows need a second profiled "
                                "batch (low_batch_size), one scale per batch and positions "
                                f"inside the graph's {len(self.nodes)} nodes; re-profile the model")

    @property
    def has_host_times(self) -> bool:
        """Whether the nodes carry the host's issue times (:attr:`NodeCost.host_times`)."""
        return bool(self.nodes) and self.nodes[0].host_times is not None

    def scale_at(self, rows: float) -> BatchScale | None:
        """The :class:`BatchScale` measured at a microbatch of ``rows`` rows, if any."""
        return next((sc for sc in self.batch_scales if abs(sc.batch_size - rows) < 1e-6), None)

    def with_low_batch(self, low: CostGraph) -> CostGraph:
        """This graph with ``low``'s node times as its second profiled batch.

        Args:
            low: the same model profiled at a smaller batch.

        Raises:
            PlanError: ``low``'s batch is not smaller, or its graph differs (node count,
                names or ops): the model's graph depends on the batch size.
        """
        if not low.batch_size < self.batch_size:
            raise PlanError(f"the second profile's batch ({low.batch_size}) must be smaller "
                            f"than the first's ({self.batch_size})")
        same = len(low.nodes) == len(self.nodes) and all(
            a.name == b.name and a.op == b.op for a, b in zip(self.nodes, low.nodes, strict=True))
        if not same:
            raise PlanError(f"the graph captured at batch {low.batch_size} differs from the one "
                            f"at batch {self.batch_size}; its times cannot be paired node by "
                            "node")
        times = tuple((n.fwd_us, n.bwd_input_us, n.bwd_weight_us) for n in low.nodes)
        peaks = tuple(n.backward_peak_bytes for n in low.nodes)
        return dataclasses.replace(self, low_batch_size=low.batch_size, low_times=times,
                                   low_backward_peaks=peaks if any(peaks) else ())

    # ---- derived views -------------------------------------------------------------
    def total_fwd_us(self) -> float:
        """Sum of every node's forward time, µs."""
        return sum(n.fwd_us for n in self.nodes)

    def total_bwd_us(self) -> float:
        """Sum of every node's backward time, µs."""
        return sum(n.bwd_us for n in self.nodes)

    def total_host_us(self) -> float:
        """Sum of every node's host issue times (forward and backward), µs (0: none)."""
        return sum(sum(n.host_times or ()) for n in self.nodes)

    # ---- JSON ----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form (lists for tuples, sorted list for the trainable set; host times
        that were not measured are left out)."""
        d = asdict(self)
        d["trainable"] = sorted(self.trainable)
        if self.no_cut:
            d["no_cut"] = sorted(self.no_cut)
        else:  # none: left out, as in files from before it
            del d["no_cut"]
        if not self.collective_outputs:
            del d["collective_outputs"]
        if not self.recomputed_gathers:
            del d["recomputed_gathers"]
        if self.causal_attention:
            d["causal_attention"] = sorted(self.causal_attention)
        else:  # none: left out, as in files from before it
            del d["causal_attention"]
        if not self.expert_tokens:  # none: left out, as in files from before it
            del d["expert_tokens"]
        if not self.expert_exchanges:
            del d["expert_exchanges"]
        for node in d["nodes"]:  # not measured: left out, as in files from before them
            for key in [k for k in HOST_FIELDS if node[k] is None]:
                del node[key]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CostGraph:
        """Build and validate from :meth:`to_dict` output.

        Raises:
            PlanError: a field is missing or has the wrong type, or the schema version differs.
        """
        try:
            if d.get("schema_version") != COSTGRAPH_SCHEMA_VERSION:
                raise PlanError(
                    f"CostGraph schema_version {d.get('schema_version')!r} is not supported "
                    f"(this autopart reads {COSTGRAPH_SCHEMA_VERSION}); profile the model again")
            nodes = tuple(
                NodeCost(**{**n, "inputs": tuple(n["inputs"]), "params": tuple(n["params"]),
                            "saved_from": None if n.get("saved_from") is None else tuple(
                                (int(dist), int(nbytes)) for dist, nbytes in n["saved_from"])})
                for n in d["nodes"])
            return cls(nodes=nodes, graph_inputs=dict(d["graph_inputs"]),
                       graph_outputs=tuple(d["graph_outputs"]), param_sizes=dict(d["param_sizes"]),
                       param_numel=dict(d["param_numel"]),
                       trainable=frozenset(d["trainable"]), source=d["source"],
                       bwd_source=d["bwd_source"], batch_size=int(d["batch_size"]),
                       fingerprint=d["fingerprint"], profile_wall_s=float(d["profile_wall_s"]),
                       low_batch_size=int(d.get("low_batch_size", 0)),
                       low_times=tuple((float(a), float(b), float(c))
                                       for a, b, c in d.get("low_times", ())),
                       low_backward_peaks=tuple(int(x) for x in d.get("low_backward_peaks", ())),
                       loss_saved_bytes=int(d.get("loss_saved_bytes", 0)),
                       no_cut=frozenset(int(k) for k in d.get("no_cut", ())),
                       collective_outputs=tuple((int(i), int(b)) for i, b in
                                                d.get("collective_outputs", ())),
                       recomputed_gathers=tuple((int(i), float(t), float(lo)) for i, t, lo in
                                                d.get("recomputed_gathers", ())),
                       causal_attention=frozenset(str(n) for n in
                                                  d.get("causal_attention", ())),
                       expert_tokens=tuple((str(path), tuple(int(c) for c in counts))
                                           for path, counts in d.get("expert_tokens", ())),
                       expert_exchanges=tuple(
                           (int(i), float(a), float(b), float(c), float(e))
                           for i, a, b, c, e in d.get("expert_exchanges", ())),
                       batch_scales=tuple(
                           BatchScale(int(sc["batch_size"]), tuple(int(q) for q in sc["positions"]),
                                      tuple(float(f) for f in sc["fwd"]),
                                      tuple(float(f) for f in sc["bwd"]))
                           for sc in d.get("batch_scales", ())))
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanError(f"not a valid CostGraph: {exc}") from exc

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write as JSON, atomically."""
        write_text_atomic(path, dumps(self.to_dict()))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> CostGraph:
        """Read and validate a CostGraph JSON file.

        Raises:
            PlanError: the file is not valid JSON or not a CostGraph.
        """
        try:
            data = json.loads(open(path, encoding="utf-8").read())
        except json.JSONDecodeError as exc:
            raise PlanError(f"{path}: not JSON ({exc}); pass a file written by autopart") from exc
        return cls.from_dict(data)
