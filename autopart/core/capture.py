"""Capture: torch.export (non-strict) to a flat fx.GraphModule that keeps each node's module path.

The graph's contract and helpers live in :mod:`autopart.core.capturedgraph` (re-exported
here), the rewrites after export in ``_capture_rewrites``, failures and custom
``autograd.Function`` checks in ``_capture_errors``.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
import torch.utils._pytree as pytree
from torch import nn

from autopart.core._capture_errors import check_custom_backward, custom_functions_applied, trace_error
from autopart.core._capture_rewrites import (
    attention_masks_as_flags,
    detach_grad_disabled_regions,
    differentiable_copies,
    drop_custom_meta,
    tolerate_real_strides,
    update_buffers_where_read,
)
from autopart.core._sink_attention import sink_attention_as_sdpa
from autopart.core.capturedgraph import (
    CapturedGraph,
    _get_attr,
    graph_fingerprint,
    node_module_path,
    node_source,
    op_nodes,
)
from autopart.core.errors import TraceError

__all__ = ["CapturedGraph", "capture", "graph_fingerprint", "op_nodes", "node_module_path",
           "node_source", "on_meta"]


def on_meta(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is on the ``meta`` device (such a model
    is captured on meta tensors and can be profiled only analytically)."""
    return any(t.is_meta for t in [*model.parameters(), *model.buffers()])


def _leading_dim(leaves: list[Any]) -> int:
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    raise TraceError("no tensor input with a batch dimension; pass at least one tensor whose "
                     "dim 0 is the batch")


def capture(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None,
            *, attention_flags: bool = True) -> CapturedGraph:
    """Capture ``model(*args, **kwargs)`` as a flat FX graph with ``torch.export`` (non-strict).

    The graph is functionalised (``run_decompositions({})``: in-place ops become
    out-of-place, nothing is decomposed). Shapes are specialised to the example inputs;
    a dimension of size 1 may capture differently from larger sizes. The model keeps its
    train/eval mode; dropout and batch-norm behave as in that mode.

    Args:
        model: the module to capture; its parameters are shared, not copied.
        args: positional example inputs; tensors have the batch in dim 0.
        kwargs: keyword example inputs.
        attention_flags: give ``scaled_dot_product_attention`` ``is_causal=True`` (or no
            mask) where the mask export built from the shapes alone is causal (or keeps
            every key), as eager transformers does (default True;
            ``_capture_rewrites.attention_masks_as_flags``). False keeps the masks: a
            runtime whose attention computes every block (Megatron-LM's 2021 masked
            softmax) is priced so.

    Returns:
        The captured graph (see :class:`CapturedGraph`).

    Raises:
        TraceError: export failed; the message quotes the model line that failed and the fix.
    """
    kwargs = dict(kwargs or {})
    if not isinstance(args, tuple):
        raise TraceError(f"example_inputs must be a tuple, got {type(args).__name__}; "
                         "wrap a single tensor as (x,)")
    custom: list[type] = []
    try:
        # preserve_node_meta: the annotations custom_functions_applied makes reach the nodes
        with custom_functions_applied(custom), fx_traceback.preserve_node_meta():
            ep = torch.export.export(model, args, kwargs, strict=False)
        detach_grad_disabled_regions(ep.graph_module)
        drop_custom_meta(ep.graph_module)
        # Functionalise (no decompositions): in-place ops such as ``add_`` or ``relu_``
        # become out-of-place, so no stage ever writes into a tensor another stage sent it.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # pytree deprecation inside torch
            ep = ep.run_decompositions({})
    except Exception as exc:  # export raises many unrelated types; all become one clear error
        raise trace_error(exc) from exc
    gm = ep.module()
    # Drop the input-guard module export inserts: microbatches are checked by the runtime.
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and str(node.target).startswith("_guards_fn"):
            gm.graph.erase_node(node)
            if hasattr(gm, str(node.target)):
                delattr(gm, str(node.target))
    tolerate_real_strides(gm.graph)
    differentiable_copies(gm.graph)
    update_buffers_where_read(gm.graph)
    sink_attention_as_sdpa(gm.graph)
    if attention_flags:
        attention_masks_as_flags(gm.graph)
    # Flat calling convention: forward(*leaves) -> tuple(leaves).
    gm.graph._codegen = fx.graph.CodeGen()
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    flat_out = out_node.args[0]
    out_node.args = (tuple(flat_out) if isinstance(flat_out, (list, tuple)) else (flat_out,),)
    gm.graph.lint()
    gm.recompile()

    canon: dict[int, str] = {}
    for name, p in model.named_parameters():
        canon.setdefault(id(p), name)
    for name, b in model.named_buffers():
        canon.setdefault(id(b), name)
    attr_fqns: dict[str, str] = {}
    trainable: set[str] = set()
    buffers: set[str] = set()
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        target = str(node.target)
        value = _get_attr(gm, target)
        fqn = canon.get(id(value), target)
        attr_fqns[target] = fqn
        if isinstance(value, nn.Parameter) and fqn in canon.values():
            if value.requires_grad:
                trainable.add(fqn)
        elif fqn in canon.values():
            buffers.add(fqn)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    if not any(isinstance(v, fx.Node) and isinstance(v.meta.get("val"), torch.Tensor)
               for v in pytree.tree_leaves(output.args[0])):
        raise TraceError(f"{type(model).__name__}.forward returns no tensor (its output is "
                         f"{ep.call_spec.out_spec}); return the model's output (e.g. the logits "
                         "or the loss) from forward")
    leaves = pytree.tree_leaves((args, kwargs))
    if custom:
        check_custom_backward(model, gm, args, kwargs, custom)
    return CapturedGraph(
        graph_module=gm, in_spec=ep.call_spec.in_spec, out_spec=ep.call_spec.out_spec,
        attr_fqns=attr_fqns, trainable=frozenset(trainable), buffers=frozenset(buffers),
        batch_size=_leading_dim(leaves), fingerprint=graph_fingerprint(gm, attr_fqns))
