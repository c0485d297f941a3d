"""profile_graph: run a captured graph node by node and measure each op's time, bytes and FLOPs."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from autopart.capture import CapturedGraph, node_module_path, op_nodes
from autopart.costgraph import CostGraph, NodeCost
from autopart.errors import ProfileError
from autopart.profiler.meters import SavedTensorMeter, storage_key, tensor_leaves, tree_nbytes
from autopart.profiler.timer import RngState, check_device, time_calls

__all__ = ["profile_graph"]

_Key = tuple[str, int]



def _cpu_sdpa_flop(query_shape: Any, key_shape: Any, value_shape: Any, *args: Any,
                   out_shape: Any = None, **kwargs: Any) -> int:
    """FLOPs of CPU's fused attention: the same count torch gives the CUDA kernels."""
    return int(sdpa_flop_count(query_shape, key_shape, value_shape))  # type: ignore[no-untyped-call]


# FLOP formulas torch's counter lacks (keyed by op packet, as FlopCounterMode looks them up).
_EXTRA_FLOP_FORMULAS: dict[Any, Any] = {}
if hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
    _EXTRA_FLOP_FORMULAS[torch.ops.aten._scaled_dot_product_flash_attention_for_cpu] = (
        _cpu_sdpa_flop)


def profile_graph(captured: CapturedGraph, flat_inputs: list[Any], *, device: str = "cpu",
                  training: bool = True, warmup: int = 1, repeats: int = 3,
                  long_call_us: float = 50_000.0) -> CostGraph:
    """Measure every op node of a captured graph on one device.

    The graph is interpreted node by node (like ``fx.Interpreter``); each op node is run
    on the real values its inputs produced, so shapes, dtypes and data are the model's.

    Per node, first one *instrumented* forward: under ``FlopCounterMode`` and, when
    ``training``, with grad enabled and ``saved_tensors_hooks``; the inputs that need a
    gradient in training (floating tensors that depend on a trainable parameter or on a
    graph input with ``requires_grad``, as autograd decides) and the trainable parameters
    it reads go in as detached ``requires_grad`` aliases (no data copied). Its output,
    detached, is what later nodes read. Then:

    - ``fwd_us``: median of ``repeats`` timed calls after ``warmup`` untimed ones, µs
      (``time.perf_counter`` on CPU; a ``torch.cuda.Event`` pair per call on CUDA). When
      the instrumented forward took ``long_call_us`` or more, it is the one sample.
    - ``bwd_input_us`` / ``bwd_weight_us`` (when ``training``):
      ``torch.autograd.grad(outputs, leaves, ones, retain_graph=True)`` on that forward's
      graph, timed like the forward (a first call of ``long_call_us`` or more is the one
      sample), once w.r.t. the input aliases and once w.r.t. the parameter aliases: Zero
      Bubble's split of B into I and W. Nodes whose outputs need no gradient get 0.
      Parameters' ``.grad`` are never touched.
    - ``saved_bytes`` (when ``training``, else 0): storages autograd packs during the
      instrumented forward, each storage once at its full ``nbytes`` (a saved view keeps
      its base alive), storages of the parameters and buffers the node reads excluded;
      saved inputs and outputs count, since the backward keeps them alive. Each node is
      metered alone: a storage saved by two nodes (relu's output, saved by relu and the
      next linear) counts in both.
    - ``flops``: ``FlopCounterMode`` over the instrumented forward (torch's formulas plus
      CPU fused attention; ops without a formula count 0). ``bytes_accessed``: nbytes of
      the tensor inputs
      (parameters included) plus the outputs — a first-order estimate that ignores caches
      and counts views as if they were read.
    - ``output_bytes``: nbytes of the returned tensor(s); ``param_bytes``: bytes of the
      parameters and buffers this node is the first in topological order to read.

    Side effects: buffers, frozen parameters and constants go into every op as per-node
    clones (``aten.batch_norm`` updates running stats without a schema write). Ops whose
    schema writes to an argument (``copy_``, ``add_``, ``relu_``) run on clones of those
    arguments in every timed call; the value the rest of the graph sees comes from one
    more call, where arguments backed by the model's or the caller's tensors are cloned
    first. Profiling therefore leaves parameters, buffers, ``.grad``,
    the inputs and the CPU (and CUDA) random state as they were. Device literals in the
    graph (``arange(device=...)``, ``to(device=...)``) are rewritten to ``device``.

    Args:
        captured: the graph from :func:`autopart.capture.capture`.
        flat_inputs: one value per placeholder, e.g. ``captured.flatten_inputs(args, kwargs)``.
        device: ``"cpu"`` or ``"cuda:N"``; tensors elsewhere are copied there for profiling.
        training: also measure the backward and the saved activations.
        warmup: untimed calls before the timed ones (>= 0).
        repeats: timed calls per measurement (>= 1); the median is kept.
        long_call_us: µs from which a single call is the sample (as ``timeit``'s
            autorange; big CPU matmuls). ``math.inf`` always times ``warmup + repeats``.

    Returns:
        The CostGraph, ``source="measured:<device>"``, ``bwd_source`` ``"measured"``
        (``"none"`` when not training; ``"estimated:..."`` naming the nodes' count when
        some backward could not run and was set to 2 x forward, split evenly).

    Raises:
        ProfileError: bad device string or no CUDA; wrong number of inputs; bad
            ``warmup``/``repeats``; a node failed to run (the message names it).
    """
    dev = check_device(device)
    if warmup < 0 or repeats < 1:
        raise ProfileError(f"warmup must be >= 0 and repeats >= 1, got warmup={warmup}, "
                           f"repeats={repeats}; the defaults are 1 and 3")
    graph = captured.graph_module.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(flat_inputs) != len(placeholders):
        raise ProfileError(f"the graph takes {len(placeholders)} flat inputs, got "
                           f"{len(flat_inputs)}; pass captured.flatten_inputs(args, kwargs)")
    start = time.perf_counter()
    with RngState(dev), torch.no_grad():
        walker = _Walker(captured, dev, training, warmup, repeats, long_call_us)
        nodes = walker.run(flat_inputs)
    n_est = len(walker.estimated)
    if not training:
        bwd_source = "none"
    elif n_est:
        bwd_source = (f"estimated:bwd=2*fwd split evenly for {n_est} node(s) whose "
                      "autograd.grad failed; the rest measured")
    else:
        bwd_source = "measured"
    return CostGraph(
        nodes=tuple(nodes),
        graph_inputs={p.name: tree_nbytes(v)
                      for p, v in zip(placeholders, flat_inputs, strict=True)},
        graph_outputs=walker.output_names(),
        param_sizes=dict(walker.param_sizes), param_numel=dict(walker.param_numel),
        trainable=captured.trainable & frozenset(walker.param_sizes),
        source=f"measured:{dev}", bwd_source=bwd_source, batch_size=captured.batch_size,
        fingerprint=captured.fingerprint, profile_wall_s=time.perf_counter() - start)


