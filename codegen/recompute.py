"""Recomputation that leaves a stage's buffers as the forward left them: the whole forward
again (``"full"``), or what torch's selective activation checkpointing does not keep
(``"selective"``, :func:`selective_policy`; ``"op"``, :func:`op_policy`, keeping the nodes
:func:`mark_kept` marked in the stage's graph)."""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Callable, Collection, Iterator
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils.checkpoint import (
    SAC_IGNORED_OPS,
    CheckpointPolicy,
    SelectiveCheckpointContext,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from autopart.core.errors import PlanError
from autopart.core.op_names import VIEW_OPS
from autopart.core.recompute_policy import (
    RECOMPUTE_POLICIES,
    SELECTIVE_KEPT_KERNELS,
    TP_KEPT_NODE_OPS,
)

__all__ = ["written_by", "written_buffers", "recompute_context", "selective_policy",
           "selective_context", "mark_kept", "keeps_any", "op_policy", "check_recompute_policy",
           "run_recomputed"]

ContextFn = Callable[[], tuple[contextlib.AbstractContextManager[Any],
                               contextlib.AbstractContextManager[Any]]]


def written_by(node: fx.Node) -> list[fx.Node]:
    """The nodes whose values ``node`` writes in place: the arguments its op's schema marks
    mutable (``copy_``'s ``self``, BatchNorm's running statistics); ``[]`` for a node that is
    no ``call_function`` of a schema'd op."""
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None:
        return []
    out = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        src = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
        if isinstance(src, fx.Node):
            out.append(src)
    return out


def written_buffers(stage: nn.Module) -> list[torch.Tensor]:
    """The ``get_attr`` tensors that the stage's ops write in place (their schema says so).

    ``stage`` is a stage's ``fx.GraphModule`` or ``torch.compile`` of one; any other module
    has none found.

    After capture these are the buffers a model updates while it runs: BatchNorm's running
    statistics (``_native_batch_norm_legit``) and ``num_batches_tracked`` (``add_``), or a
    ``copy_`` into any other buffer (see ``autopart.core.capture``).
    """
    stage = getattr(stage, "_orig_mod", stage)
    if not isinstance(stage, fx.GraphModule):
        return []
    found: dict[int, torch.Tensor] = {}
    for node in stage.graph.nodes:
        for src in written_by(node):
            if src.op == "get_attr":
                value: Any = stage
                for part in str(src.target).split("."):
                    value = getattr(value, part)
                if isinstance(value, torch.Tensor):
                    found[id(value)] = value
    return list(found.values())


def recompute_context(stage: nn.Module) -> ContextFn:
    """``context_fn`` for ``torch.utils.checkpoint`` (non-reentrant) around ``stage``.

    A recomputed stage runs its forward twice. Left alone, the second run would update
    BatchNorm's running statistics (and any other buffer the stage writes) a second time,
    and would read the buffers as later microbatches left them. Each call of the returned
    function (checkpoint makes one per forward) gives a forward context that copies the
    written buffers as this microbatch's forward finds them, and a recomputation context
    that sets the buffers to that copy, runs, and puts back the values they had. So the
    recomputed forward sees what the first one saw (its outputs and saved tensors are the
    same), and the buffers end as they would without recompute. A stage that writes no
    buffer gets two no-op contexts. Memory: one copy of the written buffers per
    microbatch in flight.
    """
    buffers = written_buffers(stage)

    def context_fn() -> tuple[contextlib.AbstractContextManager[Any],
                              contextlib.AbstractContextManager[Any]]:
        if not buffers:
            return contextlib.nullcontext(), contextlib.nullcontext()
        seen: list[torch.Tensor] = []

        @contextlib.contextmanager
        def forward() -> Iterator[None]:
            seen[:] = [b.detach().clone() for b in buffers]
            yield

        @contextlib.contextmanager
        def recompute() -> Iterator[None]:
            now = [b.detach().clone() for b in buffers]
            with torch.no_grad():
                for b, v in zip(buffers, seen, strict=True):
                    b.copy_(v)
            try:
                yield
            finally:
                with torch.no_grad():
                    for b, v in zip(buffers, now, strict=True):
                        b.copy_(v)

        return forward(), recompute()

    return context_fn


def selective_policy(ctx: SelectiveCheckpointContext, func: Any, *args: Any,
                     **kwargs: Any) -> CheckpointPolicy:
    """The ``"selective"`` policy's answer for one kernel the recomputed stage dispatches:
    ``MUST_SAVE`` (keep its output, never run it again) for the kernels of
    :data:`autopart.core.recompute_policy.SELECTIVE_KEPT_KERNELS` (matmuls, attention, tp's
    reducing collectives; ``str(func)``, e.g. ``"aten.mm.default"``,
    ``"autopart.tp_reduce.default"``), ``PREFER_RECOMPUTE`` for every other (norms,
    activations, adds, dropout, casts, views, and sequence parallelism's all-gathers, which
    the recomputation runs again)."""
    del ctx, args, kwargs
    return _policy_of(func)


@functools.cache
def _policy_of(func: Any) -> CheckpointPolicy:
    """:func:`selective_policy`'s answer by kernel, kept: it is asked for every kernel of
    every forward and recomputation, and ``str`` of an ``OpOverload`` builds a new string."""
    if str(func) in SELECTIVE_KEPT_KERNELS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def selective_context(stage: nn.Module,
                      policy: Callable[..., CheckpointPolicy] = selective_policy) -> ContextFn:
    """``context_fn`` for ``torch.utils.checkpoint`` (non-reentrant) running ``stage`` under
    torch's selective activation checkpointing with ``policy`` (default
    :func:`selective_policy`; :func:`op_policy` for ``"op"``), its written buffers handled
    as :func:`recompute_context` handles them.

    Each call gives a forward context and a recomputation context, each the buffer context
    (outer: its copies and restores are not ops the selective cache records or replays)
    around the selective one (a ``TorchDispatchMode`` that records the kept outputs in the
    forward, and hands them back instead of running their kernels in the recomputation).
    """
    buffers = recompute_context(stage)

    def context_fn() -> tuple[contextlib.AbstractContextManager[Any],
                              contextlib.AbstractContextManager[Any]]:
        forward_buffers, recompute_buffers = buffers()
        forward_sac, recompute_sac = create_selective_checkpoint_contexts(policy)
        return _Nested(forward_buffers, forward_sac), _Nested(recompute_buffers, recompute_sac)

    return context_fn


#: Per thread, the marked (kept) node running now: ``keep_at``, the index (among its keepable
#: kernels) of the one whose output is kept, and ``count``, how many of them have run (the
#: one-process runtime issues stages from several threads). ``keep_at`` is -1 outside,
#: :data:`_EVERY` in a node whose every keepable kernel is kept.
_KEEPING = threading.local()
_EVERY = -2


def _keeping(op: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``op`` wrapped so that :func:`op_policy` keeps the output of the last keepable kernel
    (neither a view nor in place: :func:`_keepable_kernel`) it dispatches, the one that
    returns the node's output, and runs the others again.

    A node may dispatch several kernels: ``scaled_dot_product_attention`` with a boolean mask
    first turns the mask into a float one (``aten.where``, ``L x L x 4`` bytes per head group),
    ``matmul`` of broadcast operands copies them. Keeping those too held 8 MiB per
    microbatch more than the node's output on a 2-layer Llama stage (hidden 256, 1024
    tokens), which the solver does not price (``KeepItem.nbytes`` is the node's output).
    Which kernel is last is known only once the node has run, and the policy answers before
    each kernel runs, so the first call with given argument shapes runs the node once more,
    apart (:func:`_last_keepable`); forward and recomputation then count the same kernels.
    Only aten ops are run apart: a node codegen wrote (tp's, cp's and ep's, which issue
    collectives) keeps every keepable kernel it dispatches, as before.
    A plain function of this module, so the stage's generated code calls the wrapper rather
    than the op it names."""
    last: dict[Any, int] = {}
    aten = isinstance(op, torch._ops.OpOverload) and op.namespace == "aten"

    def kept(*args: Any, **kwargs: Any) -> Any:
        if not aten:
            keep_at = _EVERY
        else:
            key = _signature(args, kwargs)
            if key not in last:
                last[key] = _last_keepable(op, args, kwargs)
            keep_at = last[key]
        outer = (getattr(_KEEPING, "keep_at", -1), getattr(_KEEPING, "count", 0))
        _KEEPING.keep_at, _KEEPING.count = keep_at, 0
        try:
            return op(*args, **kwargs)
        finally:
            _KEEPING.keep_at, _KEEPING.count = outer

    kept.__name__ = kept.__qualname__ = f"kept_{name}"
    kept.kept_op = op  # type: ignore[attr-defined]
    return kept


def _signature(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """What decides the kernels a node dispatches: its tensors' shapes, strides, dtypes,
    devices and ``requires_grad``, and its other arguments."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    return (str(spec), *((tuple(x.shape), x.stride(), x.dtype, x.device, x.requires_grad)
                         if isinstance(x, torch.Tensor) else repr(x) for x in leaves))


