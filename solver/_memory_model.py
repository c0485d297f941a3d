"""Memory of stages per microbatch: parameter state, saved and held activations, working sets."""

from __future__ import annotations

import math
from collections.abc import Iterable

from autopart.core.costgraph import CostGraph, layer_of_path
from autopart.core.errors import PlanError
from autopart.core.recompute_policy import (
    CHECKPOINTED_POLICIES,
    RECOMPUTE_POLICIES,
    SELECTIVE_KEPT_NODE_OPS,
    TP_KEPT_NODE_OPS,
)
from autopart.core.runtime_model import RuntimeDescription
from autopart.solver._graph_tables import MemoryTables, two_point_line
from autopart.solver.candidates import _per_graph, crossing_profile

__all__ = ["MemoryModel", "two_point_line"]


class MemoryModel:
    """The memory half of the cost model (:class:`autopart.solver._cost_model.CostModel`
    extends it with time), in bytes, at microbatch size ``b = batch_size / m``.

    Activation bytes (outputs, saved, crossing, graph inputs) scale as
    ``ceil(bytes * b / b0)``; parameter bytes do not scale.

    Args:
        costs: the cost graph, profiled at ``costs.batch_size``.
        batch_size: the full batch the plan is for.
        training: count optimizer state, saved activations and backward working sets.
        state_factor: optimizer state bytes per trainable parameter byte (AdamW: 2.0); a
            trainable parameter then holds ``(2 + state_factor) x`` its bytes (weight,
            gradient, state); buffers, and every parameter when not training, hold 1x.
        runtime: the runtime's buffers (:meth:`held_parts`).
        layer_unit_factors: ZeRO 1-3 with one FSDP unit per layer: what a stage holds
            gathered beyond ``state_factor``'s state (``SolveOptions.layer_unit_factors``,
            :meth:`state_of`); None: nothing.
        whole_state: ``(params, factor)``: trainable parameters ZeRO leaves whole
            (``SolveOptions.whole_state_params``), holding ``2 + factor`` times their bytes,
            outside every layer unit's gather.
        recompute_policy: ``Plan.recompute_policy`` (default ``"full"``).
        kept_nodes: under ``"op"``, the nodes (names) whose outputs a recomputing stage
            keeps (``StagePlan.recompute_kept`` of every stage); ignored otherwise.
    """

    def __init__(self, costs: CostGraph, *, batch_size: int, training: bool,
                 state_factor: float, runtime: RuntimeDescription,
                 layer_unit_factors: tuple[float, float, float, float] | None = None,
                 recompute_policy: str = "full",
                 whole_state: tuple[frozenset[str], float] = (frozenset(), 0.0),
                 kept_nodes: frozenset[str] = frozenset()) -> None:
        self.costs = costs
        if recompute_policy not in RECOMPUTE_POLICIES:
            raise PlanError(f"recompute_policy={recompute_policy!r} is not one of "
                            f"{RECOMPUTE_POLICIES}")
        self.recompute_policy = recompute_policy
        # per node: whether a recomputing stage keeps its output (Plan.recompute_policy; under
        # "op" the solver's choice, StagePlan.recompute_kept, and tp's reductions)
        self.kept_nodes = kept_nodes if recompute_policy == "op" else frozenset()
        self.kept = [(recompute_policy == "selective" and nd.op in SELECTIVE_KEPT_NODE_OPS)
                     or (recompute_policy in CHECKPOINTED_POLICIES and nd.op in TP_KEPT_NODE_OPS)
                     or nd.name in self.kept_nodes
                     for nd in costs.nodes]
        self._selective: dict[tuple[int, int], int] = {}
        # per node, what tp's forward collectives after it return (kept under "selective"
        # and "op")
        self._collective_out = [0] * len(costs.nodes)
        if recompute_policy in CHECKPOINTED_POLICIES:
            for i, nbytes in costs.collective_outputs:
                self._collective_out[i] += nbytes
        self._layer_units = layer_unit_factors if training else None
        self.runtime = runtime
        self.batch_size = batch_size
        self.training = training
        self.crossing, _ = crossing_profile(costs)
        # what reads the graph alone (and training): made once per graph
        # (:class:`autopart.solver._graph_tables.MemoryTables`), shared by every model of it
        made = _per_graph("memory model tables", costs, lambda _: {})
        tables = made.get(training)
        if tables is None:
            tables = made[training] = MemoryTables(costs, training)
        self._last_use = tables.last_use
        self._producers_known = tables.producers_known
        self._held: dict[tuple[int, int], tuple[int, int, int]] = {}
        self.grad_crossing = tables.grad_crossing
        self._strided_crossing = tables.strided_crossing
        self._saved = tables.saved
        self._first_use = first_use = tables.first_use
        mult = (2.0 + state_factor) if training else 1.0
        whole, whole_mult = whole_state[0], (2.0 + whole_state[1]) if training else 1.0
        self.state_bytes = {
            p: int(math.ceil(nbytes * (whole_mult if p in whole else mult)))
            if p in costs.trainable else nbytes
            for p, nbytes in costs.param_sizes.items()}
        # ZeRO 1-3 layer units: trainable parameter -> its layer (None: the root unit);
        # whole parameters are in no unit
        self._layer_of = {p: layer_of_path(p) for p in costs.trainable if p not in whole}
        if self._layer_units is not None:
            a, b, _, _ = self._layer_units
            for p in self._layer_of:
                if p in self.state_bytes:
                    extra = a + (b if self._layer_of[p] is None else 0.0)
                    self.state_bytes[p] += int(math.ceil(costs.param_sizes[p] * extra))
        self._units_bound = self._gathered_bytes(self._layer_of)  # over the whole model
        self._first_state = [0] * (len(costs.nodes) + 1)  # prefix sums of first-use state bytes
        per_node = [0] * len(costs.nodes)
        for p, i in first_use.items():
            per_node[i] += self.state_bytes[p]
        for i, v in enumerate(per_node):
            self._first_state[i + 1] = self._first_state[i] + v
        self._tables = tables

    # ---- scaling -------------------------------------------------------------------
    def ratio(self, m: int) -> float:
        """``b / b0`` for ``m`` microbatches."""
        return self.batch_size / m / self.costs.batch_size

    @staticmethod
    def scale_bytes(nbytes: int, ratio: float) -> int:
        """Activation bytes at the scaled batch, rounded up."""
        return int(math.ceil(nbytes * ratio - 1e-9))

    def saved_bytes(self, start: int, stop: int) -> int:
        """Saved activations of nodes ``start .. stop - 1`` at the profiled batch, bytes."""
        return self._saved[stop] - self._saved[start]

    def first_use_state_bytes(self, start: int, stop: int) -> int:
        """State of the parameters first read by nodes ``start .. stop - 1``, bytes (a tied
        parameter counts once, where it is first read)."""
        return self._first_state[stop] - self._first_state[start]

    @property
    def held_bytes_cover_outputs(self) -> bool:
        """Whether :meth:`held_parts` counts a stage's outputs (the profile says which saved
        storages the nodes returned)."""
        return self._producers_known

    def held_parts(self, start: int, stop: int) -> tuple[int, int, int]:
        """What a stage of nodes ``start .. stop - 1`` holds for one microbatch from its
        forward to its backward, at the profiled batch, in three parts, bytes: what the
        stage's nodes save (less, with torch's stages, the inputs they save from receive
        buffers); its outputs no node of it saves; the copies of strided values crossing its
        cuts (torch's stages). Without ``saved_from`` (profiles from before it):
        ``(saved bytes, 0, 0)``.

        A runtime keeps each stage's outputs (to start its backward from them, and until the
        send completes), whether or not autograd saved them: the outputs of nodes in the
        stage read at ``stop`` or later that no node of the stage saved are the second part.
        With torch's stages (``receive_buffers_per_microbatch``) the inputs a stage saves
        are its receive buffers, counted in its static bytes: the saved storages that an
        earlier stage returned are taken out (:attr:`NodeCost.saved_from`). The local
        runtime hands a stage's outputs on as they are (or copied to another device, where
        the receiving stage holds the copy): they stay counted where they are saved.

        torch's stages also move dense buffers only: a non-contiguous output
        (:attr:`NodeCost.strided_output_bytes`) is sent as a contiguous copy, held in its
        place (the view's storage is held only where a node saved it), and a stage copies
        such an input back into its captured layout, counted as held until the backward
        (the stage's nodes may save it).
        """
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
            copies = self.runtime.receive_buffers_per_microbatch
            if copies:
                inside -= outside
                strided = self.strided_bytes(start, stop)
            # torch's stages send (and keep) a contiguous copy of a strided output in place
            # of the view: the copy is in ``strided``
            outputs = sum(nodes[i].output_bytes
                          - (nodes[i].strided_output_bytes if copies else 0)
                          for i in range(start, stop)
                          if self._last_use[i] >= stop and i not in saved_here)
        self._held[key] = (inside, outputs, strided)
        return self._held[key]

    def selective_kept_bytes(self, start: int, stop: int) -> int:
        """What a stage of nodes ``start .. stop - 1`` that recomputes under the selective
        policy (``recompute_policy="selective"``, or ``"op"`` with its chosen nodes) keeps from
        its forward to its backward beyond what :meth:`held_parts` counts as its outputs, at
        the profiled batch, bytes:
        the outputs of its kept nodes (matmuls, attention, grouped GEMMs:
        :data:`autopart.core.recompute_policy.SELECTIVE_KEPT_NODE_OPS`), which torch's
        selective checkpointing caches, and with tensor parallelism what its forward
        collectives return (``CostGraph.collective_outputs``), beside the matmul's partial
        output. 0 under ``"full"``.

        The cache hands each kept output back once, in the backward's recomputation, and
        drops it then: from there on the stage holds its saved set, as without recompute
        (the kept outputs in it among them), so its backward adds that saved set less the
        kept bytes (:mod:`autopart.solver._stage_costing`).
        """
        key = (start, stop)
        if key in self._selective:
            return self._selective[key]
        kept = 0
        if self.recompute_policy in CHECKPOINTED_POLICIES:
            kept = sum(nbytes for i, nbytes in self.keep_costs(start, stop).items()
                       if self.kept[i]) + sum(self._collective_out[start:stop])
        self._selective[key] = kept
        return kept

    def keep_costs(self, start: int, stop: int) -> dict[int, int]:
        """Per node ``i`` of a recomputing stage of nodes ``start .. stop - 1``, what keeping
        its output adds to what the stage holds from its forward to its backward, at the
        profiled batch, bytes: its output bytes, or 0 where the stage holds that output
        anyway (one of its outputs, counted by :meth:`held_parts`); plus what the op saves
        of its own (:attr:`NodeCost.saved_from`'s rest): selective checkpointing caches
        every tensor a kept op returns, the ones the graph does not read too (the CPU
        flash attention's logsumexp, a layer norm's statistics), and autograd saves those.

        Measured (2 gloo ranks, GPT-2 6 layers n_embd 384, 2 x 256 tokens per microbatch,
        1F1B m 4, every stage selective): without the attention's logsumexp the first
        rank was predicted 52 KB (0.02 %) under its measured peak."""
        nodes = self.costs.nodes
        saved_here: set[int] = set()
        for j in range(start, stop):
            saved_here.update(j - d for d, _ in nodes[j].saved_from or () if j - d >= start)
        return {i: (0 if self._producers_known and self._last_use[i] >= stop
                    and i not in saved_here else nodes[i].output_bytes) + self._own_saved(i)
                for i in range(start, stop)}

    def _own_saved(self, i: int) -> int:
        """What node ``i`` saves that no node returned (an op's own statistics), bytes at the
        profiled batch; 0 where the profile does not say which node returned a storage."""
        nodes = self.costs.nodes
        nd = nodes[i]
        if nd.saved_from is None:
            return 0
        # the last node's saved bytes include the loss's (CostGraph.loss_saved_bytes), which
        # no checkpoint caches: the loss runs outside the stage's forward
        loss = self.costs.loss_saved_bytes if i == len(nodes) - 1 else 0
        return max(nd.saved_bytes - loss - sum(nbytes for _, nbytes in nd.saved_from), 0)

    def chain_kept_bytes(self, start: int, stop: int) -> int:
        """:meth:`selective_kept_bytes` of nodes ``start .. stop - 1`` for the partition
        solvers' segments: every kept output but the graph's outputs (which the last stage's
        out buffer counts), at the profiled batch, bytes; 0 under ``"full"``."""
        if self.recompute_policy not in CHECKPOINTED_POLICIES:
            return 0
        n = len(self.costs.nodes)
        return sum(self.costs.nodes[i].output_bytes for i in range(start, stop)
                   if self.kept[i] and self._last_use[i] < n) + sum(
            self._collective_out[start:stop])

    def strided_bytes(self, start: int, stop: int) -> int:
        """Non-contiguous values crossing into and out of a stage of nodes ``start .. stop -
        1`` at the profiled batch, bytes: the copies torch's stages make of them (see
        :meth:`held_parts`). 0 unless ``receive_buffers_per_microbatch``."""
        if not self.runtime.receive_buffers_per_microbatch:
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
        (:mod:`autopart.solver._stage_costing`)."""
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

    def layer_units_bound_bytes(self) -> int:
        """The most :meth:`state_of`'s largest-layer terms add to any one stage, bytes:
        ``c x`` the model's largest layer and ``d x`` the larger of it and every parameter
        outside the layers (0 without layer units). The chain problem takes it off each
        stage's cap, so its per-segment sums stay an upper bound on what the plan's stages
        are costed at."""
        return self._units_bound

    def _gathered_bytes(self, params: Iterable[str]) -> int:
        """``c x L + d x max(R, L)`` of the layer units' factors over ``params`` (R: the
        trainable ones outside every layer, L: the largest layer's), bytes; 0 without layer
        units."""
        if self._layer_units is None:
            return 0
        layers: dict[str | None, int] = {}
        for p in params:
            if p in self._layer_of:
                key = self._layer_of[p]
                layers[key] = layers.get(key, 0) + self.costs.param_sizes.get(p, 0)
        root = layers.pop(None, 0)
        largest = max(layers.values(), default=0)
        _, _, c, d = self._layer_units
        return int(math.ceil(c * largest + d * max(root, largest)))

    def state_of(self, start: int, stop: int) -> tuple[int, int, int]:
        """(state bytes, parameter bytes, trainable elements) of every parameter read by
        nodes ``start .. stop - 1`` (a tied parameter counts on every stage reading it).

        A later stage's replica of a tied parameter (first read before ``start``) holds its
        full state where the runtime's ranks are processes (each rank's optimizer steps its
        own copy); in the one-process runtime the optimizer steps the owner alone and the
        replica holds its weight and gradient (``codegen/params.build_stage_modules``,
        ``pipe.parameters()``). Measured on this project's CPU (torch 2.13): a 4 x 256 GPT-2
        with vocabulary 8192 in 2 local stages had the tied ``wte`` on both, 7.39 M
        elements in the stages against the model's 5.29 M, AdamW stepping 5.29 M.

        With layer units (ZeRO 1-3, ``layer_unit_factors`` ``(a, b, c, d)``), the state adds
        ``a x`` the stage's trainable parameter bytes and ``b x`` those outside every layer
        (``R``; :func:`autopart.core.costgraph.layer_of_path` of the parameter's FQN), both
        in ``state_bytes`` (so per-segment sums and totals see them), and here ``c x`` its
        largest layer's trainable bytes (``L``) and ``d x max(R, L)``, which are not sums
        over segments: the chain problem charges each stage their bound instead
        (:meth:`layer_units_bound_bytes`)."""
        params = sorted({p for nd in self.costs.nodes[start:stop] for p in nd.params})
        local_replica = self.training and not self.runtime.ranks_are_processes
        state = sum(2 * self.costs.param_sizes[p]
                    if local_replica and p in self.costs.trainable
                    and self._first_use[p] < start else self.state_bytes[p] for p in params)
        state += self._gathered_bytes(params)
        return (state,
                sum(self.costs.param_sizes[p] for p in params),
                sum(self.costs.param_numel[p] for p in params if p in self.costs.trainable))

    def transient_bytes(self, start: int, stop: int, ratio: float) -> int:
        """Largest single-node working set of nodes ``start .. stop - 1``, bytes: its output
        or, when training, its backward's:

        - where the profile measured it at two batches (``NodeCost.backward_peak_bytes``,
          ``CostGraph.low_backward_peaks``), the line through both at ``b`` plus its
          outputs' gradients, or its gradients (``NodeCost.transient_bytes``, scaled; the
          loss's working set, folded into the last node, is there) if more. The new weight
          gradients and what the kernel allocates beside them (a kernel may write a weight's
          gradient twice) are in the measured figure;
        - otherwise its gradients (scaled) plus the new gradients of the trainable
          parameters it reads (not scaled: they live beside ``.grad`` until added to it).
        """
        needs, most = self._tables.needs(ratio)
        if start == 0 and stop >= len(needs):
            return most
        return max(needs[start:stop], default=0)

    def backward_working_bytes(self, start: int, stop: int, ratio: float, held_out: int) -> int:
        """Most one backward of nodes ``start .. stop - 1`` (one autograd call over a stage
        that keeps its saved set, whose gradients go to ``.grad`` as it runs) holds above
        what the stage held when it began, bytes.

        Autograd frees each node's saved tensors once that node's backward has run, so the
        working set of a node (:meth:`transient_bytes`) is met with the saved bytes of the
        nodes after it in the stage gone (nodes last to first): their saved storages made
        in the stage (those an earlier stage returned sit in receive buffers), scaled, less
        those returned by a node whose output leaves the stage (the runtime keeps the stage's
        outputs until the step ends); with a profile that does not say which node returned
        a saved storage (:attr:`NodeCost.saved_from` None), less ``held_out`` bytes instead.
        Its largest such figure, at least 0; at most :meth:`transient_bytes` of the stage,
        which leaves nothing freed.

        Measured (distributed runtime, 2 gloo ranks, Llama 4 layers hidden 256, 2 x 1024
        tokens per microbatch): the first stage's backward peaked 1.3 MiB above its start
        and the new gradients, where the largest node working set is 12.0 MiB.
        """
        nodes, known, last_use = self.costs.nodes, self._producers_known, self._last_use
        needs, _ = self._tables.needs(ratio)  # each node's transient_bytes
        held = 0 if known else held_out
        freed = out = 0
        ceil = math.ceil
        for i in range(stop - 1, start - 1, -1):
            out = max(out, needs[i] - max(freed - held, 0))
            nd = nodes[i]
            if not nd.saved_bytes:
                continue
            # storages from before the stage, or returned by a node whose output the stage
            # sends on, stay held
            stays = sum(nbytes for dist, nbytes in nd.saved_from or ()
                        if i - dist < start or last_use[i - dist] >= stop)
            if nd.saved_bytes > stays:  # scale_bytes, inline
                freed += int(ceil((nd.saved_bytes - stays) * ratio - 1e-9))
        return out

    def last_saving_node(self, start: int, stop: int) -> int | None:
        """Index of the last node of ``start .. stop - 1`` that saves anything for the
        backward (``NodeCost.saved_bytes`` > 0), or None: where a checkpointed recomputation
        of those nodes is triggered and where it stops."""
        nodes = self.costs.nodes
        return next((i for i in range(stop - 1, start - 1, -1) if nodes[i].saved_bytes), None)

    def recomputation_bytes(self, start: int, stop: int, ratio: float) -> int:
        """Most a recomputation of nodes ``start .. stop - 1`` holds beside the saved set it
        rebuilds, bytes: torch's checkpoint recomputes at the first unpack, inside the
        backward of the last node that saved anything, so that node's outputs' gradient
        (as large as its outputs) is live while the forward runs again, beside the output
        of the node being run: the largest before that node, which torch does not run
        again (``early_stop``: the recomputation stops once the last saved tensor is
        packed, at the inputs of that node), scaled.

        Measured on 2 gloo ranks (Llama, 4 layers, hidden 256, 4 x 1024 tokens, 1F1B m 4,
        the first stage recomputing under ``"op"``): its peak fell inside the
        recomputation (a rotary embedding's ``neg``), 0.6 MiB above the backward's own
        walk."""
        nodes = self.costs.nodes
        first = self.last_saving_node(start, stop)
        if first is None:
            return 0
        return self.scale_bytes(nodes[first].output_bytes, ratio) + max(
            (self.scale_bytes(nd.output_bytes, ratio) for nd in nodes[start:first]), default=0)

    def whole_backward_bytes(self, start: int, stop: int, ratio: float) -> int:
        """Most a backward of nodes ``start .. stop - 1`` run as one autograd call that returns
        every trainable parameter's gradient holds above what it started from, bytes.

        The call keeps each gradient until it returns, while each node's backward frees what
        that node saved: at each node (last to first), its working set
        (:meth:`transient_bytes`) plus what the gradients of the parameters read only after
        it (their backward ran first) exceed the saved bytes of the nodes after it, scaled."""
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
