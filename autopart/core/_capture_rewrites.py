"""Rewrites of the exported graph so that it runs, splits and trains as the eager model does.

Each fixes one way a functionalised ``torch.export`` graph differs from running the model:
views bound to the capture's strides, ``torch.no_grad()`` regions, ``aten.copy`` without a
derivative, buffer updates moved to the graph's end, and attention masks built where eager
attention passes ``is_causal`` instead. :func:`autopart.core.capture.capture`
applies them in that order.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from autopart.core._capture_errors import IN_CUSTOM_FUNCTION
from autopart.core.capturedgraph import METADATA_CHECKS, SDPA_ARGS, _get_attr, sdpa_arguments

__all__ = ["tolerate_real_strides", "detach_grad_disabled_regions", "drop_custom_meta",
           "differentiable_copies", "update_buffers_where_read", "attention_masks_as_flags",
           "MASK_CHECK_BUDGET_BYTES"]


# Ops that fail unless their input's strides are what the fake tensors of the capture had.
_STRIDE_BOUND_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)


def tolerate_real_strides(graph: fx.Graph) -> None:
    """Turn the graph's ``view`` nodes into ``reshape``: same values, any input layout.

    torch.export records a ``view`` where the *fake* input was contiguous, and drops a
    model's ``.contiguous()`` when the fake tensor already was. Real kernels do not always
    lay out their outputs as the fake ones say: CPU ``scaled_dot_product_attention`` takes
    the fused path (output ``(B, T, H, D)``-major) when no input needs a gradient and the
    math path (contiguous ``(B, H, T, D)``) when the mask does, so T5's relative-position
    attention, transposed back and viewed, fails in training with "view size is not
    compatible with input tensor's size and stride". ``reshape`` is a view where one exists
    (no copy) and a copy otherwise, which is what the model's own ``.contiguous().view()``
    did. The graph is functional (no in-place op writes through a view), so a copy where
    the capture had a view changes no value.
    """
    for node in graph.nodes:
        if node.op == "call_function" and node.target in _STRIDE_BOUND_VIEWS:
            node.target = torch.ops.aten.reshape.default


_SET_GRAD = getattr(torch.ops.higher_order, "wrap_with_set_grad_enabled", None)
# Ops that return their input itself (not a new tensor) when nothing is to change.
_MAYBE_SELF = (torch.ops.aten.to.dtype, torch.ops.aten.to.device, torch.ops.aten.to.dtype_layout,
               torch.ops.aten.to.other, torch.ops.aten.type_as.default,
               torch.ops.aten.contiguous.default)


def _same_layout(a: Any, b: Any) -> bool:
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and \
        a.dtype == b.dtype and a.device == b.device and a.shape == b.shape and \
        a.stride() == b.stride()


def _region_input(value: fx.Node) -> bool:
    """Whether ``value`` is one of its region's inputs: the input itself, or a no-op
    ``.to()`` / ``.type_as()`` / ``.contiguous()`` of it, which eagerly returns the same
    tensor (with its gradient). torch.export rebinds such a tensor to the region's output,
    so later uses outside the region read it from there (DeepSeek-style indexers cast
    ``hidden_states.to(weight.dtype)`` under ``torch.no_grad()``)."""
    while value.op == "call_function" and value.target in _MAYBE_SELF and \
            isinstance(value.args[0], fx.Node) and not value.kwargs.get("copy", False) and \
            _same_layout(value.meta.get("val"), value.args[0].meta.get("val")):
        value = value.args[0]
    return value.op == "placeholder"


def detach_grad_disabled_regions(root: fx.GraphModule) -> int:
    """Make what a ``torch.no_grad()`` region computes non-differentiable, as it is eagerly.

    torch.export keeps a region run with gradients off as a ``wrap_with_set_grad_enabled
    (False, submodule, ...)`` call; functionalising (``run_decompositions``) inlines the
    submodule and drops the grad mode, so the captured graph would differentiate through
    the region: HRM's "only the last inner cycles propagate gradients" trick then trained
    every cycle, with other gradients. Each tensor the region returns is wrapped
    in ``aten.detach`` inside the submodule, which inlining keeps; a tensor the region
    only passes through (one of its own inputs, or a no-op cast of one: see
    :func:`_region_input`) keeps its gradient, as eagerly.

    Returns:
        The number of outputs detached (0 where the model has no such region).
    """
    if _SET_GRAD is None:
        return 0
    count = 0
    for gm in list(root.modules()):
        if not isinstance(gm, fx.GraphModule):
            continue
        for node in gm.graph.nodes:
            if node.op != "call_function" or node.target is not _SET_GRAD or node.args[0]:
                continue
            sub = node.args[1]
            body = _get_attr(gm, str(sub.target)) if isinstance(sub, fx.Node) else sub
            if not isinstance(body, fx.GraphModule):
                continue
            if any(IN_CUSTOM_FUNCTION in (n.meta.get("custom") or {}) for n in body.graph.nodes):
                # a custom autograd.Function's forward (Reformer's reversible layers): its
                # output carries a gradient eagerly, through the Function's own backward;
                # the graph differentiates the forward instead, and check_custom_backward
                # refuses it where that gives other gradients
                continue
            out = next(n for n in body.graph.nodes if n.op == "output")

            def detached(value: Any, body: fx.GraphModule = body, out: fx.Node = out) -> Any:
                nonlocal count
                if not isinstance(value, fx.Node) or _region_input(value) or \
                        not isinstance(value.meta.get("val"), torch.Tensor):
                    return value
                with body.graph.inserting_before(out):
                    new = body.graph.call_function(torch.ops.aten.detach.default, (value,))
                new.meta.update({k: v for k, v in value.meta.items() if k != "val"})
                mode = getattr(value.meta["val"], "fake_mode", None)
                if mode is not None:
                    with mode:
                        new.meta["val"] = torch.ops.aten.detach.default(value.meta["val"])
                count += 1
                return new

            out.args = fx.node.map_aggregate(out.args, detached)
            body.recompile()
    return count


def drop_custom_meta(root: fx.GraphModule) -> None:
    """Remove ``node.meta["custom"]`` everywhere once it has been read: with
    ``preserve_node_meta`` on, export also records its own tracing annotations there, which
    differ from one capture to the next and would print into every stage's source."""
    for gm in root.modules():
        if isinstance(gm, fx.GraphModule):
            for node in gm.graph.nodes:
                node.meta.pop("custom", None)


