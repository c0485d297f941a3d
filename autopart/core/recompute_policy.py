"""What a recomputing stage keeps: the recompute policies a plan names, and the ops whose
outputs torch's selective-op policy keeps (read by the solver's cost model on graph nodes
and by codegen on the kernels they dispatch to; no torch import here)."""

from __future__ import annotations

__all__ = ["RECOMPUTE_POLICIES", "CHECKPOINTED_POLICIES", "SELECTIVE_KEPT_NODE_OPS",
           "SELECTIVE_KEPT_KERNELS", "TP_KEPT_NODE_OPS", "op_keepable"]

#: ``"full"``: a recomputing stage keeps its inputs only and runs its whole forward again in
#: its backward (``torch.utils.checkpoint`` around the stage). ``"selective"``: torch's
#: selective activation checkpointing (``torch.utils.checkpoint.create_selective_checkpoint_
#: contexts``) with torchtitan's op policy: the outputs of matmuls, attention and tensor
#: parallelism's reducing collectives are kept, everything else (norms, activations,
#: residual adds, dropout, casts, sequence parallelism's all-gathers) is recomputed.
#: Korthikanti et al. (2022), "Reducing Activation Recomputation in Large Transformer
#: Models", section 4.2, and torchtitan's
#: ``activation_checkpoint.py`` (``mode = "selective"``, ``selective_ac_option = "op"``).
#: One difference from torchtitan: it recomputes every second ``aten.mm`` to save more
#: memory; here every matmul's output is kept. ``"op"``: the same selective checkpointing, but
#: which nodes' outputs a recomputing stage keeps is the solver's choice, per stage and node
#: (``StagePlan.recompute_kept``), under the plan's memory cap (Checkmate's question, Jain et
#: al., MLSys 2020, answered per stage as a knapsack: :mod:`autopart.solver.recompute_choice`);
#: tp's reduced outputs are always kept, as under ``"selective"`` (:data:`TP_KEPT_NODE_OPS`).
RECOMPUTE_POLICIES = ("full", "selective", "op")

#: The policies that run a recomputing stage under torch's selective checkpointing (its
#: dispatch mode, whose own cost per node ``RuntimeDescription.selective_us_per_node`` holds).
CHECKPOINTED_POLICIES = frozenset({"selective", "op"})

#: Graph ops (``NodeCost.op`` of a captured graph) whose outputs ``"selective"`` keeps: the
#: matmul family (they dispatch to the kernels of :data:`SELECTIVE_KEPT_KERNELS`), attention,
#: grouped expert GEMMs and convolutions.
SELECTIVE_KEPT_NODE_OPS = frozenset({
    "aten.linear.default", "aten.mm.default", "aten.addmm.default", "aten.bmm.default",
    "aten.baddbmm.default", "aten.matmul.default", "aten.einsum.default",
    "aten.convolution.default", "aten.conv1d.default", "aten.conv2d.default",
    "aten._convolution.default",
    "aten.scaled_dot_product_attention.default",
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "aten._grouped_mm.default", "transformers.grouped_mm_fallback.default"})

#: Tensor parallelism's forward collectives (``autopart/codegen/_tp_ops.py``) whose outputs
#: ``"selective"`` and ``"op"`` keep, so a recomputed forward does not reduce again: the
#: all-reduce and reduce-scatter after a row matmul, and the all-gather of a vocab-parallel
#: head's logits. Sequence parallelism's all-gathers of token-split values
#: (``tp_seq_gather_split`` before a column matmul, ``tp_seq_gather``) are not kept: the
#: recomputation gathers again, so a recomputing stage holds those values split over tp,
#: as Megatron-LM's sequence-parallel linear keeps its input split and re-gathers it in
#: the backward (Korthikanti et al. 2022, section 4.2.2) and as torchtitan's op policy,
#: which saves reduce-scatters but not all-gathers, runs them.
TP_KEPT_NODE_OPS = frozenset({
    "autopart.tp_reduce.default", "autopart.tp_gather.default",
    "autopart.tp_reduce_scatter.default"})

#: The kernels (``OpOverload`` names as ``str(op)`` prints them) whose outputs the selective
#: policy keeps when a stage runs: what :data:`SELECTIVE_KEPT_NODE_OPS` dispatch to below
#: autograd (``aten.linear`` -> ``aten.mm`` / ``aten.addmm``, ``aten.matmul`` -> ``aten.mm`` /
#: ``aten.bmm``, attention -> the device's fused kernel), plus tp's reducing collectives.
SELECTIVE_KEPT_KERNELS = frozenset({
    "aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.baddbmm.default",
    "aten.convolution.default", "aten._convolution.default",
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "aten._scaled_dot_product_attention_math.default",
    "aten._grouped_mm.default", "transformers.grouped_mm_fallback.default",
    *TP_KEPT_NODE_OPS})


#: Ops whose outputs ``"op"`` never keeps: in-place ops (selective checkpointing cannot hand a
#: written tensor back) and dropout (its kernel also returns a mask the node's output bytes do
#: not count). Views are left out by :func:`op_keepable` as well: keeping one keeps its base.
_NEVER_KEPT = frozenset({"aten.dropout.default", "aten.native_dropout.default",
                         "aten.feature_dropout.default", "aten.alpha_dropout.default"})


def op_keepable(op: str, view_ops: frozenset[str]) -> bool:
    """Whether ``"op"`` may keep the output of a node calling ``op`` (``NodeCost.op``, e.g.
    ``"aten.gelu.default"``): not a view (``view_ops``:
    :data:`autopart.core.op_names.VIEW_OPS`), not in place (``"aten.add_.Tensor"``, an
    ``out=`` variant), not dropout."""
    name = op.split(".")[1] if op.count(".") >= 2 else op
    return (op not in view_ops and op not in _NEVER_KEPT and not name.endswith("_")
            and not op.endswith(".out"))
