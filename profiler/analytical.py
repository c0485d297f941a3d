"""profile_analytical: per-node roofline costs for a named GPU, computed on meta tensors only."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.flop_counter import FlopCounterMode

from autopart.core.capture import CapturedGraph, node_module_path, op_nodes
from autopart.core.capturedgraph import buffer_update_cuts
from autopart.core.cluster import DeviceSpec
from autopart.core.costgraph import CostGraph, NodeCost
from autopart.core.errors import PlanError, ProfileError
from autopart.core.op_names import VIEW_OPS
from autopart.profiler._oputil import (
    GROUPED_MM_OPS,
    attention_work,
    causal_attention,
    flop_formulas,
    weight_source,
)
from autopart.profiler.meters import strided_nbytes

__all__ = ["profile_analytical", "ANALYTICAL_REVISION", "MATMUL_EFFICIENCY", "MEMORY_EFFICIENCY",
           "SDPA_BWD_FLOP_RATIO", "MATMUL_OPS", "VIEW_OPS"]

MATMUL_EFFICIENCY = 0.7
"""Share of the datasheet's dense peak a large GEMM reaches (cuBLAS on A100/H100 reaches
60-80 % in NVIDIA's published GEMM benchmarks; Megatron-LM reports ~50 % model FLOPs
utilisation end to end)."""

MEMORY_EFFICIENCY = 0.8
"""Share of the datasheet's memory bandwidth a streaming kernel reaches (STREAM-like
copies reach 80-90 % of HBM peak)."""

ANALYTICAL_REVISION = 3
"""What the analytical model counts, numbered: a cached analytical profile's key carries it,
so a profile cached before a change to the counting is not reused (2: attention on the
``cpu`` preset saves what torch's CPU kernel saves; 3: attention run with ``is_causal``
counts the pairs it keeps, ``_oputil.causal_fraction``)."""

SDPA_BWD_FLOP_RATIO = 2.5
"""Attention backward FLOPs / forward FLOPs: 5 matmuls against 2 (FlashAttention-2,
Dao 2023, section 3.1.2)."""

MATMUL_OPS = frozenset({
    "aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.baddbmm.default",
    "aten.linear.default", "aten.matmul.default", "aten.convolution.default",
    "aten.conv1d.default", "aten.conv2d.default", "aten._convolution.default",
    "aten.einsum.default"})
"""Ops whose backward is two matmuls of the forward's size (one per operand)."""

