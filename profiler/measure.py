"""profile_graph: run a captured graph node by node and measure each op's time, bytes and FLOPs."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.fx as fx

from autopart.codegen.expert_parallel import find_expert_blocks
from autopart.core.capture import CapturedGraph
from autopart.core.capturedgraph import buffer_update_cuts
from autopart.core.costgraph import CostGraph
from autopart.core.errors import PlanError, ProfileError
from autopart.profiler._oputil import MeasureReport, causal_attention
from autopart.profiler._walker import Progress, _Walker
from autopart.profiler.blocks import repeated_blocks
from autopart.profiler.meters import tree_nbytes
from autopart.profiler.timer import RngState, check_device

__all__ = ["profile_graph", "profile_graph_report", "MeasureReport"]



def profile_graph(captured: CapturedGraph, flat_inputs: list[Any], *, device: str = "cpu",
                  training: bool = True, warmup: int = 1, repeats: int = 3,
                  long_call_us: float = 50_000.0, reuse_repeated_blocks: bool = True,
                  progress: Progress | None = None) -> CostGraph:
    """Measure every op node of a captured graph on one device.

    :func:`profile_graph_report` without the report; the arguments are the same.
    """
    return profile_graph_report(captured, flat_inputs, device=device, training=training,
                                warmup=warmup, repeats=repeats, long_call_us=long_call_us,
                                reuse_repeated_blocks=reuse_repeated_blocks,
                                progress=progress)[0]



def profile_graph_report(captured: CapturedGraph, flat_inputs: list[Any], *,
                         device: str = "cpu", training: bool = True, warmup: int = 1,
                         repeats: int = 3, long_call_us: float = 50_000.0,
                         reuse_repeated_blocks: bool = True, progress: Progress | None = None,
                         ) -> tuple[CostGraph, MeasureReport]:
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
      the instrumented forward took ``long_call_us`` or more, one plain call is the one
      sample (the instrumented call, slowed by its hooks and by touching fresh memory,
      never is).
    - ``bwd_input_us`` / ``bwd_weight_us`` (when ``training``):
      ``torch.autograd.grad(outputs, leaves, ones, retain_graph=True)`` on that forward's
      graph, timed like the forward (after a first call of ``long_call_us`` or more, one
      more call is the one sample), once w.r.t. the input aliases and once w.r.t. the parameter aliases: Zero
      Bubble's split of B into I and W. Nodes whose outputs need no gradient get 0.
      Parameters' ``.grad`` are never touched.
    - ``host_fwd_us`` / ``host_bwd_input_us`` / ``host_bwd_weight_us`` (on CUDA only; None
      on the CPU, where the host runs the ops): the same calls' host issue times,
      ``time.perf_counter`` around each call with no synchronize inside, the backward's less
      an empty ``autograd.grad`` call's as for the device times. The device times on CUDA
      then leave out the host's launch gaps: the timed calls are queued behind a wait on
      the device (:func:`autopart.profiler.timer.time_samples`).
    - ``saved_bytes`` (when ``training``, else 0): storages autograd packs during the
      instrumented forward, each storage once at its full ``nbytes`` (a saved view keeps
      its base alive), storages of the parameters and buffers the node reads excluded;
      saved inputs and outputs count, since the backward keeps them alive. A storage
      saved by two nodes (relu's output, saved by relu and the next linear) counts once,
      in the first, while it stays alive; so the sum over a graph (or over its first nodes)
      is what autograd keeps for the same forward.
    - ``transient_bytes`` (when ``training``): nbytes of the outputs that need a gradient
      plus of the inputs that do: the gradients live while its backward runs.
    - ``flops``: ``FlopCounterMode`` over the instrumented forward (torch's formulas plus
      CPU fused attention; attention run with ``is_causal`` counts the pairs it keeps,
      ``_oputil.causal_fraction``; ops without a formula count 0). ``bytes_accessed``: nbytes of
      the tensor inputs
      (parameters included) plus the outputs — a first-order estimate that ignores caches
      and counts views as if they were read.
    - ``output_bytes``: nbytes of the returned tensor(s); ``param_bytes``: bytes of the
      parameters and buffers this node is the first in topological order to read.

    Repeated layers (``reuse_repeated_blocks``): the nodes of the second and later layers
    that :func:`autopart.profiler.blocks.repeated_blocks` finds identical to an earlier one
    run once, for their values, and take that layer's timings, FLOPs and bytes.

    Side effects: buffers, frozen parameters and constants go into every op as per-node
    clones (``aten.batch_norm`` updates running stats without a schema write). Ops whose
    schema writes to an argument (``copy_``, ``add_``, ``relu_``) run on clones of those
    arguments in every timed call; the value the rest of the graph sees comes from one
    more call, where arguments backed by the model's or the caller's tensors are cloned
    first. Profiling therefore leaves parameters, buffers, ``.grad``,
    the inputs and the CPU (and CUDA) random state as they were. Device literals in the
    graph (``arange(device=...)``, ``to(device=...)``) are rewritten to ``device``.

    Args:
        captured: the graph from :func:`autopart.core.capture.capture`.
        flat_inputs: one value per placeholder, e.g. ``captured.flatten_inputs(args, kwargs)``.
        device: ``"cpu"`` or ``"cuda:N"``; tensors elsewhere are copied there for profiling.
        training: also measure the backward and the saved activations.
        warmup: untimed calls before the timed ones (>= 0).
        repeats: timed calls per measurement (>= 1); the median is kept.
        long_call_us: µs from which a single call is the sample (as ``timeit``'s
            autorange; big CPU matmuls). ``math.inf`` always times ``warmup + repeats``.
        reuse_repeated_blocks: measure one layer of each kind of repeated layer.
        progress: called as ``progress(done, total)`` after each op node.

    Returns:
        ``(costs, report)``: the CostGraph, ``source="measured:<device>"``, ``bwd_source`` ``"measured"``
        (``"none"`` when not training; ``"estimated:..."`` naming the nodes' count when
        some backward could not run and was set to 2 x forward, split evenly), and the
        :class:`MeasureReport`.

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
        if reuse_repeated_blocks:
            walker.reuse = repeated_blocks(captured.graph_module)
        walker.progress = progress
        walker.watch = _routing_ids(graph)
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
        fingerprint=captured.fingerprint, profile_wall_s=time.perf_counter() - start,
        no_cut=buffer_update_cuts(captured.graph_module.graph),
        causal_attention=causal_attention(captured.graph_module.graph),
        expert_tokens=tuple(sorted(walker.expert_tokens.items())),
    ), walker.report


def _routing_ids(graph: fx.Graph) -> dict[fx.Node, tuple[str, int]]:
    """Each MoE layer's top-k expert ids node -> (its experts module path, its experts),
    as expert parallelism reads the layer (``autopart.codegen.expert_parallel``); none for
    a dense model or one whose experts that pass cannot read."""
    try:
        blocks = find_expert_blocks(graph)
    except PlanError:
        return {}
    return {b.index: (b.path, b.num_experts) for b in blocks}