def _written_args(node: fx.Node) -> list[int | str]:
    """Positions / kwarg names of the arguments an OpOverload's schema says it writes to."""
    schema = getattr(node.target, "_schema", None)
    if not isinstance(node.target, torch._ops.OpOverload) or schema is None:
        return []
    written: list[int | str] = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            written.append(i if i < len(node.args) else arg.name)
    return written


def _clone_written(args: tuple[Any, ...], kwargs: dict[str, Any], written: list[int | str],
                   ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Copies of ``args``/``kwargs`` with every written tensor argument cloned."""
    if not written:
        return args, kwargs
    a, k = list(args), dict(kwargs)
    for w in written:
        if isinstance(w, int) and isinstance(a[w], torch.Tensor):
            a[w] = a[w].clone()
        elif isinstance(w, str) and isinstance(k.get(w), torch.Tensor):
            k[w] = k[w].clone()
    return tuple(a), k


class _Walker:
    """Interprets the graph once, profiling each op node as its inputs become available."""

    def __init__(self, captured: CapturedGraph, device: torch.device, training: bool,
                 warmup: int, repeats: int, long_us: float) -> None:
        self.captured = captured
        self.device = device
        self.training = training
        self.warmup = warmup
        self.repeats = repeats
        self.long_us = long_us
        self.graph = captured.graph_module.graph
        self.env: dict[fx.Node, Any] = {}
        self.needs_grad: dict[fx.Node, bool] = {}
        self.fqn: dict[fx.Node, str] = {}
        self.protected: set[_Key] = set()  # storages of the model's and the caller's tensors
        self.param_sizes: dict[str, int] = {}
        self.param_numel: dict[str, int] = {}
        self.estimated: list[str] = []
        self._moved: dict[int, torch.Tensor] = {}

    # ---- walk --------------------------------------------------------------------
    def run(self, flat_inputs: list[Any]) -> list[NodeCost]:
        """Interpret the graph; return one NodeCost per op node, in topological order."""
        last_use = self._last_uses()
        inputs = iter(flat_inputs)
        costs: list[NodeCost] = []
        seen_params: set[str] = set()
        ops = set(op_nodes(self.graph))
        for node in self.graph.nodes:
            if node.op == "placeholder":
                value = self._to_device(next(inputs))
                self.env[node] = value
                self.needs_grad[node] = (isinstance(value, torch.Tensor)
                                         and value.requires_grad)
            elif node.op == "get_attr":
                self.env[node] = self._get_attr(node)
            elif node in ops:
                cost = self._profile_node(node, seen_params)
                seen_params.update(cost.params)
                costs.append(cost)
            for dead in last_use.get(node, ()):
                self.env.pop(dead, None)
        return costs

    def output_names(self) -> tuple[str, ...]:
        """Names of the op nodes and placeholders the graph returns (constants skipped)."""
        out = next(n for n in self.graph.nodes if n.op == "output")
        names: list[str] = []
        fx.node.map_arg(out.args, lambda n: names.append(n.name) if n.op != "get_attr" else None)
        return tuple(names)

    def _last_uses(self) -> dict[fx.Node, list[fx.Node]]:
        seen: set[fx.Node] = set()
        last: dict[fx.Node, list[fx.Node]] = {}
        for node in reversed(self.graph.nodes):
            for inp in node.all_input_nodes:
                if inp not in seen:
                    seen.add(inp)
                    last.setdefault(node, []).append(inp)
        return last

    def _to_device(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            self.protected.add(storage_key(value) or ("", 0))
            if value.device != self.device:
                value = value.detach().to(self.device)
                self.protected.add(storage_key(value) or ("", 0))
        return value

    def _get_attr(self, node: fx.Node) -> Any:
        target = str(node.target)
        obj: Any = self.captured.graph_module
        for part in target.split("."):
            obj = getattr(obj, part)
        if not isinstance(obj, torch.Tensor):
            return obj  # a submodule of a higher-order op
        value = self.captured.attr_value(target)
        fqn = self.captured.attr_fqns.get(target, target)
        self.fqn[node] = fqn
        if node.users:
            self.param_sizes[fqn] = value.numel() * value.element_size()
            self.param_numel[fqn] = value.numel()
        if id(value) not in self._moved:
            self._moved[id(value)] = self._to_device(value)
        return self._moved[id(value)]

    def _load(self, node: fx.Node, value_of: Callable[[fx.Node], Any] | None = None,
              ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The node's args and kwargs with Nodes replaced by values, device literals remapped."""
        get = value_of or self.env.__getitem__
        args, kwargs = fx.node.map_aggregate(
            fx.node.map_arg((node.args, node.kwargs), get),
            lambda x: self.device if isinstance(x, torch.device) else x)
        return tuple(args), dict(kwargs)

    def _callable(self, node: fx.Node) -> Callable[..., Any]:
        if node.op == "call_function":
            return node.target  # type: ignore[return-value]
        if node.op == "call_module":
            mod: Callable[..., Any] = self.captured.graph_module.get_submodule(str(node.target))
            return mod
        name = str(node.target)  # call_method: args[0] is self
        return lambda obj, *a, **k: getattr(obj, name)(*a, **k)

    # ---- one node ----------------------------------------------------------------
    def _profile_node(self, node: fx.Node, seen_params: set[str]) -> NodeCost:
        fn = self._callable(node)
        written = _written_args(node)
        # Buffers, frozen parameters and constants go in as clones: some ops (aten.batch_norm
        # in training) update them in place without saying so in their schema.
        clones = {n: pytree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x,
                                     self.env[n])
                  for n in node.all_input_nodes
                  if n.op == "get_attr" and self.fqn.get(n) not in self.captured.trainable}

        def value_of(n: fx.Node) -> Any:
            return clones[n] if n in clones else self.env[n]

        args, kwargs = self._load(node, value_of)

        def factory() -> Callable[[], Any]:
            a, k = _clone_written(args, kwargs, written)
            return lambda: fn(*a, **k)

        try:
            run = self._instrumented_run(node, fn, written, value_of)
            fwd_us = run.us
            if run.us < self.long_us:  # the instrumented run was the warm-up's first call
                fwd_us, _ = time_calls(self.device, factory, self.warmup, self.repeats)
            result = self._commit(node, fn, written, value_of) if written else run.value
            bwd_in, bwd_w = self._time_backward(node, run, fwd_us)
        except Exception as exc:  # any op failure becomes one error that names the node
            text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise ProfileError(
                f"node {node.name!r} ({node.target}, module {node_module_path(node)!r}) failed "
                f"on {self.device}: {type(exc).__name__}: {text}; check that the inputs match "
                "the captured example inputs and that every op runs on this device") from exc
        self.env[node] = result
        params = tuple(dict.fromkeys(self.fqn[n] for n in node.all_input_nodes
                                     if n in self.fqn))
        return NodeCost(
            name=node.name, op=str(node.target), module_path=node_module_path(node),
            fwd_us=fwd_us, bwd_input_us=bwd_in, bwd_weight_us=bwd_w, flops=run.flops,
            bytes_accessed=tree_nbytes((args, kwargs)) + tree_nbytes(result),
            output_bytes=tree_nbytes(result), saved_bytes=run.saved_bytes,
            param_bytes=sum(self.param_sizes[p] for p in params if p not in seen_params),
            inputs=tuple(n.name for n in node.all_input_nodes if n.op != "get_attr"),
            params=params, output_is_tensor=isinstance(result, torch.Tensor))

    def _commit(self, node: fx.Node, fn: Callable[..., Any], written: list[int | str],
                value_of: Callable[[fx.Node], Any]) -> Any:
        """Run a writing op once for the graph's sake, never on the model's or caller's tensors.

        A written activation is updated in place, as in the model; a written graph input or
        attribute is first replaced, for the rest of the walk, by a clone.
        """
        for w in written:
            src = node.args[w] if isinstance(w, int) else node.kwargs.get(w)
            if isinstance(src, fx.Node) and isinstance(self.env.get(src), torch.Tensor):
                if storage_key(self.env[src]) in self.protected:
                    self.env[src] = self.env[src].clone()
        args, kwargs = self._load(node, value_of)
        return fn(*args, **kwargs)

    def _instrumented_run(self, node: fx.Node, fn: Callable[..., Any],
                          written: list[int | str], value_of: Callable[[fx.Node], Any]) -> _Run:
        """One timed forward under the FLOP counter and, when training, with grad enabled.

        With grad, the inputs that need a gradient and the trainable parameters become
        detached ``requires_grad`` aliases (no data copied) and the saved-tensor hooks
        size what autograd keeps.
        """
        run = _Run()
        cache: dict[fx.Node, Any] = {}

        def grad_value(src: fx.Node) -> Any:
            if src in cache:
                return cache[src]
            value = value_of(src)
            if src.op == "get_attr":
                want = self.fqn.get(src) in self.captured.trainable
                leaves = run.weight_leaves
            else:
                want, leaves = self.needs_grad.get(src, False), run.input_leaves

            def leaf(x: Any) -> Any:
                if isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex()):
                    x = x.detach().requires_grad_(True)
                    leaves.append(x)
                return x

            cache[src] = pytree.tree_map(leaf, value) if want else value
            return cache[src]

        args, kwargs = self._load(node, grad_value if self.training else value_of)
        with torch.set_grad_enabled(self.training):  # a clone of a grad leaf stays in the graph
            args, kwargs = _clone_written(args, kwargs, written)
        excluded = {k for n in node.all_input_nodes if n.op == "get_attr"
                    for t in tensor_leaves(value_of(n)) if (k := storage_key(t)) is not None}
        meter = SavedTensorMeter(excluded)
        counter = FlopCounterMode(display=False, custom_mapping=_EXTRA_FLOP_FORMULAS)

        def factory() -> Callable[[], Any]:
            def thunk() -> Any:
                with torch.set_grad_enabled(self.training), \
                        saved_tensors_hooks(meter.pack, meter.unpack), counter:
                    return fn(*args, **kwargs)
            return thunk

        run.us, out = time_calls(self.device, factory, 0, 1)
        run.flops = int(counter.get_total_flops())
        run.value = pytree.tree_map(
            lambda x: x.detach() if isinstance(x, torch.Tensor) else x, out)
        run.outs = [t for t in tensor_leaves(out) if t.requires_grad]
        self.needs_grad[node] = bool(run.outs)
        if run.outs:
            run.saved_bytes = meter.saved_bytes
        return run

    def _time_backward(self, node: fx.Node, run: _Run, fwd_us: float) -> tuple[float, float]:
        """``(bwd_input_us, bwd_weight_us)``; 0 when no output needs a gradient."""
        if not run.outs:
            return 0.0, 0.0
        grads = [torch.ones_like(t) for t in run.outs]
        try:
            return (self._time_grad(run.outs, grads, run.input_leaves),
                    self._time_grad(run.outs, grads, run.weight_leaves))
        except RuntimeError:  # an op without a derivative formula: estimate, and say so
            self.estimated.append(node.name)
            return fwd_us, fwd_us

    def _time_grad(self, outs: list[torch.Tensor], grads: list[torch.Tensor],
                   leaves: list[torch.Tensor]) -> float:
        if not leaves:
            return 0.0

        def factory() -> Callable[[], Any]:
            return lambda: torch.autograd.grad(outs, leaves, grads, retain_graph=True,
                                               allow_unused=True)

        us, _ = time_calls(self.device, factory, self.warmup, self.repeats, self.long_us)
        return float(us)


@dataclass
class _Run:
    """What one instrumented forward of a node gave."""

    us: float = 0.0
    value: Any = None  # the output, detached: what the rest of the graph reads
    flops: int = 0
    saved_bytes: int = 0
    outs: list[torch.Tensor] = field(default_factory=list)  # outputs that need a gradient
    input_leaves: list[torch.Tensor] = field(default_factory=list)
    weight_leaves: list[torch.Tensor] = field(default_factory=list)