_SDPA_OPS = frozenset({
    "aten.scaled_dot_product_attention.default",
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default"})



def _to_meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(tuple(x.shape), tuple(x.stride()), dtype=x.dtype,
                                   device="meta")
    return x


def _dtype_name(captured: CapturedGraph, dtype: torch.dtype | None) -> torch.dtype:
    if dtype is not None:
        return dtype
    for target in captured.attr_fqns:
        t = captured.attr_value(target)
        if t.is_floating_point():
            return t.dtype
    return torch.float32


def profile_analytical(captured: CapturedGraph, flat_inputs: list[Any] | None, spec: DeviceSpec,
                       *, dtype: torch.dtype | None = None, training: bool = True,
                       tf32: bool = False) -> CostGraph:
    """Model every op node's cost on a named device from FLOPs and bytes, without running it.

    The graph is interpreted on the ``meta`` device: parameters, buffers and inputs become
    meta tensors of the same shapes, strides and dtypes (nothing is allocated, no real
    weight is read), so models built under ``torch.device("meta")`` profile as well.

    Per node:

    - ``flops``: ``torch.utils.flop_counter.FlopCounterMode`` over the meta forward, with
      the formulas torch lacks (:func:`autopart.profiler._oputil.flop_formulas`: grouped
      GEMMs of mixture-of-experts layers, CPU's fused attention); attention run with
      ``is_causal`` counts the pairs it keeps (``_oputil.causal_fraction``, about half:
      the kernel skips the blocks above the diagonal), which its time then follows.
    - ``bytes_accessed``: nbytes of the tensor inputs (parameters included) plus outputs;
      0 for :data:`VIEW_OPS`. ``output_bytes``: nbytes of the outputs.
    - ``fwd_us`` = max(flops / (peak x :data:`MATMUL_EFFICIENCY`),
      bytes_accessed / (bandwidth x :data:`MEMORY_EFFICIENCY`)) x 1e6 + ``spec.op_overhead_us``;
      0 for :data:`VIEW_OPS`. ``peak`` is ``spec.peak_flops_for(dtype, tf32=tf32)``.
    - Backward (when ``training`` and an output needs a gradient), rule:
      :data:`MATMUL_OPS` and grouped GEMMs: the gradient w.r.t. each operand is one matmul
      of the forward's size, so ``bwd_input`` gets the forward's FLOPs when an activation
      input needs a gradient and ``bwd_weight`` gets them again when a trainable parameter
      is read, directly or through a transpose, view or cast (backward = 2 x forward FLOPs
      for a linear layer or an expert). Attention (SDPA):
      :data:`SDPA_BWD_FLOP_RATIO` x forward, all input-gradient. Other ops: memory-bound,
      2 x the forward's bytes (read the output gradient and the saved values, write the
      input gradients), to ``bwd_input``, or to ``bwd_weight`` when they read a trainable
      parameter and no activation needs a gradient (e.g. the token embedding), half each
      when both. Each backward part with work adds ``op_overhead_us``.
    - ``saved_bytes``: what autograd packs during the meta forward (``saved_tensors_hooks``),
      parameters and buffers excluded, each storage counted once across the graph, by the
      first node that saves it. SDPA follows the fused kernels (flash / memory-efficient:
      q, k, v, the output, the mask and a float32 log-sum-exp per query row), not the math
      path meta would trace; except on ``cpu`` with dropout, where the math path runs
      (``_MetaWalker._fused_attention``).
    - ``transient_bytes``: gradients of the outputs plus of the differentiable inputs.

    Args:
        captured: the graph from :func:`autopart.core.capture.capture` (real or meta model).
        flat_inputs: one value per placeholder (only shapes and dtypes are read), or None to
            take them from each placeholder's ``meta["val"]``.
        spec: the device, e.g. ``autopart.core.cluster.PRESETS["h100-sxm"]``.
        dtype: dtype the peak is taken for; default: the first floating parameter's dtype.
            Tensor sizes are always the captured ones.
        training: also model the backward, saved bytes and gradients.
        tf32: float32 matmuls use TF32 tensor cores.

    Returns:
        The CostGraph, ``source=f"analytical:{spec.name}"``, ``bwd_source``
        ``"estimated:roofline(matmul bwd=2x fwd flops, sdpa 2.5x, other 2x fwd bytes)"``
        (``"none"`` when not training).

    Raises:
        ProfileError: wrong number of inputs, a dtype without a peak, or a node that fails
            on meta tensors (the message names it).
    """
    graph = captured.graph_module.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if flat_inputs is None:
        flat_inputs = [n.meta.get("val") for n in placeholders]
    if len(flat_inputs) != len(placeholders):
        raise ProfileError(f"the graph takes {len(placeholders)} flat inputs, got "
                           f"{len(flat_inputs)}; pass captured.flatten_inputs(args, kwargs) or None")
    the_dtype = _dtype_name(captured, dtype)
    try:
        peak = spec.peak_flops_for(str(the_dtype), tf32=tf32)
    except PlanError as exc:
        raise ProfileError(str(exc)) from None
    start = time.perf_counter()
    walker = _MetaWalker(captured, spec, peak, training)
    with torch.device("meta"):
        nodes = walker.run([_to_meta(x) for x in flat_inputs], placeholders)
    out = next(n for n in graph.nodes if n.op == "output")
    outputs: list[str] = []
    fx.node.map_arg(out.args, lambda n: outputs.append(n.name) if n.op != "get_attr" else None)
    bwd_source = ("estimated:roofline(matmul bwd=2x fwd flops split I/W, sdpa 2.5x fwd flops, "
                  "other ops 2x fwd bytes)") if training else "none"
    return CostGraph(
        nodes=tuple(nodes),
        graph_inputs={p.name: _nbytes(v) for p, v in zip(placeholders, flat_inputs, strict=True)},
        graph_outputs=tuple(outputs), param_sizes=walker.param_sizes,
        param_numel=walker.param_numel,
        trainable=captured.trainable & frozenset(walker.param_sizes),
        source=f"analytical:{spec.name}", bwd_source=bwd_source,
        batch_size=captured.batch_size, fingerprint=captured.fingerprint,
        profile_wall_s=time.perf_counter() - start,
        no_cut=buffer_update_cuts(captured.graph_module.graph),
        causal_attention=causal_attention(captured.graph_module.graph))


def _nbytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in pytree.tree_leaves(value)
               if isinstance(t, torch.Tensor))


class _MetaWalker:
    """Interprets the graph on meta tensors with grad enabled, modelling each op node."""

    def __init__(self, captured: CapturedGraph, spec: DeviceSpec, peak: float,
                 training: bool) -> None:
        self.captured = captured
        self.spec = spec
        self.peak = peak
        self.training = training
        self.env: dict[fx.Node, Any] = {}
        self.fqn: dict[fx.Node, str] = {}
        self.param_sizes: dict[str, int] = {}
        self.param_numel: dict[str, int] = {}
        self.param_storages: set[int] = set()
        self.saved: dict[int, Any] = {}  # id(storage) -> storage, kept so ids stay unique
        self.producer: dict[int, int] = {}  # id(storage) -> op index that returned it first
        self._outputs: list[Any] = []
        self._meta_params: dict[str, torch.Tensor] = {}

    def run(self, inputs: list[Any], placeholders: list[fx.Node]) -> list[NodeCost]:
        """Interpret every node; one NodeCost per op node, in topological order."""
        for p, v in zip(placeholders, inputs, strict=True):
            self.env[p] = v
            self._produced(v, -1)  # graph inputs: before every op
        for node in self.captured.graph_module.graph.nodes:
            if node.op == "get_attr":
                self.env[node] = self._get_attr(node)
        costs: list[NodeCost] = []
        seen_params: set[str] = set()
        for node in op_nodes(self.captured.graph_module.graph):
            cost = self._node(node, seen_params, len(costs))
            seen_params.update(cost.params)
            costs.append(cost)
        return costs

    def _get_attr(self, node: fx.Node) -> Any:
        target = str(node.target)
        obj = self.captured.attr_object(target)
        if not isinstance(obj, torch.Tensor):
            return obj
        fqn = self.captured.attr_fqns.get(target, target)
        self.fqn[node] = fqn
        if node.users:
            self.param_sizes[fqn] = obj.numel() * obj.element_size()
            self.param_numel[fqn] = obj.numel()
        if fqn not in self._meta_params:
            meta = _to_meta(obj)
            if fqn in self.captured.trainable and self.training:
                meta.requires_grad_(True)
            self._meta_params[fqn] = meta
            self.param_storages.add(id(meta.untyped_storage()))
        return self._meta_params[fqn]

    def _produced(self, value: Any, index: int) -> None:
        """Record op ``index`` as the producer of ``value``'s storages (a view keeps its
        base's)."""
        for t in pytree.tree_leaves(value):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if id(storage) not in self.producer:
                    self.producer[id(storage)] = index
                    self._outputs.append(storage)  # kept, so the id stays unique

    def _fused_attention(self, target: str, args: Any, kwargs: Any) -> bool:
        """Whether an attention node runs a fused kernel on this device (saving q, k, v, the
        output, the mask and a log-sum-exp), or the math path meta traces (saving the
        ``S x S`` weights, and with dropout its mask): on ``cpu``,
        ``scaled_dot_product_attention`` with ``dropout_p > 0`` is the math path (torch's
        CPU flash kernel takes no dropout; measured with ``saved_tensors_hooks``, torch
        2.13: 27.0 MiB saved at b 2, 4 heads, S 512, head 64, as meta traces, against 4.0
        MiB without dropout). GPUs' flash and memory-efficient kernels take dropout."""
        if self.spec.name != "cpu" or target != "aten.scaled_dot_product_attention.default":
            return True
        dropout = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
        return not (isinstance(dropout, (int, float)) and dropout > 0)

    def _pack(self, counted: list[tuple[int | None, int]]) -> Any:
        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            key = id(storage)
            if key not in self.param_storages and key not in self.saved:
                self.saved[key] = storage
                counted.append((key, storage.nbytes()))
            return t
        return pack

    def _node(self, node: fx.Node, seen_params: set[str], index: int) -> NodeCost:
        target = str(node.target)
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), self.env.__getitem__)
        args, kwargs = fx.node.map_aggregate(
            (args, kwargs), lambda x: torch.device("meta") if isinstance(x, torch.device) else x)
        counted: list[tuple[int | None, int]] = []  # (id(storage) or None, bytes)
        counter = FlopCounterMode(display=False, custom_mapping=flop_formulas())
        fn: Any = node.target
        fused = target in _SDPA_OPS and self._fused_attention(target, args, kwargs)
        try:
            with torch.set_grad_enabled(self.training), counter, \
                    saved_tensors_hooks(self._pack(counted), lambda t: t):
                if fused:
                    with torch.no_grad():
                        out = fn(*args, **kwargs)
                else:
                    out = fn(*args, **kwargs)
        except Exception as exc:  # every op failure becomes one error naming the node
            text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise ProfileError(
                f"node {node.name!r} ({target}, module {node_module_path(node)!r}) failed on "
                f"meta tensors: {type(exc).__name__}: {text}; analytical profiling needs every "
                "op to have a meta kernel") from exc
        in_tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        sources = {n: weight_source(n) for n in node.all_input_nodes}
        grad_inputs = [t for n in node.all_input_nodes if sources[n] is None
                       for t in pytree.tree_leaves(self.env[n])
                       if isinstance(t, torch.Tensor) and t.requires_grad]
        weights = [n for n in node.all_input_nodes  # a parameter, or its transpose/view/cast
                   if sources[n] is not None
                   and self.fqn.get(sources[n]) in self.captured.trainable]
        needs_grad = self.training and (bool(grad_inputs) or bool(weights))
        if fused:  # meta picks the math path; keep the captured kernel's layout
            out = pytree.tree_map(_to_meta, node.meta.get("val", out))
        if fused and needs_grad:
            out = _sdpa_with_grad(out)
            q = args[0]
            lse = q.numel() // q.shape[-1] * 4  # float32 log-sum-exp per query row
            out_leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
            kept = in_tensors
            if self.spec.name == "cpu":  # CPU's flash kernel saves a boolean mask converted
                # to the queries' dtype, a new copy per call (measured as in _fused_attention:
                # 6.0 MiB with a (2, 1, 512, 512) boolean mask, 4.0 MiB without)
                kept = [t for t in in_tensors if t.dtype != torch.bool]
                counted.extend((None, t.numel() * q.element_size()) for t in in_tensors
                               if t.dtype == torch.bool)
            counted.extend(self._claim(t) for t in kept + out_leaves)
            counted.append((None, lse))
        self.env[node] = out
        self._produced(out, index)
        back: dict[int, int] = {}  # saved storages a node returned, by distance to it
        for key, nbytes in counted:
            if key is not None and key in self.producer:
                dist = index - self.producer[key]
                back[dist] = back.get(dist, 0) + nbytes
        flops = int(counter.get_total_flops() * attention_work(node))
        out_bytes = _nbytes(out)
        is_view = target in VIEW_OPS
        nbytes = 0 if is_view else sum(t.numel() * t.element_size() for t in in_tensors) + out_bytes
        fwd_us = 0.0 if is_view else self._time(flops, nbytes)
        bwd_in = bwd_w = 0.0
        if needs_grad and not is_view:
            if target in MATMUL_OPS or target in GROUPED_MM_OPS:
                bwd_in = self._time(flops, nbytes) if grad_inputs else 0.0
                bwd_w = self._time(flops, nbytes) if weights else 0.0
            elif target in _SDPA_OPS:
                bwd_in = self._time(int(flops * SDPA_BWD_FLOP_RATIO), 2 * nbytes)
            else:
                bwd = self._time(0, 2 * nbytes)
                share = 0.5 if grad_inputs and weights else 1.0
                bwd_in = bwd * share if grad_inputs else 0.0
                bwd_w = bwd * share if weights else 0.0
        params = tuple(dict.fromkeys(self.fqn[n] for n in node.all_input_nodes if n in self.fqn))
        transient = (out_bytes + sum(t.numel() * t.element_size() for t in grad_inputs)
                     if needs_grad else 0)
        return NodeCost(
            name=node.name, op=target, module_path=node_module_path(node), fwd_us=fwd_us,
            bwd_input_us=bwd_in, bwd_weight_us=bwd_w, flops=flops, bytes_accessed=nbytes,
            output_bytes=out_bytes,
            saved_bytes=sum(b for _, b in counted) if needs_grad else 0,
            saved_from=(tuple(sorted(back.items())) if needs_grad else ()) if self.training
            else None,
            param_bytes=sum(self.param_sizes[p] for p in params if p not in seen_params),
            inputs=tuple(n.name for n in node.all_input_nodes if n.op != "get_attr"),
            params=params, output_is_tensor=isinstance(out, torch.Tensor),
            transient_bytes=transient,
            strided_output_bytes=strided_nbytes(out))

    def _claim(self, t: torch.Tensor) -> tuple[int | None, int]:
        """Count ``t``'s storage as saved unless a parameter's or already counted:
        ``(id(storage), bytes)``, or ``(None, 0)``."""
        storage = t.untyped_storage()
        key = id(storage)
        if key in self.param_storages or key in self.saved:
            return None, 0
        self.saved[key] = storage
        return key, int(storage.nbytes())

    def _time(self, flops: int, nbytes: int) -> float:
        """Roofline time of one kernel plus the op overhead, µs."""
        compute = flops / (self.peak * MATMUL_EFFICIENCY)
        memory = nbytes / (self.spec.memory_bandwidth_bytes_per_s * MEMORY_EFFICIENCY)
        return max(compute, memory) * 1e6 + self.spec.op_overhead_us


def _sdpa_with_grad(out: Any) -> Any:
    """The attention output marked as needing a gradient (it was computed under no_grad)."""
    def mark(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return t.detach().requires_grad_(True)
        return t
    return pytree.tree_map(mark, out)