def differentiable_copies(graph: fx.Graph) -> None:
    """Replace functional ``aten.copy(dst, src)`` by ops autograd can differentiate.

    Functionalisation turns an in-place ``copy_`` into a slice of an activation
    (``y[:, :2].copy_(h)``) into ``aten.copy`` + ``slice_scatter``; ``aten.copy`` has no
    derivative ("derivative for aten::copy is not implemented"), so training the captured
    graph failed in backward. Its value is ``src`` cast to ``dst``'s dtype and broadcast to
    ``dst``'s shape (``dst``'s values are all overwritten), which is ``_to_copy`` (when
    the dtype or device differ), ``expand_copy`` (when the shape does) or ``clone``.
    """
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target != torch.ops.aten.copy.default:
            continue
        dst, src = node.args[0], node.args[1]
        if not isinstance(dst, fx.Node) or not isinstance(src, fx.Node):
            continue
        dv, sv = dst.meta.get("val"), src.meta.get("val")
        if not isinstance(dv, torch.Tensor) or not isinstance(sv, torch.Tensor):
            continue
        steps: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = []
        if sv.dtype != dv.dtype or sv.device != dv.device:
            steps.append((torch.ops.aten._to_copy.default, (),
                          {"dtype": dv.dtype, **({"device": dv.device}
                                                 if sv.device != dv.device else {})}))
        if tuple(sv.shape) != tuple(dv.shape):
            steps.append((torch.ops.aten.expand_copy.default, (list(dv.shape),), {}))
        if not steps:
            steps.append((torch.ops.aten.clone.default, (), {}))
        value: fx.Node = src
        val: Any = sv
        with graph.inserting_before(node):
            for op, extra, kwargs in steps:
                value = graph.call_function(op, (value, *extra), kwargs)
                mode = getattr(val, "fake_mode", None)
                if mode is not None:
                    with mode:
                        val = op(val, *extra, **kwargs)
                    value.meta["val"] = val
                for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
                    if key in node.meta:
                        value.meta[key] = node.meta[key]
        node.replace_all_uses_with(value)
        graph.erase_node(node)


_BN_FUNCTIONAL = torch.ops.aten._native_batch_norm_legit_functional.default
_BN_IN_PLACE = torch.ops.aten._native_batch_norm_legit.default
_COPY = torch.ops.aten.copy_.default


