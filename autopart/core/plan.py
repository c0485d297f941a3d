"""Plan: the solver's decision and the file users keep, diff and replay (JSON, validated on load)."""

from __future__ import annotations

import json
import os
import reprlib
from dataclasses import asdict, dataclass, field
from typing import Any

from autopart.core.errors import PlanError
from autopart.core.jsonio import dumps, write_text_atomic
from autopart.core.layout import layout_problem
from autopart.core.plan_records import (
    BaselineReport,
    Cut,
    LowerBounds,
    ParetoPoint,
    RankPlan,
    ShardedParameter,
    SolverReport,
    StagePlan,
    build_record,
    check_fields,
    listed,
    record_kwargs,
    unique_keys,
)
from autopart.core.plan_rules import (
    CP_ATTENTIONS,
    FIX,
    OPTIMIZE_TARGETS,
    PLAN_SCHEMA_VERSION,
    READABLE_SCHEMA_VERSIONS,
    SCHEDULE_KINDS,
    SHARD_STYLES,
)
from autopart.core.recompute_policy import RECOMPUTE_POLICIES
from autopart.core.schedule import check_microbatches, splits_backward, stage_ranks
from autopart.core.v_schedules import V_SCHEDULE_KINDS

__all__ = ["Cut", "StagePlan", "RankPlan", "SolverReport", "BaselineReport", "ParetoPoint",
           "LowerBounds", "ShardedParameter", "Plan",
           "PLAN_SCHEMA_VERSION", "READABLE_SCHEMA_VERSIONS", "SCHEDULE_KINDS",
           "OPTIMIZE_TARGETS", "SHARD_STYLES", "check_plan_invariants"]


