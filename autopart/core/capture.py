"""Capture: torch.export (non-strict) to a flat fx.GraphModule that keeps each node's module path."""

from __future__ import annotations

import contextlib
import hashlib
import linecache
import operator
import os
import re
import traceback
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
import torch.utils._pytree as pytree
from torch import nn

from autopart.core.errors import TraceError

__all__ = ["CapturedGraph", "capture", "graph_fingerprint", "op_nodes", "node_module_path",
           "node_source"]

_OP_KINDS = ("call_function", "call_method", "call_module")


@dataclass(frozen=True)
class CapturedGraph:
    """A model captured as one flat FX graph.

    Attributes:
        graph_module: takes the flattened inputs positionally (one placeholder per pytree
            leaf of ``(args, kwargs)``) and returns the flattened outputs as a tuple.
            Parameters and buffers are ``get_attr`` nodes; they are the model's own tensors.
        in_spec: pytree spec of ``(args, kwargs)``; ``out_spec``: of the model's output.
        attr_fqns: ``get_attr`` target -> the model's canonical FQN (the first name
            ``model.named_parameters()`` / ``named_buffers()`` gives a tied tensor), or the
            target itself for constants that belong to no module.
        trainable: canonical FQNs of parameters with ``requires_grad``.
        buffers: canonical FQNs of buffers.
        batch_size: leading dimension of the first tensor input.
        fingerprint: :func:`graph_fingerprint` of the graph.
    """

    graph_module: fx.GraphModule
    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec
    attr_fqns: dict[str, str]
    trainable: frozenset[str]
    buffers: frozenset[str]
    batch_size: int
    fingerprint: str

    def flatten_inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        """Flatten ``(args, kwargs)`` to the graph's placeholder order.

        Raises:
            TraceError: the inputs' structure differs from the captured one.
        """
        leaves, spec = pytree.tree_flatten((args, kwargs))
        if spec != self.in_spec:
            raise TraceError(
                f"inputs have structure {spec} but the model was captured with {self.in_spec}; "
                "pass the same positional and keyword inputs as the example inputs")
        return leaves

    def attr_value(self, target: str) -> torch.Tensor:
        """The tensor behind a ``get_attr`` target."""
        value = _get_attr(self.graph_module, target)
        assert isinstance(value, torch.Tensor), target
        return value

    def attr_object(self, target: str) -> Any:
        """What a ``get_attr`` target names: a tensor, or the submodule of a higher-order op."""
        return _get_attr(self.graph_module, target)


def op_nodes(graph: fx.Graph) -> list[fx.Node]:
    """The graph's op nodes (calls) in topological order: what cuts split between."""
    return [n for n in graph.nodes if n.op in _OP_KINDS]


def node_module_path(node: fx.Node) -> str:
    """Innermost ``nn_module_stack`` FQN of a node, ``""`` at the model's top level."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    fqn = list(stack.values())[-1][0]
    return str(fqn)


def node_source(node: fx.Node) -> str:
    """Where the model made ``node``: ``"file.py:123 (code)"`` of the innermost frame that
    torch.export recorded, or ``"unknown source line"`` when it recorded none (nodes that
    autopart or export inserted)."""
    trace = node.meta.get("stack_trace") or ""
    frames = re.findall(r'File "([^"]+)", line (\d+), in [^\n]*\n\s*([^\n]*)', trace)
    if not frames:
        return "unknown source line"
    path, line, code = frames[-1]
    return f"{os.path.basename(path)}:{line} ({code.strip()})"


def _get_attr(root: nn.Module, target: str) -> Any:
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _abstract(arg: Any, index: dict[fx.Node, int]) -> Any:
    if isinstance(arg, fx.Node):
        return f"%{index[arg]}"
    if isinstance(arg, (list, tuple)):
        return [_abstract(a, index) for a in arg]
    if isinstance(arg, dict):
        return {str(k): _abstract(v, index) for k, v in sorted(arg.items(), key=lambda kv: str(kv[0]))}
    if isinstance(arg, bool) or arg is None:
        return arg
    if isinstance(arg, torch.device):
        return "device"  # where it was captured (cpu, cuda:N, meta) is not the structure
    if isinstance(arg, int):
        return "int"  # shape literals change with the batch; the structure does not
    return repr(arg)


def graph_fingerprint(gm: fx.GraphModule, attr_fqns: dict[str, str]) -> str:
    """Hash of a graph's structure: ops, wiring, module paths and parameter shapes.

    Integer literals and devices are abstracted, so the same model captured at batch 8 and
    at microbatch 2, or on cpu, a GPU or ``meta``, has the same fingerprint; a different
    model, layer count or hidden size does not. Returns 16 hex digits of SHA-256.
    """
    index: dict[fx.Node, int] = {}
    h = hashlib.sha256()
    for i, node in enumerate(gm.graph.nodes):
        index[node] = i
        if node.op == "get_attr":
            value = _get_attr(gm, str(node.target))
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else ()
            item: Any = ["get_attr", attr_fqns.get(str(node.target), str(node.target)), shape]
        else:
            item = [node.op, str(node.target), _abstract(node.args, index),
                    _abstract(node.kwargs, index), node_module_path(node)]
        h.update(repr(item).encode())
    return h.hexdigest()[:16]


def _user_frame(exc: BaseException) -> traceback.FrameSummary | None:
    """The innermost traceback frame outside torch, transformers' export glue and autopart."""
    torch_dir = os.path.dirname(torch.__file__)
    here = os.path.dirname(__file__)
    frames = traceback.extract_tb(exc.__traceback__)
    # Errors raised while tracing carry the user frame in the message's stack too; the
    # traceback of the exception is enough for Python-level failures.
    user = [f for f in frames if not f.filename.startswith((torch_dir, here))
            and "site-packages/torch" not in f.filename]
    return user[-1] if user else None


