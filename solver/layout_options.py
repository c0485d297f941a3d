"""LayoutOptions and LayoutCandidate: what a (tp, pp, dp, ZeRO) layout search is asked, and
one layout with its bounds."""

from __future__ import annotations

from dataclasses import dataclass

from autopart.core.errors import PlanError
from autopart.core.layout import check_degrees, check_tp, check_zero_stage
from autopart.core.plan_rules import CP_ATTENTIONS
from autopart.core.topology import HostTopology

__all__ = ["LayoutOptions", "LayoutCandidate"]


@dataclass(frozen=True, slots=True, kw_only=True)
class LayoutOptions:
    """The 3D part of a request (keyword-only); ``None`` = the search chooses.

    Attributes:
        num_gpus: GPUs in the cluster (tp x pp x dp).
        topology: hosts and links (:class:`autopart.core.topology.HostTopology`).
        tp, pp, dp: fixed degrees, or None.
        zero_stage: fixed ZeRO stage 0-3, or None (the search tries 0-3 where dp > 1).
        num_heads: the model's attention heads (a tp must divide them); None = not checked.
        gradient_factor: gradient bytes per parameter byte (1.0: gradients in the
            parameters' dtype; 2.0: fp32 gradients of bf16 weights).
        max_layouts: at most this many layouts get a screening solve (best bound first)
            (default 64).
        refine: how many of the best screened layouts are solved again with the request's
            full pipeline search (default 3: the screening solves 1F1B, and a layout whose
            split-backward plan wins can screen third; 175B on 3072 H100s: ZeRO-1's ZB-H1
            plan, 5.63 s, screened at 5.932 s behind two layouts within 0.3 %).
        cpsat_budget: CP-SAT deterministic time each refined layout's pipeline search may
            spend, shared evenly by the (kind, v, m) subproblems it refines (at most
            ``SolveOptions.max_cpsat_solves``), each also at most the request's
            ``deterministic_time`` (default 4.0: 0.5 each for 8; on this project's 2-core
            CPU one unit took about 1.2 s). Deterministic, so a search gives the same plan
            twice; it keeps a search of thousands of GPUs under a minute.
        microbatch_sizes: rows per microbatch to search (Megatron-LM's ``micro-batch-size``):
            each layout searches ``m = batch / dp / size`` for the sizes that divide a
            replica's batch; None (default) = ``options``' microbatch counts.
        overlap_grad_reduce: ZeRO-0 layouts all-reduce gradients in buckets during each
            stage's last backward, priced on the schedule's tail
            (:func:`autopart.solver.data_parallel.overlapped_reduction_us`) and recorded in
            the plan for the runtime (default True, as Megatron-LM's
            ``--overlap-grad-reduce``, DDP and torchtitan run). False: after the pipeline
            flush, none of it overlapped (Megatron-LM's SC'21 runtime, as
            ``benchmarks/megatron_table`` checks it).
        zero_layer_units: ZeRO 1-3 layouts shard each layer of a stage as its own FSDP unit
            (default True, as torchtitan runs FSDP2 per transformer block), priced with the
            layers gathered one at a time (:func:`autopart.solver.data_parallel.
            layer_unit_factors`) and recorded in the plan (``Plan.zero_layer_units``); a
            plan whose schedule splits its backwards runs one unit per stage and is priced
            so. ZeRO-1's units hold what its whole-stage unit holds and only overlap better,
            so a runtime whose collectives share the ranks' compute (CPU ranks) keeps one
            unit per stage at ZeRO-1. False: one unit per stage everywhere.
        sequence_parallel: tp > 1 layouts run Megatron-LM's sequence parallelism (the
            token-wise work between tp pairs on 1/tp of the tokens, reduce-scatters and
            all-gathers in place of tp's all-reduces), priced so
            (:func:`autopart.solver.tensor_parallel_costs.shard_costs`) and recorded in the plan
            (``Plan.sequence_parallel``). Default False: those run whole on every tp GPU.
        ep: expert-parallel degree (default 1): only layouts whose dp it divides, with tp 1
            (what the runtime runs with ep > 1; ZeRO shards the dense parameters and leaves
            the experts whole, ``SolveOptions.whole_state_params``), and the plan records it
            (``Plan.ep``), priced by :func:`autopart.solver.expert_parallel_costs.
            expert_costs` (each GPU's experts, the dispatch and combine all-to-alls). None:
            searched with the rest, among 1 and the divisors of dp that divide
            ``num_experts`` (tp 1 where ep > 1), for a model with experts.
        num_experts: experts per MoE layer (an ep must divide it), or None (unknown: a
            searched ep stays 1).
        cp: context-parallel degree (default 1): the GPUs are tp x pp x dp x cp, each
            sequence split over cp of them (``Plan.cp``), priced by
            :func:`autopart.solver.context_parallel_costs.context_costs` (the attention over
            the gathered keys, the all-gathers and reduce-scatters, the gathered keys held);
            gradients are reduced and ZeRO shards over the dp x cp GPUs of a dp line. None:
            searched with the rest among 1 and the divisors of the GPU count that divide
            ``max_cp`` (the tokens per sequence over two, so each rank gets two chunks).
        max_cp: the largest cp the sequence allows (S / 2), or None (unknown: a searched cp
            stays 1).
        causal_attention: the model's attention is causal (decoders; default True) or over
            the whole sequence (encoders), as cp prices it.
        cp_tokens_profiled: the costs are already one cp rank's, of the model captured at
            S / cp tokens (``autopart.compile`` profiles it there); default False: the costs
            are of whole sequences, split by cp (:func:`autopart.solver.
            context_parallel_costs.split_tokens`). True needs a fixed cp.
        cp_attention: how attention spans the cp GPUs (``Plan.cp_attention``):
            ``"all_gather"`` or ``"ulysses"``; None (the default): both priced where they
            apply, the better kept. Ulysses applies where tp x cp divides
            ``attention_heads``.
        attention_heads: the head count every attention's queries and keys share (the
            greatest common divisor of theirs), or None: ``num_heads``; neither known:
            Ulysses is not searched.
        cp_attention_factors: ``(cp_attention, forward, backward)``: the runtime's attention
            at the fixed cp over the model's own on the profiled shapes, measured
            (:func:`autopart.profiler.context_attention.measure_context_attention`), which
            :func:`autopart.solver.context_parallel_costs.context_costs` prices in place of
            its block count (default none: the block count). Needs ``cp_tokens_profiled``.
    """

    num_gpus: int
    topology: HostTopology
    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    zero_stage: int | None = None
    num_heads: int | None = None
    gradient_factor: float = 1.0
    max_layouts: int = 64
    refine: int = 3
    cpsat_budget: float = 4.0
    microbatch_sizes: tuple[int, ...] | None = None
    overlap_grad_reduce: bool = True
    zero_layer_units: bool = True
    sequence_parallel: bool = False
    ep: int | None = 1
    num_experts: int | None = None
    cp: int | None = 1
    max_cp: int | None = None
    causal_attention: bool = True
    cp_tokens_profiled: bool = False
    cp_attention: str | None = None
    attention_heads: int | None = None
    cp_attention_factors: tuple[tuple[str, float, float], ...] = ()

    def __post_init__(self) -> None:
        if self.num_gpus < 1:
            raise PlanError(f"num_gpus={self.num_gpus} must be >= 1")
        if self.zero_stage is not None:
            check_zero_stage(self.zero_stage)
        if self.tp is not None:
            check_tp(self.tp, gpus_per_host=self.topology.gpus_per_host,
                     num_heads=self.num_heads)
        for name in ("pp", "dp"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise PlanError(f"{name}={value} must be >= 1 or None")
        if self.tp and self.pp and self.dp and self.cp and self.num_gpus % self.cp == 0:
            # one cp rank's share of the GPUs is tp x pp x dp (cp searched: not known yet)
            check_degrees(self.tp, self.pp, self.dp, self.num_gpus // self.cp)
        if self.ep is not None and self.ep < 1:
            raise PlanError(f"ep={self.ep} must be >= 1 or None (searched)")
        if self.num_experts is not None and self.num_experts < 1:
            raise PlanError(f"num_experts={self.num_experts} must be >= 1 or None")
        if self.ep is not None and self.ep > 1 and (
                (self.tp or 1) > 1 or (self.dp is not None and self.dp % self.ep)):
            raise PlanError(f"ep={self.ep} with tp={self.tp} and dp={self.dp}: expert "
                            "parallelism runs with tp=1 and a dp that ep divides; fix those, "
                            "or drop ep")
        if (self.cp is not None and self.cp < 1) or (self.cp_tokens_profiled and self.cp is None):
            raise PlanError(f"cp={self.cp} must be >= 1, or None (searched) on costs of whole "
                            "sequences (cp_tokens_profiled=False)")
        if self.cp_attention_factors and not (self.cp_tokens_profiled and all(
                k in CP_ATTENTIONS and f > 0 and b > 0 for k, f, b in self.cp_attention_factors)):
            raise PlanError(f"cp_attention_factors={self.cp_attention_factors} must be "
                            f"(attention in {CP_ATTENTIONS}, forward > 0, backward > 0) "
                            "triples, measured on costs of one cp rank's tokens "
                            "(cp_tokens_profiled=True)")
        if self.cp_attention not in (None, *CP_ATTENTIONS):
            raise PlanError(f"cp_attention={self.cp_attention!r}: expected one of "
                            f"{CP_ATTENTIONS}, or None (searched)")
        if (self.cp or 1) > 1 and (self.ep or 1) > 1:
            raise PlanError(f"cp={self.cp} with ep={self.ep}: context and expert parallelism do "
                            "not run together yet; fix one of them to 1")
        if self.microbatch_sizes is not None and (not self.microbatch_sizes
                                                  or min(self.microbatch_sizes) < 1):
            raise PlanError(f"microbatch_sizes={self.microbatch_sizes} must be sizes >= 1 or None")
        if self.gradient_factor <= 0 or self.max_layouts < 1 or self.refine < 0 \
                or not self.cpsat_budget > 0:
            raise PlanError(f"gradient_factor={self.gradient_factor} must be > 0, "
                            f"max_layouts={self.max_layouts} >= 1, refine={self.refine} >= 0 "
                            f"and cpsat_budget={self.cpsat_budget} > 0")


@dataclass(frozen=True, slots=True)
class LayoutCandidate:
    """One (tp, pp, dp, zero) layout with its lower bounds.

    Attributes:
        tp, pp, dp, zero_stage: the degrees.
        ep: the expert-parallel degree (default 1).
        cp: the context-parallel degree (default 1): tp x pp x dp x cp GPUs.
        cp_attention: how attention spans the cp GPUs (``Plan.cp_attention``).
        step_lb_us: no plan of this layout is faster: its compute and its smallest
            stage-to-stage sends spread evenly over pp ranks (no bubble, no recompute) plus the
            dp collectives of an even share of the parameters, µs.
        state_lb_bytes: no rank of it holds less parameter state, bytes.
        estimate_us: the bound with a 1F1B bubble, ``(m + pp - 1) / m`` on the compute: the
            order layouts are screened in (not a bound), µs.
    """

    tp: int
    pp: int
    dp: int
    zero_stage: int
    step_lb_us: float
    state_lb_bytes: int
    estimate_us: float = 0.0
    ep: int = 1
    cp: int = 1
    cp_attention: str = "all_gather"