@dataclass(frozen=True, slots=True)
class Plan:
    """A complete partition and schedule decision for one model, batch and cluster.

    Attributes:
        graph_fingerprint: structure hash of the captured graph it was made for.
        cluster_fingerprint: devices it was made for (``Cluster.fingerprint``).
        cost_source: ``CostGraph.source`` of the costs it was solved on.
        library_versions: package -> version (torch, ortools, autopart) at solve time.
        optimize: ``"speed"`` or ``"memory"``.
        batch_size: the full batch (leading dimension) it was made for.
        num_microbatches: m; ``batch_size`` is divisible by it.
        schedule_kind: one of ``SCHEDULE_KINDS``.
        cuts: the S - 1 chosen cuts, ascending.
        stages: the S stages.
        ranks: per rank, the stages it runs and its predicted peak memory.
        predicted_step_time_us: one training step (all microbatches, fwd + bwd), µs.
        bubble_fraction: idle share of a rank's step time under the schedule, 0..1.
        solver: the solver's status, objective, bound, gap and wall time.
        baselines: other partitioners on the same costs (may be empty).
        stages_per_rank: v, virtual stages per rank (1 without interleaving; 2 for the V
            schedules ``zbv`` and ``dualpipev``, which place rank r's stages at r and
            2p - 1 - r; every other kind places stage s on rank s % p).
        pareto: the (step time, peak memory) frontier of the candidates the solver evaluated,
            by ascending time (may be empty).
        lower_bounds: physical lower bounds and the plan's ratio to them (None when absent).
        tp: tensor-parallel degree: every rank is a group of tp GPUs of one host (default 1).
        dp: data-parallel replicas of the whole pipeline (default 1); ``batch_size`` is the
            global batch over all of them, each replica runs ``batch_size / dp`` rows in
            ``num_microbatches`` microbatches.
        zero_stage: 0-3, what dp shards: nothing, optimizer state, + gradients, + parameters.
        sharded_parameters: the parameters tp splits and how (empty when tp = 1).
        model_flops: FLOPs of one training step of the whole model at ``batch_size``
            (forward + backward, recompute excluded), 0 when not recorded.
        overlap_grad_reduce: ZeRO-0's data-parallel gradient all-reduce runs in buckets
            launched during each stage's last backward of the step (Megatron-LM's
            ``--overlap-grad-reduce``), and the step time prices it so; False (the default,
            and what plans written before it load as): after the pipeline flush. Only with
            dp > 1 and zero_stage 0.
        zero_layer_units: ZeRO 1-3 shard each layer of a stage (the ops under
            ``<stack>.<i>``, e.g. ``model.layers.3``) as its own FSDP unit (torchtitan's one
            ``fully_shard`` per block), gathered with the next layer's gather prefetched:
            ZeRO-3 for each forward and backward, so a stage is never gathered whole;
            ZeRO-2 from its forward to its backward; ZeRO-1 from the step's first forward to
            its last backward, where each layer reduce-scatters as its gradients become
            final. The memory model charges the gathered layers. False (the default, and
            what plans written before it load as): one unit per stage. Only with dp > 1,
            zero_stage 1-3 and a schedule whose backwards do not split (``I``/``W``).
        sequence_parallel: tp runs Megatron-LM's sequence parallelism: the all-reduce after
            each row-parallel matmul is a reduce-scatter over the tokens and the layer norms,
            dropouts and residual adds between tp pairs run on 1/tp of the tokens
            (``autopart/codegen/sequence_parallel.py``). False (the default, and what plans
            written before it load as): those run whole on every tp GPU. Only with tp > 1.
        recompute_policy: what a stage whose ``StagePlan.recompute`` is true recomputes, one
            of ``autopart.core.recompute_policy.RECOMPUTE_POLICIES``: ``"full"`` (the default,
            and what plans written before it load as): its whole forward, keeping its inputs
            only; ``"selective"``: torch's selective activation checkpointing with
            torchtitan's op policy, keeping the outputs of matmuls, attention and tp's
            collectives and recomputing the rest; ``"op"``: the same checkpointing keeping
            the nodes each stage lists in ``StagePlan.recompute_kept`` (the solver's choice
            under the memory cap) and tp's reductions.
        ep: expert-parallel degree, folded into dp as Megatron-Core folds it (ep divides dp;
            each ep group is ep consecutive dp replicas): the experts of every MoE layer are
            split over the ep group, ``E / ep`` per GPU, and tokens reach their experts by
            all-to-all (``autopart/codegen/expert_parallel.py``); an expert's gradient is
            summed over the ``dp / ep`` replicas holding it. 1 (the default, and what plans
            written before it load as): every replica holds every expert. Runs with tp = 1
            (the runtime refuses tp > 1); ZeRO 1-3 shard the dense parameters only.
        cp: context-parallel degree (:mod:`autopart.core.context`): each sequence is split over
            cp GPUs (two load-balanced chunks each), attention all-gathers the keys and values
            over them (``autopart/codegen/context_parallel.py``), and the stages are captured
            at S / cp tokens. cp ranks hold the same rows, so the GPUs of a layout are tp x
            pp x dp x cp; gradients are averaged and ZeRO shards over the dp x cp ranks, as
            Megatron-LM folds cp into dp. 1 (the default, and what plans written before it
            load as): whole sequences. Runs with ep = 1.
        cp_attention: how attention spans the cp ranks' tokens, one of
            ``autopart.core.plan_rules.CP_ATTENTIONS``: ``"all_gather"`` (the default, and
            what plans written before it load as): each rank's queries over the keys and
            values all-gathered from the cp group; ``"ulysses"`` (DeepSpeed-Ulysses): queries,
            keys and values exchanged by all-to-all so that each rank attends with heads / cp
            of the heads over the whole sequence, and the outputs exchanged back (the heads a
            tp rank holds must divide by cp). Only with cp > 1.
        Step time, stage and rank figures are per GPU (one GPU of a rank's tp group).
    """

    graph_fingerprint: str
    cluster_fingerprint: str
    cost_source: str
    library_versions: dict[str, str]
    optimize: str
    batch_size: int
    num_microbatches: int
    schedule_kind: str
    cuts: tuple[Cut, ...]
    stages: tuple[StagePlan, ...]
    ranks: tuple[RankPlan, ...]
    predicted_step_time_us: float
    bubble_fraction: float
    solver: SolverReport
    baselines: tuple[BaselineReport, ...] = ()
    stages_per_rank: int = 1
    pareto: tuple[ParetoPoint, ...] = ()
    lower_bounds: LowerBounds | None = None
    tp: int = 1
    dp: int = 1
    zero_stage: int = 0
    sharded_parameters: tuple[ShardedParameter, ...] = ()
    model_flops: int = 0
    overlap_grad_reduce: bool = False
    zero_layer_units: bool = False
    sequence_parallel: bool = False
    recompute_policy: str = "full"
    ep: int = 1
    cp: int = 1
    cp_attention: str = "all_gather"
    schema_version: int = field(default=PLAN_SCHEMA_VERSION)

    def __post_init__(self) -> None:
        """Check every field's type, then the plan as a whole
        (:func:`check_plan_invariants`).

        Raises:
            PlanError: the first field or invariant that does not hold, with its value and
                the fix.
        """
        check_fields(self, "")
        check_plan_invariants(self)

    @property
    def recompute_kept_nodes(self) -> frozenset[str]:
        """The nodes whose outputs recomputing stages keep under ``recompute_policy="op"``
        (every stage's ``recompute_kept``); empty under the other policies."""
        return frozenset(name for st in self.stages for name in st.recompute_kept)

    @property
    def num_stages(self) -> int:
        """S, the number of pipeline stages."""
        return len(self.stages)

    @property
    def num_gpus(self) -> int:
        """tp x pp x dp x cp, pp being the number of ranks."""
        return self.tp * len(self.ranks) * self.dp * self.cp

    # ---- JSON ----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form; key order is made stable by the writer."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        """Build and validate a plan from :meth:`to_dict` output (values are taken as they are:
        ``2.7``, ``true`` or ``"2"`` where an integer belongs is refused, not converted).

        Raises:
            PlanError: a field is missing, unknown, of the wrong type or out of range, or the
                fields disagree with each other; the message names the field, the value and
                the fix.
        """
        kwargs = record_kwargs(cls, d, "")
        for name, kind in (("cuts", Cut), ("stages", StagePlan), ("ranks", RankPlan),
                           ("baselines", BaselineReport), ("pareto", ParetoPoint),
                           ("sharded_parameters", ShardedParameter)):
            if name in kwargs:
                items = listed(kwargs[name], name)
                kwargs[name] = tuple(build_record(kind, x, f"{name}[{i}]") for i, x in enumerate(items))
        kwargs["solver"] = build_record(SolverReport, kwargs["solver"], "solver")
        if kwargs.get("lower_bounds") is not None:
            kwargs["lower_bounds"] = build_record(LowerBounds, kwargs["lower_bounds"], "lower_bounds")
        return cls(**kwargs)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the plan as JSON (sorted keys), atomically: the old file or the new, never half."""
        write_text_atomic(path, dumps(self.to_dict()))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Plan:
        """Read and validate a plan file (JSON only; nothing is unpickled).

        Raises:
            PlanError: the path cannot be read (missing, a directory, no permission), the
                file is not UTF-8 JSON (binary, truncated, duplicate keys, nested too deep,
                numbers too long), or it is not a valid plan; the message names the path.
        """
        fix = "pass a plan JSON file written by Plan.save or `autopart plan`"
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except OSError as exc:
            raise PlanError(f"{path}: cannot read a plan file there ({exc.strerror or exc}); "
                            f"{fix}") from None
        try:
            data = json.loads(raw.decode("utf-8"), object_pairs_hook=unique_keys)
        except UnicodeDecodeError as exc:
            raise PlanError(f"{path}: not a JSON plan file (not UTF-8 text: byte {exc.start}); "
                            f"{fix}") from None
        except RecursionError:
            raise PlanError(f"{path}: not a JSON plan file (nested too deep to read); "
                            f"{fix}") from None
        except ValueError as exc:  # json.JSONDecodeError, or an integer of > 4300 digits
            raise PlanError(f"{path}: not a JSON plan file ({exc}); {fix}") from None
        try:
            return cls.from_dict(data)
        except PlanError as exc:
            raise PlanError(f"{path}: {exc}") from None