def _trace_error(exc: BaseException) -> TraceError:
    frame = _user_frame(exc)
    where = ""
    if frame is not None:
        line = (frame.line or linecache.getline(frame.filename, frame.lineno or 0)).strip()
        where = f"\n  at {frame.filename}:{frame.lineno} in {frame.name}:\n    {line}"
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    data_dependent = any(k in str(exc) for k in ("data-dependent", "GuardOnDataDependent",
                                                   "Could not guard", "item()"))
    if data_dependent:
        fix = ("data-dependent control flow: the model reads a tensor's value there (a Python "
               "`if` on tensor data, .item(), int(tensor), a size taken from data); replace the "
               "`if` with torch.where / torch.cond, pass the value as a static Python number, or "
               "where it is a size, state its range with torch._check(...) before using it")
    else:
        fix = ("make forward() traceable by torch.export(strict=False): no Python control flow "
               "on tensor values, no .item()/.tolist(), inputs and outputs made of tensors, "
               "lists, tuples, dicts or dataclasses (for Hugging Face decoders pass "
               "use_cache=False)")
    return TraceError(f"torch.export could not capture the model: {type(exc).__name__}: {text}"
                      f"{where}\n  fix: {fix}")


# Ops that fail unless their input's strides are what the fake tensors of the capture had.
_STRIDE_BOUND_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)


def _tolerate_real_strides(graph: fx.Graph) -> None:
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
#: The ``node.meta["custom"]`` key naming the custom ``autograd.Function`` a node was traced in.
_IN_CUSTOM_FUNCTION = "autopart.custom_autograd_function"
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


def _detach_grad_disabled_regions(root: fx.GraphModule) -> int:
    """Make what a ``torch.no_grad()`` region computes non-differentiable, as it is eagerly.

    torch.export keeps a region run with gradients off as a ``wrap_with_set_grad_enabled
    (False, submodule, ...)`` call; functionalising (``run_decompositions``) inlines the
    submodule and drops the grad mode, so the captured graph would differentiate through
    the region: HRM's "only the last inner cycles propagate gradients" trick then trained
    every cycle, with gradients up to 66 % off. Each tensor the region returns is wrapped
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
            if any(_IN_CUSTOM_FUNCTION in (n.meta.get("custom") or {}) for n in body.graph.nodes):
                # a custom autograd.Function's forward (Reformer's reversible layers): its
                # output carries a gradient eagerly, through the Function's own backward;
                # the graph differentiates the forward instead, and _check_custom_backward
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


def _drop_custom_meta(root: fx.GraphModule) -> None:
    """Remove ``node.meta["custom"]`` everywhere once it has been read: with
    ``preserve_node_meta`` on, export also records its own tracing annotations there, which
    differ from one capture to the next and would print into every stage's source."""
    for gm in root.modules():
        if isinstance(gm, fx.GraphModule):
            for node in gm.graph.nodes:
                node.meta.pop("custom", None)


def _differentiable_copies(graph: fx.Graph) -> None:
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


def _update_buffers_where_read(graph: fx.Graph) -> None:
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
      (A cut may still fall between such a reader and its ``copy_``.)

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


def _leading_dim(leaves: list[Any]) -> int:
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    raise TraceError("no tensor input with a batch dimension; pass at least one tensor whose "
                     "dim 0 is the batch")