class _Kernels(TorchDispatchMode):
    """Counts the keepable kernels dispatched under it, as :func:`op_policy` sees them."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if func not in SAC_IGNORED_OPS and _keepable_kernel(func):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _last_keepable(op: Callable[..., Any], args: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> int:
    """The index, among the keepable kernels ``op(*args, **kwargs)`` dispatches, of the last;
    -1 where there is none. ``op`` runs apart from the checkpoint: outside the dispatch modes
    active now, on detached copies of the tensors (each requiring a gradient where the
    original does, as kernel choices may depend on it), under saved-tensor hooks of its own
    that keep nothing for the checkpoint, with the random state it started from restored
    after it (a random op draws the same values in the forward that follows)."""
    def detached(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        return x.detach().requires_grad_(x.requires_grad)

    args, kwargs = pytree.tree_map(detached, (args, kwargs))
    cuda = sorted({x.device.index or 0 for x in pytree.tree_leaves((args, kwargs))
                   if isinstance(x, torch.Tensor) and x.device.type == "cuda"})
    counter = _Kernels()
    with (torch.random.fork_rng(devices=cuda), _disable_current_modes(),
          torch.autograd.graph.saved_tensors_hooks(_same, _same), counter):
        op(*args, **kwargs)
    return counter.count - 1


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def mark_kept(stage: nn.Module, names: Collection[str]) -> int:
    """Mark the nodes ``names`` (FX names of the captured graph) of ``stage`` and of every
    graph module inside it (per-layer units) as kept under ``"op"``: each such node's op is
    wrapped (:func:`_keeping`) so that :func:`op_policy` keeps the outputs of the kernels it
    dispatches. Nodes that write in place are left alone (the solver never keeps them:
    :func:`autopart.core.recompute_policy.op_keepable`), as are names the stage does not
    have. The graphs are recompiled. Returns how many nodes were marked."""
    wanted = set(names)
    marked = 0
    for mod in stage.modules():
        if not isinstance(mod, fx.GraphModule):
            continue
        changed = False
        for node in mod.graph.nodes:
            if (node.op == "call_function" and node.name in wanted and not written_by(node)
                    and not hasattr(node.target, "kept_op")):
                node.target = _keeping(node.target, node.name)
                changed = True
                marked += 1
        if changed:
            mod.recompile()
    return marked


_KEEPS_ANY: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()


def keeps_any(stage: nn.Module) -> bool:
    """Whether ``stage`` (a recomputed stage under ``"op"``) keeps any output: a node
    :func:`mark_kept` marked, or one of tp's reductions
    (:data:`autopart.core.recompute_policy.TP_KEPT_NODE_OPS`), in it or in a graph module
    inside it. Read once per stage (the marks are made when the stages are built)."""
    if stage not in _KEEPS_ANY:
        _KEEPS_ANY[stage] = any(
            node.op == "call_function" and (hasattr(node.target, "kept_op")
                                            or str(node.target) in TP_KEPT_NODE_OPS)
            for mod in stage.modules() if isinstance(mod, fx.GraphModule)
            for node in mod.graph.nodes)
    return _KEEPS_ANY[stage]


def op_policy(ctx: SelectiveCheckpointContext, func: Any, *args: Any,
              **kwargs: Any) -> CheckpointPolicy:
    """The ``"op"`` policy's answer for one kernel a recomputed stage dispatches:
    ``MUST_SAVE`` for tp's reducing collectives (as under ``"selective"``) and, in a node
    :func:`mark_kept` marked, for the last kernel that is neither a view nor in place (a kept
    ``linear`` of a 3-D input keeps its ``mm``'s output, not the input's reshaped view, which
    would hold the unkept input; a kept attention its attention kernel's, not the float
    mask it made first: :func:`_keeping`); ``PREFER_RECOMPUTE`` for every other."""
    del ctx, args, kwargs
    keep_at = getattr(_KEEPING, "keep_at", -1)
    if keep_at != -1 and func not in SAC_IGNORED_OPS and _keepable_kernel(func):
        index = _KEEPING.count
        _KEEPING.count = index + 1
        if index == keep_at or keep_at == _EVERY:
            return CheckpointPolicy.MUST_SAVE
    return _op_policy_of(func)


@functools.cache
def _keepable_kernel(func: Any) -> bool:
    """Not a view (``is_view``, or one of :data:`autopart.core.op_names.VIEW_OPS` such as
    ``_unsafe_view``, which aliases without saying so) and not in place."""
    schema = getattr(func, "_schema", None)
    return (not getattr(func, "is_view", False) and str(func) not in VIEW_OPS
            and not (schema is not None and schema.is_mutable))


@functools.cache
def _op_policy_of(func: Any) -> CheckpointPolicy:
    if str(func) in TP_KEPT_NODE_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


class _Nested:
    """``contexts`` entered in order (the first outermost) and left in reverse, each time
    it is entered (checkpoint enters its recomputation context once per recomputation)."""

    def __init__(self, *contexts: contextlib.AbstractContextManager[Any]) -> None:
        self._contexts = contexts
        self._stacks: list[contextlib.ExitStack] = []

    def __enter__(self) -> None:
        stack = contextlib.ExitStack()
        with stack:
            for context in self._contexts:
                stack.enter_context(context)
            self._stacks.append(stack.pop_all())

    def __exit__(self, *exc: Any) -> bool | None:
        return self._stacks.pop().__exit__(*exc)


def check_recompute_policy(policy: str) -> str:
    """``policy``, checked.

    Raises:
        PlanError: ``policy`` is not one of
            :data:`autopart.core.recompute_policy.RECOMPUTE_POLICIES`.
    """
    if policy not in RECOMPUTE_POLICIES:
        raise PlanError(f"recompute policy {policy!r} is not one of {RECOMPUTE_POLICIES}; "
                        "a plan's recompute_policy names one of them")
    return policy


def run_recomputed(stage: nn.Module, *args: Any, runner: Callable[..., Any] | None = None,
                   policy: str = "full") -> Any:
    """``runner(*args)`` (default ``stage(*args)``) under non-reentrant
    ``torch.utils.checkpoint``, so that backward runs the forward again, with
    :func:`recompute_context` of ``stage`` (a recomputed forward sees and leaves the buffers
    as the first one did). Both runtimes run a stage the plan marks ``recompute`` this way
    when gradients are on, with the plan's ``recompute_policy``.

    Random ops (dropout) draw the same values in the recomputation: checkpoint restores the
    CPU and device RNG states the forward started from (``preserve_rng_state``), under
    either policy. Under ``"selective"`` the backward may run once per forward: a second
    pass (``retain_graph``, a split ``I`` + ``W``) raises torch's "Trying to backward an
    extra time"; the schedules give a recomputing stage a whole ``B``
    (:func:`autopart.core.schedule.splits_backward`).

    With ``runner`` a ``torch.compile`` of the stage, the selective policy sees the kernels
    Inductor's code calls: its matmuls are ``out=`` variants (``aten.addmm.out``), which the
    policy does not keep (a kept output cannot fill the buffer a recomputation passes), so
    they run again as under ``"full"``; attention that falls back to aten's kernel is kept.
    The numerics are those of the compiled stage either way.

    Args:
        stage: the stage's module (its written buffers are found on it).
        *args: the stage's inputs.
        runner: what computes the stage: ``stage`` itself or ``torch.compile`` of it.
        policy: one of :data:`autopart.core.recompute_policy.RECOMPUTE_POLICIES`. ``"full"``
            (default): only the inputs are kept and the whole forward runs again;
            ``"selective"``: the outputs of the kernels :func:`selective_policy` keeps
            (matmuls, attention, tp's reductions) are kept too, and only the rest runs
            again (:func:`selective_context`); ``"op"``: the outputs of the nodes
            :func:`mark_kept` marked in the stage (the plan's ``recompute_kept``) and of tp's
            reductions are kept (:func:`op_policy`); a stage keeping none of them
            (:func:`keeps_any`) runs as under ``"full"``, without selective checkpointing's
            cost per kernel, as the solver prices it
            (``CostModel.checkpoints_selectively``).

    Returns:
        What ``runner(*args)`` returns, with gradients through it.

    Raises:
        PlanError: ``policy`` is not one of ``RECOMPUTE_POLICIES``.
    """
    check_recompute_policy(policy)
    context_fn = (selective_context(stage) if policy == "selective"
                  else selective_context(stage, op_policy) if policy == "op" and keeps_any(stage)
                  else recompute_context(stage))
    return checkpoint(stage if runner is None else runner, *args, use_reentrant=False,
                      context_fn=context_fn)