def _buffer_copies(graph: fx.Graph) -> dict[fx.Node, fx.Node]:
    """``copy_`` nodes that write a new value into a ``get_attr`` buffer: value -> copy node."""
    return {n.args[1]: n for n in graph.nodes
            if n.op == "call_function" and n.target == _COPY and isinstance(n.args[0], fx.Node)
            and n.args[0].op == "get_attr" and isinstance(n.args[1], fx.Node)}


def _in_place_variant(node: fx.Node) -> Any:
    """``aten.add_.Tensor`` for an ``aten.add.Tensor`` node, None when there is none."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return None
    packet = getattr(torch.ops.aten, target._schema.name.split("::")[-1] + "_", None)
    return getattr(packet, target._overloadname, None) if packet is not None else None


def update_buffers_where_read(graph: fx.Graph) -> None:
    """Put each buffer update back where the buffer is read, so no cut can fall in between.

    Functionalisation turns BatchNorm's in-place update of its running statistics into
    ``_native_batch_norm_legit_functional`` returning new statistics, and a ``copy_`` into
    the buffer at the graph's very end. Split into stages, that ``copy_`` lands in the last
    stage, which runs microbatch 0's update after the first stage has already read the
    buffer for microbatch 1 (and on another device writes a replica, not the buffer the
    reading stage owns); and the ``copy_`` bumps the version of a tensor autograd saved for
    BatchNorm's backward, which then refuses to run. So:

    - BatchNorm whose new statistics only feed those ``copy_`` nodes becomes the in-place
      ``_native_batch_norm_legit`` (what eager runs: it updates the buffers itself);
    - an out-of-place op whose result only goes to that ``copy_``, and which is the last to
      read the buffer, becomes its in-place variant (``num_batches_tracked``'s ``add`` +
      ``copy_`` becomes ``add_``);
    - any other ``copy_`` into a buffer moves right after the last node that reads the
      buffer or makes its new value, and when the buffer is floating the nodes that read it
      take a ``clone`` made just before the first of them, so autograd keeps the old value.
      No cut falls between such a reader and its ``copy_``: profiles rule those positions
      out and codegen refuses them (:func:`autopart.core.capturedgraph.buffer_update_cuts`).

    Each microbatch then updates the buffers in order, as running the model on the
    microbatches one after another does.
    """
    copies = _buffer_copies(graph)
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target != _BN_FUNCTIONAL:
            continue
        running = node.args[3:5]
        outs = {u.args[1]: u for u in node.users
                if u.target is operator.getitem and isinstance(u.args[1], int)}
        stats = [outs.get(3), outs.get(4)]
        if not all(isinstance(r, fx.Node) and r.op == "get_attr" for r in running) or \
                not all(st is not None and list(st.users) == [copies.get(st)]
                        and copies[st].args[0] is r for st, r in zip(stats, running, strict=True)):
            continue
        for st in stats:
            assert st is not None
            graph.erase_node(copies.pop(st))
            graph.erase_node(st)
        node.target = _BN_IN_PLACE
    for new, copy in copies.items():
        buffer = copy.args[0]
        assert isinstance(buffer, fx.Node)
        readers = [u for u in buffer.users if u is not copy]
        in_place = _in_place_variant(new)
        if in_place is not None and new.args[0] is buffer and list(new.users) == [copy] and \
                max(readers, key=order.__getitem__) is new:
            new.target = in_place  # ``add`` + ``copy_`` -> ``add_``: one node, no cut between
            graph.erase_node(copy)
            continue
        last = max([new, *readers], key=order.__getitem__)
        floating = isinstance(buffer.meta.get("val"), torch.Tensor) and \
            buffer.meta["val"].is_floating_point()
        if readers and floating:
            first = min(readers, key=order.__getitem__)
            with graph.inserting_before(first):
                old = graph.call_function(torch.ops.aten.clone.default, (buffer,))
            old.meta = dict(buffer.meta)
            for r in readers:
                r.replace_input_with(buffer, old)
        if last.next is not copy:
            last.append(copy)
    graph.lint()


_SDPA = torch.ops.aten.scaled_dot_product_attention.default
#: The most bytes :func:`attention_masks_as_flags` computes to read one mask (every value
#: the mask's computation makes, from the capture's shapes): 2 GiB reads a boolean causal
#: mask of one 16384-token sequence (256 MiB) and the comparisons that build it, or of
#: eight sequences of 8192 tokens.
MASK_CHECK_BUDGET_BYTES = 2 << 30


def _constant_ancestors(mask: fx.Node) -> list[fx.Node] | None:
    """The nodes ``mask`` is computed from, in graph order, or None when one is a graph
    input or a stored tensor (its value is then not the capture's to read)."""
    seen: set[fx.Node] = set()
    todo = [mask]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        if n.op != "call_function":
            return None
        seen.add(n)
        todo.extend(n.all_input_nodes)
    return [n for n in mask.graph.nodes if n in seen]


def _mask_value(nodes: list[fx.Node], mask: fx.Node) -> torch.Tensor | None:
    """``mask``'s value computed on the CPU from ``nodes`` (its constant ancestors), or None
    when that would take more than :data:`MASK_CHECK_BUDGET_BYTES` or fails."""
    total = 0
    for n in nodes:
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor):
            total += val.numel() * val.element_size()
    if total > MASK_CHECK_BUDGET_BYTES:
        return None

    def on_cpu(x: Any) -> Any:
        return torch.device("cpu") if isinstance(x, torch.device) else x

    env: dict[fx.Node, Any] = {}
    try:
        with torch.no_grad():
            for n in nodes:
                args, kwargs = fx.node.map_arg((n.args, n.kwargs), env.__getitem__)
                args, kwargs = fx.node.map_aggregate((args, kwargs), on_cpu)
                env[n] = n.target(*args, **kwargs)  # type: ignore[operator]
    except Exception:  # noqa: BLE001 - a mask this cannot compute stays as captured
        return None
    value = env[mask]
    return value if isinstance(value, torch.Tensor) and value.dim() >= 2 else None


