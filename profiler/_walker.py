"""The measuring interpreter behind profile_graph: one op node at a time, on real values."""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.flop_counter import FlopCounterMode

from autopart.core.capture import CapturedGraph, node_module_path, node_source, op_nodes
from autopart.core.costgraph import NodeCost
from autopart.core.errors import ProfileError
from autopart.core.memory import allocated_peak_bytes
from autopart.profiler._oputil import (
    MeasureReport,
    _clone_written,
    _Run,
    _written_args,
    attention_work,
    flop_formulas,
    weight_source,
)
from autopart.profiler.meters import (
    SavedTensorMeter,
    storage_key,
    strided_nbytes,
    tensor_leaves,
    tree_nbytes,
)
from autopart.profiler.timer import spread, time_calls, time_samples

__all__: list[str] = []

_Key = tuple[str, int]
Progress = Callable[[int, int], None]


def _node_error(node: fx.Node, device: torch.device, exc: BaseException) -> ProfileError:
    """One error for an op that failed while profiling: node, module, source line, fix."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return ProfileError(
        f"node {node.name!r} ({node.target}, module {node_module_path(node)!r}, from "
        f"{node_source(node)}) failed on {device}: {type(exc).__name__}: {text}; check that "
        "the inputs match the captured example inputs and that every op runs on this device")


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
        self.reuse: dict[fx.Node, fx.Node] = {}
        self.progress: Progress | None = None
        self.report = MeasureReport()
        self._done: dict[fx.Node, tuple[NodeCost, float]] = {}  # measured: (cost, wall s)
        self._saved_live: set[_Key] = set()  # saved storages already counted, still alive
        self._live_refs: Counter[_Key] = Counter()  # live env values per storage
        self._producer: dict[_Key, int] = {}  # live storage -> op index that returned it first
        self._index = -1  # op index of the node being profiled (-1: graph inputs)
        self._ops: list[fx.Node] = []  # op nodes in order
        self._grad_call_us: tuple[float, float] | None = None  # see _empty_grad_call_us
        # MoE routing: top-k id node -> (experts module path, its experts); the tokens
        # each expert was routed, counted as the ids are computed (CostGraph.expert_tokens)
        self.watch: dict[fx.Node, tuple[str, int]] = {}
        self.expert_tokens: dict[str, tuple[int, ...]] = {}

    # ---- walk --------------------------------------------------------------------
    def run(self, flat_inputs: list[Any]) -> list[NodeCost]:
        """Interpret the graph; return one NodeCost per op node, in topological order."""
        last_use = self._last_uses()
        inputs = iter(flat_inputs)
        costs: list[NodeCost] = []
        seen_params: set[str] = set()
        ops = op_nodes(self.graph)
        self._ops = ops
        op_set = set(ops)
        for node in self.graph.nodes:
            self._index = len(costs)
            if node.op == "placeholder":
                value = self._to_device(next(inputs))
                self._index = -1  # a graph input: produced before every op
                self._set(node, value)
                self.needs_grad[node] = (isinstance(value, torch.Tensor)
                                         and value.requires_grad)
            elif node.op == "get_attr":
                self.env[node] = self._get_attr(node)
            elif node in op_set:
                t0 = time.perf_counter()
                rep = self.reuse.get(node)
                if rep in self._done and self._same_grads(node, rep):
                    cost = self._reuse_node(node, rep, seen_params)
                    self.report.reuse_saved_s += self._done[rep][1] - (time.perf_counter() - t0)
                else:
                    cost = self._profile_node(node, seen_params)
                    self._done[node] = (cost, time.perf_counter() - t0)
                seen_params.update(cost.params)
                costs.append(cost)
                if self.progress is not None:
                    self.progress(len(costs), len(ops))
            for dead in last_use.get(node, ()):
                self._drop(dead)
        return costs

    def _set(self, node: fx.Node, value: Any) -> None:
        self.env[node] = value
        if node in self.watch and isinstance(value, torch.Tensor):
            path, experts = self.watch[node]
            counts = torch.bincount(value.detach().reshape(-1).cpu(), minlength=experts)
            self.expert_tokens[path] = tuple(int(c) for c in counts.tolist())
        keys = {k for t in tensor_leaves(value) if (k := storage_key(t))}
        self._live_refs.update(keys)
        for key in keys:  # a view keeps its base's producer
            self._producer.setdefault(key, self._index)

    def _drop(self, node: fx.Node) -> None:
        for key in {k for t in tensor_leaves(self.env.pop(node, None)) if (k := storage_key(t))}:
            self._live_refs[key] -= 1
            if self._live_refs[key] <= 0:
                del self._live_refs[key]
                self._saved_live.discard(key)
                self._producer.pop(key, None)

    def _same_grads(self, node: fx.Node, rep: fx.Node) -> bool:
        """Whether the node's inputs need gradients exactly where its representative's did."""
        mine = [self.needs_grad.get(n, False) for n in node.all_input_nodes]
        theirs = [self.needs_grad.get(n, False) for n in rep.all_input_nodes]
        return mine == theirs

    def _reuse_node(self, node: fx.Node, rep: fx.Node, seen_params: set[str]) -> NodeCost:
        """Run a node once for its value; take its representative's measured costs."""
        fn = self._callable(node)
        written = _written_args(node)
        args, kwargs = self._load(node)
        try:
            if written:
                result = self._commit(node, fn, written, self.env.__getitem__)
            else:
                a, k = _clone_written(args, kwargs, [])
                result = fn(*a, **k)
        except Exception as exc:  # the same error as a measured node
            raise _node_error(node, self.device, exc) from exc
        self._set(node, result)
        self.needs_grad[node] = self.needs_grad.get(rep, False)
        self.report.reused[node.name] = rep.name
        self.report.fwd_spread[node.name] = 0.0
        base = self._done[rep][0]
        # what the representative first saved of nodes' outputs, this node saves of the
        # nodes as far back: counted here, so a measured node after it (a different layer
        # reading this one's output) does not count it again (a ResNet's first strided
        # convolution counted the block output that a reused ReLU had saved: 16 MiB twice)
        for dist, _ in base.saved_from or ():
            if dist <= self._index:
                value = result if dist == 0 else self.env.get(self._ops[self._index - dist])
                self._saved_live |= {k for t in tensor_leaves(value) if (k := storage_key(t))}
        params = tuple(dict.fromkeys(self.fqn[n] for n in node.all_input_nodes if n in self.fqn))
        return dataclasses.replace(
            base, name=node.name, module_path=node_module_path(node),
            param_bytes=sum(self.param_sizes[p] for p in params if p not in seen_params),
            inputs=tuple(n.name for n in node.all_input_nodes if n.op != "get_attr"),
            params=params)

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
        obj = self.captured.attr_object(target)
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
            # the instrumented run (hooks, FLOP counter, fresh memory) is the first warm-up
            # call, never a sample; after a long one, the faster of two plain calls is the
            # sample (time_samples' long-call rule, its warm-up already done)
            long = run.us >= self.long_us
            host: list[float] | None = [] if self.device.type == "cuda" else None
            samples, _ = time_samples(self.device, factory, 0 if long else self.warmup,
                                      2 if long else self.repeats, host=host)
            if long:
                samples, host = [min(samples)], host and [min(host)]
            fwd_us = float(statistics.median(samples))
            self.report.fwd_spread[node.name] = spread(samples)
            result = self._commit(node, fn, written, value_of) if written else run.value
            host_f = float(statistics.median(host)) if host else None
            (bwd_in, bwd_w), host_b = self._time_backward(node, run, fwd_us, host_f)
        except Exception as exc:  # any op failure becomes one error that names the node
            raise _node_error(node, self.device, exc) from exc
        self._set(node, result)
        live = {k for t in tensor_leaves(result) if (k := storage_key(t))}
        live |= {k for n in node.all_input_nodes for t in tensor_leaves(self.env.get(n))
                 if (k := storage_key(t))}
        self._saved_live |= run.saved_keys & live  # op-internal saved tensors die with it
        params = tuple(dict.fromkeys(self.fqn[n] for n in node.all_input_nodes
                                     if n in self.fqn))
        transient = (tree_nbytes(run.outs) + tree_nbytes(run.input_leaves)
                     if self.training and run.outs else 0)
        backward_peak = self._backward_peak(run)
        return NodeCost(
            name=node.name, op=str(node.target), module_path=node_module_path(node),
            fwd_us=fwd_us, bwd_input_us=bwd_in, bwd_weight_us=bwd_w, flops=run.flops,
            bytes_accessed=tree_nbytes((args, kwargs)) + tree_nbytes(result),
            output_bytes=tree_nbytes(result), saved_bytes=run.saved_bytes,
            param_bytes=sum(self.param_sizes[p] for p in params if p not in seen_params),
            inputs=tuple(n.name for n in node.all_input_nodes if n.op != "get_attr"),
            params=params, output_is_tensor=isinstance(result, torch.Tensor),
            transient_bytes=transient, backward_peak_bytes=backward_peak,
            saved_from=run.saved_from if self.training else None,
            strided_output_bytes=strided_nbytes(result), host_fwd_us=host_f,
            host_bwd_input_us=host_b and host_b[0], host_bwd_weight_us=host_b and host_b[1])

    def _backward_peak(self, run: _Run) -> int:
        """The most a node's whole backward (input and weight gradients, from ones as its
        outputs' gradients) holds allocated at once, bytes; measured once
        (``autopart.core.memory.allocated_peak_bytes``; 0 on ``meta``, and for an op without
        a derivative formula)."""
        if not (self.training and run.outs):
            return 0
        grads = [torch.ones_like(t) for t in run.outs]
        try:
            _, peak = allocated_peak_bytes(
                lambda: torch.autograd.grad(run.outs, run.input_leaves + run.weight_leaves,
                                            grads, retain_graph=True, allow_unused=True),
                self.device)
        except RuntimeError:  # no derivative formula (its times are estimated), or a profiler
            return 0          # already running in this process
        return peak

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
            source = weight_source(src)  # a parameter, or its transpose / view / cast
            if source is not None:
                want = self.fqn.get(source) in self.captured.trainable
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
        excluded = {k for n in node.all_input_nodes if weight_source(n) is not None
                    for t in tensor_leaves(value_of(n)) if (k := storage_key(t)) is not None}
        meter = SavedTensorMeter(excluded | self._saved_live)
        counter = FlopCounterMode(display=False, custom_mapping=flop_formulas())

        def factory() -> Callable[[], Any]:
            def thunk() -> Any:
                with torch.set_grad_enabled(self.training), \
                        saved_tensors_hooks(meter.pack, meter.unpack), counter:
                    return fn(*args, **kwargs)
            return thunk

        run.us, out = time_calls(self.device, factory, 0, 1)
        run.flops = int(counter.get_total_flops() * attention_work(node))
        run.value = pytree.tree_map(
            lambda x: x.detach() if isinstance(x, torch.Tensor) else x, out)
        run.outs = [t for t in tensor_leaves(out) if t.requires_grad]
        self.needs_grad[node] = bool(run.outs)
        if run.outs:
            run.saved_bytes = meter.saved_bytes
            run.saved_keys = meter.keys
            # the saved storages that a node returned (this one included: its output's
            # storage is set as produced here), by distance back to that node
            mine = {k for t in tensor_leaves(run.value) if (k := storage_key(t))}
            back: Counter[int] = Counter()
            for key, nbytes in meter.sizes.items():
                producer = self._index if key in mine and key not in self._producer \
                    else self._producer.get(key)
                if producer is not None:
                    back[self._index - producer] += nbytes
            run.saved_from = tuple(sorted(back.items()))
        return run

    def _time_backward(self, node: fx.Node, run: _Run, fwd_us: float, host_fwd: float | None,
                       ) -> tuple[tuple[float, float], tuple[float, float] | None]:
        """``((bwd_input_us, bwd_weight_us), their host issue times or None)``, 0 when no
        output needs a gradient; host times on CUDA only (``host_fwd`` given)."""
        if not run.outs:
            return (0.0, 0.0), None if host_fwd is None else (0.0, 0.0)
        grads = [torch.ones_like(t) for t in run.outs]
        try:
            (bi, hi), (bw, hw) = (self._time_grad(run.outs, grads, leaves, fwd_us, host_fwd)
                                  for leaves in (run.input_leaves, run.weight_leaves))
        except RuntimeError:  # an op without a derivative formula: estimate, and say so
            self.estimated.append(node.name)
            (bi, hi), (bw, hw) = (fwd_us, host_fwd or 0.0), (fwd_us, host_fwd or 0.0)
        return (bi, bw), None if host_fwd is None else (hi, hw)

    def _time_grad(self, outs: list[torch.Tensor], grads: list[torch.Tensor],
                   leaves: list[torch.Tensor], fwd_us: float, host_fwd: float | None = None,
                   ) -> tuple[float, float]:
        """``(µs, host µs)`` of one node's backward part: the timed ``torch.autograd.grad``
        call less the cost of an empty one (:meth:`_empty_grad_call_us`). Where little is
        left (ops whose backward is smaller than a call's start-up), the node's forward time
        — the cost of dispatching that op — is the estimate instead; never more than the raw
        sample. The same on the host clock (CUDA, ``host_fwd`` given; else 0.0)."""
        if not leaves:
            return 0.0, 0.0

        def factory() -> Callable[[], Any]:
            return lambda: torch.autograd.grad(outs, leaves, grads, retain_graph=True,
                                               allow_unused=True)

        host: list[float] = []
        us, _ = time_calls(self.device, factory, self.warmup, self.repeats, self.long_us,
                           None if host_fwd is None else host)
        empty, empty_host = self._empty_grad_call_us()
        h = float(statistics.median(host)) if host else 0.0
        return (max(float(us) - empty, min(fwd_us, float(us))),
                max(h - empty_host, min(host_fwd or 0.0, h)))

    def _empty_grad_call_us(self) -> tuple[float, float]:
        """Median ``(µs, host µs)`` of ``torch.autograd.grad`` through one one-element
        multiply (host 0.0 off CUDA).

        Each node's I and W are timed as separate ``autograd.grad`` calls, but a real
        backward runs every node inside one engine call, so the fixed cost of starting a
        call (about 57 µs on one thread of this project's 2-core CPU, measured: more than
        the backward of most small ops) is taken off each sample. Without this, a stage's
        predicted backward grows with its node count, not its work (measured on an 8-layer
        GPT-2, n_embd 256: 244- and 122-node stages predicted 105 and 102 ms backward,
        run alone 78 and 85 ms).
        """
        if self._grad_call_us is None:
            host: list[float] | None = [] if self.device.type == "cuda" else None
            with torch.enable_grad():
                x = torch.zeros(1, device=self.device, requires_grad=True)
                y = x * 1.0
            ones = torch.ones_like(y)

            def factory() -> Callable[[], Any]:
                return lambda: torch.autograd.grad([y], [x], [ones], retain_graph=True,
                                                   allow_unused=True)

            us, _ = time_calls(self.device, factory, 5, max(self.repeats, 21), host=host)
            self._grad_call_us = (float(us), float(statistics.median(host)) if host else 0.0)
        return self._grad_call_us