def check_plan_invariants(plan: Plan) -> None:
    """The cross-field invariants the runtimes rely on: a readable schema, a consistent
    (tp, dp, ZeRO) layout, known kinds, m dividing the batch per replica, stages placed as
    the schedule kind places them (:func:`autopart.core.schedule.stage_ranks`), S - 1
    ascending cuts, a bubble fraction in [0, 1].

    Raises:
        PlanError: ``"invalid plan: ..."`` naming the field, its value and the fix.
    """
    def bad(msg: str) -> PlanError:
        return PlanError(f"invalid plan: {msg}")

    if plan.schema_version not in READABLE_SCHEMA_VERSIONS:
        raise bad(f"schema_version {plan.schema_version} is not supported (this autopart "
                  f"reads {READABLE_SCHEMA_VERSIONS}); re-plan with this version")
    problem = layout_problem(plan.tp, plan.dp, plan.zero_stage, plan.schema_version,
                             [p.name for p in plan.sharded_parameters])
    if problem:
        raise bad(problem)
    line = plan.dp * plan.cp  # the GPUs that reduce gradients together (cp folded into dp)
    if plan.overlap_grad_reduce and (line < 2 or plan.zero_stage != 0):
        cp = f" x cp={plan.cp}" if plan.cp > 1 else ""
        raise bad(f"overlap_grad_reduce=True with dp={plan.dp}{cp} and zero_stage="
                  f"{plan.zero_stage}: it overlaps ZeRO-0's gradient all-reduce over dp x cp "
                  ">= 2 GPUs; set it False")
    if plan.zero_layer_units and (line < 2 or plan.zero_stage < 1
                                  or splits_backward(plan.schedule_kind, False)):
        raise bad(f"zero_layer_units=True with dp={plan.dp}, zero_stage={plan.zero_stage} and "
                  f"schedule_kind={plan.schedule_kind!r}: per-layer FSDP units are for ZeRO 1-3 "
                  "over dp >= 2 replicas on a schedule whose backwards do not split; set it "
                  "False")
    if plan.recompute_policy not in RECOMPUTE_POLICIES:
        raise bad(f"recompute_policy={plan.recompute_policy!r} is not one of "
                  f"{RECOMPUTE_POLICIES}")
    for st in plan.stages:
        if st.recompute_kept and (plan.recompute_policy != "op" or not st.recompute):
            raise bad(f"stages[{st.stage_index}].recompute_kept lists {len(st.recompute_kept)} "
                      f"nodes with recompute={st.recompute} and recompute_policy="
                      f"{plan.recompute_policy!r}: kept nodes belong to a recomputing stage "
                      "under 'op'; empty the list")
    if plan.ep < 1 or plan.dp % plan.ep:
        raise bad(f"ep={plan.ep} with dp={plan.dp}: expert parallelism splits the experts over "
                  "ep of the dp replicas, so ep must be >= 1 and divide dp; choose a divisor")
    if plan.cp < 1 or (plan.cp > 1 and plan.ep > 1):
        raise bad(f"cp={plan.cp} with ep={plan.ep}: cp must be >= 1, and context parallelism "
                  "does not run with expert parallelism yet; choose cp=1 or ep=1")
    if plan.cp_attention not in CP_ATTENTIONS or (plan.cp_attention != "all_gather"
                                                  and plan.cp < 2):
        raise bad(f"cp_attention={plan.cp_attention!r} with cp={plan.cp}: expected one of "
                  f"{CP_ATTENTIONS}, and 'ulysses' only with cp >= 2; set 'all_gather'")
    if plan.sequence_parallel and plan.tp < 2:
        raise bad(f"sequence_parallel=True with tp={plan.tp}: sequence parallelism splits the "
                  "tokens over a tp group of 2 or more GPUs; set it False")
    for name in ("graph_fingerprint", "cluster_fingerprint", "cost_source"):
        if not getattr(plan, name).strip():
            raise bad(f"{name} is empty; a plan names what it was made for: {FIX}")
    if plan.optimize not in OPTIMIZE_TARGETS:
        raise bad(f"optimize={plan.optimize!r}; expected one of {OPTIMIZE_TARGETS}")
    if plan.schedule_kind not in SCHEDULE_KINDS:
        raise bad(f"schedule_kind={plan.schedule_kind!r}; expected one of {SCHEDULE_KINDS}")
    m, batch, v, p = plan.num_microbatches, plan.batch_size, plan.stages_per_rank, len(plan.ranks)
    if batch < 1 or m < 1 or batch % m:
        raise bad(f"num_microbatches={m} must be >= 1 and divide batch_size={batch}; "
                  "choose a divisor of the batch")
    if batch % (m * plan.dp):
        raise bad(f"num_microbatches={m} x dp={plan.dp} must divide batch_size={batch} (the "
                  "global batch); choose m dividing the batch per replica")
    kind = plan.schedule_kind
    if kind in V_SCHEDULE_KINDS and v != 2:
        raise bad(f"stages_per_rank={v} with schedule_kind={kind!r}: the V schedules run "
                  "exactly 2 stages per rank; set stages_per_rank to 2")
    if v < 1 or (v > 1 and kind not in ("interleaved_1f1b", *V_SCHEDULE_KINDS)):
        raise bad(f"stages_per_rank={v} with schedule_kind={kind!r}: only "
                  "'interleaved_1f1b' and the V schedules (v = 2) run more than one stage per "
                  "rank (v >= 1); set stages_per_rank to 1 or the schedule to "
                  "'interleaved_1f1b'")
    if p < 1 or len(plan.stages) != p * v:
        raise bad(f"{len(plan.stages)} stages on {p} ranks with stages_per_rank={v}; the "
                  f"number of stages must be ranks x stages_per_rank = {p * v}")
    try:
        check_microbatches(kind, p, m)
    except PlanError as exc:
        raise bad(str(exc)) from None
    num_stages = len(plan.stages)
    rank_of = stage_ranks(kind, p, v)
    how = "in a V: rank r runs stages r and 2p - 1 - r" if kind in V_SCHEDULE_KINDS \
        else f"stage s on rank s % {p}"
    for r, rank in enumerate(plan.ranks):
        want = tuple(s for s in range(num_stages) if rank_of[s] == r)
        if rank.rank != r or rank.stage_indices != want:
            raise bad(f"ranks[{r}] has rank={rank.rank}, stage_indices={list(rank.stage_indices)}; "
                      f"rank {r} of {p} runs stages {list(want)} ({kind}: {how})")
    for i, st in enumerate(plan.stages):
        if st.stage_index != i:
            raise bad(f"stages[{i}] has stage_index {st.stage_index}; stages are listed in "
                      f"order 0..{num_stages - 1}")
        if st.rank != rank_of[i]:
            raise bad(f"stage {i} is on rank {st.rank}, but the plan has {p} ranks and "
                      f"{kind} places it on rank {rank_of[i]} ({how})")
        if st.device != plan.ranks[st.rank].device:
            raise bad(f"stage {i} names device {st.device!r}, its rank {st.rank} names "
                      f"{plan.ranks[st.rank].device!r}; make them agree")
    if len(plan.cuts) != num_stages - 1:
        raise bad(f"{num_stages} stages but {len(plan.cuts)} cuts; S stages need S - 1 cuts")
    positions = [c.position for c in plan.cuts]
    ascending = all(a < b for a, b in zip(positions, positions[1:], strict=False))
    if not ascending or any(q < 1 for q in positions):
        raise bad(f"cut positions {reprlib.repr(positions)} must be >= 1 and strictly ascending")
    for i, cut in enumerate(plan.cuts):
        if not cut.after_node or not cut.before_node:
            raise bad(f"cuts[{i}] names no node on one side ({cut.after_node!r} | "
                      f"{cut.before_node!r}); {FIX}")
    if not 0.0 <= plan.bubble_fraction <= 1.0:
        raise bad(f"bubble_fraction={plan.bubble_fraction} is outside [0, 1]")
