"""What torch.export cannot keep, as a TraceError: a failed export's message names the model
line and the fix; a custom ``autograd.Function`` whose backward the graph would not follow is
refused."""

from __future__ import annotations

import contextlib
import linecache
import os
import traceback
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
import torch.utils._pytree as pytree
from torch import nn

from autopart.core.errors import TraceError

__all__ = ["IN_CUSTOM_FUNCTION", "trace_error", "custom_functions_applied",
           "check_custom_backward"]

#: The ``node.meta["custom"]`` key naming the custom ``autograd.Function`` a node was traced in.
IN_CUSTOM_FUNCTION = "autopart.custom_autograd_function"


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


def trace_error(exc: BaseException) -> TraceError:
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


@contextlib.contextmanager
def custom_functions_applied(seen: list[type]) -> Iterator[None]:
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
        # detach_grad_disabled_regions leaves its forward's no-grad regions differentiable
        with fx_traceback.annotate({IN_CUSTOM_FUNCTION: cls.__qualname__}):
            return original.__func__(cls, *args, **kwargs)

    base.apply = classmethod(apply)  # type: ignore[assignment,method-assign]
    try:
        yield
    finally:
        base.apply = original  # type: ignore[method-assign]


def check_custom_backward(model: nn.Module, gm: fx.GraphModule, args: tuple[Any, ...],
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