def _mask_kind(value: torch.Tensor) -> str | None:
    """``"causal"`` where every ``[rows, cols]`` slice of the mask keeps exactly the keys at
    or before each query (top-left aligned, as ``is_causal`` masks), ``"none"`` where it
    keeps every key, else None. A float mask keeps where it is 0."""
    allowed = value if value.dtype == torch.bool else value == 0
    rows, cols = allowed.shape[-2:]
    flat = allowed.reshape(-1, rows, cols)
    if bool(flat.all()):
        return "none"
    causal = torch.ones(rows, cols, dtype=torch.bool).tril()
    return "causal" if bool((flat == causal).all()) else None


def attention_masks_as_flags(graph: fx.Graph) -> int:
    """Give ``scaled_dot_product_attention`` the causal flag in place of a mask that is one.

    Eagerly, transformers calls attention with ``is_causal=True`` and no mask where the
    sequence is unpadded (``masking_utils._ignore_causal_mask_sdpa``), which lets the kernel
    skip the blocks above the diagonal (FlashAttention; torch's CPU flash kernel too). Under
    ``torch.export`` it builds the boolean mask instead, because an exported graph may be run
    at other shapes; a masked kernel computes every block, and on a GPU a mask rules the
    flash kernel out. autopart's graphs are captured at the shapes they run (a new shape is
    a new capture), so an attention whose mask is computed from nothing but those shapes (no
    graph input, no stored tensor: no ``attention_mask`` or ``position_ids`` passed) is
    given ``is_causal=True`` and no mask where the mask is causal, and no mask where it keeps
    every key (an encoder without padding). The mask is computed once on the CPU to check
    it (at most :data:`MASK_CHECK_BUDGET_BYTES`; a larger one stays as captured, as does
    one that is neither, a sliding window say), and what computed it goes where no other
    node reads it.

    Returns:
        The number of attention nodes rewritten.
    """
    kinds: dict[fx.Node, str | None] = {}
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not _SDPA:
            continue
        given = sdpa_arguments(node)
        mask = given.get("attn_mask")
        if not isinstance(mask, fx.Node) or given.get("is_causal"):
            continue
        if mask not in kinds:
            ancestors = _constant_ancestors(mask)
            value = None if ancestors is None else _mask_value(ancestors, mask)
            kinds[mask] = None if value is None else _mask_kind(value)
        kind = kinds[mask]
        if kind is None:
            continue
        given["attn_mask"] = None
        given["is_causal"] = kind == "causal"
        node.args = tuple(given.pop(k) for k in SDPA_ARGS[:3])
        node.kwargs = {k: v for k, v in given.items() if k != "attn_mask"}
        count += 1
    unread: set[fx.Node] = set()  # what computed a mask, where nothing else reads it
    for mask in kinds:
        unread.update(_constant_ancestors(mask) or ())
    for node in reversed(list(graph.nodes)):
        if node.target in METADATA_CHECKS and node.all_input_nodes and \
                set(node.all_input_nodes) <= unread:
            graph.erase_node(node)  # export's check of a value of the mask's computation
        elif node in unread and not node.users:
            graph.erase_node(node)
    return count
