"""Op names (as the captured graph and the cost graph write them, ``str(node.target)``) that
the profiler, codegen and the solver read alike. No torch: the solver imports it."""

from __future__ import annotations

__all__ = ["GROUPED_MM_OPS", "REPEAT_KV_OPS", "VIEW_OPS"]

GROUPED_MM_OPS = frozenset({"aten._grouped_mm.default", "transformers.grouped_mm_fallback.default"})
"""Grouped GEMMs: one matmul per group (expert) in one call; the backward is two of the
forward's size, one per operand, as for a plain matmul."""

REPEAT_KV_OPS = ("aten.unsqueeze.default", "aten.expand.default", "aten.clone.default",
                 ("aten.reshape.default", "aten._unsafe_view.default", "aten.view.default"))
"""transformers' ``repeat_kv`` (grouped-query attention's key / value heads repeated to the
query heads) as ``torch.export`` writes it, from the key heads ``[B, Hk, S, D]`` to the
attention's operand ``[B, Hk n, S, D]``: ``unsqueeze(2)``, ``expand`` to ``[B, Hk, n, S, D]``,
``clone`` (optional), then one of the reshapes. Context parallelism moves the key heads
before it (:mod:`autopart.codegen.context_parallel`) and prices their bytes
(:mod:`autopart.solver.context_parallel_costs`)."""

VIEW_OPS = frozenset({
    "aten.view.default", "aten._unsafe_view.default", "aten.reshape.default",
    "aten.transpose.int", "aten.t.default", "aten.permute.default", "aten.unsqueeze.default",
    "aten.squeeze.dim", "aten.squeeze.default", "aten.slice.Tensor", "aten.select.int",
    "aten.expand.default", "aten.alias.default", "aten.detach.default",
    "aten._assert_tensor_metadata.default", "aten.split.Tensor", "aten.unbind.int",
    "aten.chunk.default", "<built-in function getitem>", "aten.sym_size.int"})
"""Ops that launch no kernel (views, metadata checks, tuple access): the analytical profiler
prices them at 0 µs, and the ``"op"`` recompute policy never keeps their outputs."""