def capture(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None,
            ) -> CapturedGraph:
    """Capture ``model(*args, **kwargs)`` as a flat FX graph with ``torch.export`` (non-strict).

    The graph is functionalised (``run_decompositions({})``: in-place ops become
    out-of-place, nothing is decomposed). Shapes are specialised to the example inputs;
    a dimension of size 1 may capture differently from larger sizes. The model keeps its
    train/eval mode; dropout and batch-norm behave as in that mode.

    Args:
        model: the module to capture; its parameters are shared, not copied.
        args: positional example inputs; tensors have the batch in dim 0.
        kwargs: keyword example inputs.

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
        # preserve_node_meta: the annotations _custom_functions_applied makes reach the nodes
        with _custom_functions_applied(custom), fx_traceback.preserve_node_meta():
            ep = torch.export.export(model, args, kwargs, strict=False)
        _detach_grad_disabled_regions(ep.graph_module)
        _drop_custom_meta(ep.graph_module)
        # Functionalise (no decompositions): in-place ops such as ``add_`` or ``relu_``
        # become out-of-place, so no stage ever writes into a tensor another stage sent it.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # pytree deprecation inside torch
            ep = ep.run_decompositions({})
    except Exception as exc:  # export raises many unrelated types; all become one clear error
        raise _trace_error(exc) from exc
    gm = ep.module()
    # Drop the input-guard module export inserts: microbatches are checked by the runtime.
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and str(node.target).startswith("_guards_fn"):
            gm.graph.erase_node(node)
            if hasattr(gm, str(node.target)):
                delattr(gm, str(node.target))
    _tolerate_real_strides(gm.graph)
    _differentiable_copies(gm.graph)
    _update_buffers_where_read(gm.graph)
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
        _check_custom_backward(model, gm, args, kwargs, custom)
    return CapturedGraph(
        graph_module=gm, in_spec=ep.call_spec.in_spec, out_spec=ep.call_spec.out_spec,
        attr_fqns=attr_fqns, trainable=frozenset(trainable), buffers=frozenset(buffers),
        batch_size=_leading_dim(leaves), fingerprint=graph_fingerprint(gm, attr_fqns))


@contextlib.contextmanager
def _custom_functions_applied(seen: list[type]) -> Iterator[None]:
    """Record the ``torch.autograd.Function`` subclasses (outside torch itself) applied while
    the block runs: ``torch.export`` traces their forward and drops their backward."""
    base = torch.autograd.function.Function
    original = base.__dict__["apply"]

    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        if cls.__module__.startswith("torch."):
            return original.__func__(cls, *args, **kwargs)
        if cls not in seen:
            seen.append(cls)
        # nodes traced here carry the Function's name (node.meta["custom"]), so that
        # _detach_grad_disabled_regions leaves its forward's no-grad regions differentiable
        with fx_traceback.annotate({_IN_CUSTOM_FUNCTION: cls.__qualname__}):
            return original.__func__(cls, *args, **kwargs)

    base.apply = classmethod(apply)  # type: ignore[assignment,method-assign]
    try:
        yield
    finally:
        base.apply = original  # type: ignore[method-assign]


def _check_custom_backward(model: nn.Module, gm: fx.GraphModule, args: tuple[Any, ...],
                           kwargs: dict[str, Any], custom: list[type]) -> None:
    """The captured graph differentiates the forward of each custom ``autograd.Function``, not
    its own backward. Compare the parameters' gradients of the model and of the graph on the
    example inputs (same random state for both, output weights from a seeded generator) and
    refuse a graph whose gradients differ: a model with an approximate backward (YOSO's
    LSH attention) would otherwise train on other gradients than the user's.

    Raises:
        TraceError: the gradients differ; names the Functions and the largest difference.
    """
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not params:
        return

    def grads(run: Any) -> list[torch.Tensor | None] | None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            outs = [t for t in pytree.tree_leaves(run()) if isinstance(t, torch.Tensor)
                    and t.requires_grad and t.is_floating_point()]
        if not outs:
            return None
        gen = torch.Generator().manual_seed(0)
        total = sum((t * torch.randn(t.shape, generator=gen).to(t)).sum() for t in outs)
        # .backward() and .grad, not autograd.grad: a custom backward may accumulate into
        # .grad itself (Reformer's reversible layers run their own backward inside theirs)
        kept = [p.grad for _, p in params]
        for _, p in params:
            p.grad = None
        try:
            total.backward()
            return [p.grad for _, p in params]
        finally:
            for (_, p), g in zip(params, kept, strict=True):
                p.grad = g

    flat = pytree.tree_leaves((args, kwargs))
    with torch.enable_grad():
        eager = grads(lambda: model(*args, **kwargs))
        captured = grads(lambda: gm.forward(*flat))  # flat leaves; no input-spec hook
    if eager is None or captured is None:
        return
    worst, where = 0.0, ""
    for (name, _), a, b in zip(params, eager, captured, strict=True):
        if a is None and b is None:
            continue
        a = torch.zeros_like(b) if a is None else a
        b = torch.zeros_like(a) if b is None else b
        scale = float(a.abs().max()) + 1e-12
        diff = float((a - b).abs().max()) / scale
        if diff > worst:
            worst, where = diff, name
    if worst > 1e-3:
        names = ", ".join(f"{c.__module__}.{c.__qualname__}" for c in custom)
        raise TraceError(
            f"{names} {'defines its' if len(custom) == 1 else 'define their'} own backward "
            "(torch.autograd.Function); torch.export keeps only the forward, and the captured "
            "graph's gradients differ from the model's "
            f"(largest relative difference {worst:.3g}, in {where}). autopart cannot keep a "
            "custom backward: write that part with plain torch ops (its forward is then "
            "differentiated as written), or train it outside autopart")
