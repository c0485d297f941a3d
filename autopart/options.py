"""CompileOptions: every choice ``autopart.compile`` takes, validated in one place."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autopart.core.errors import PlanError
from autopart.core.layout import check_zero_stage
from autopart.core.plan import OPTIMIZE_TARGETS, SCHEDULE_KINDS, Plan
from autopart.core.plan_rules import CP_ATTENTIONS
from autopart.core.recompute_policy import CHECKPOINTED_POLICIES, RECOMPUTE_POLICIES
from autopart.core.runtime_model import BACKENDS

if TYPE_CHECKING:
    from torch import nn

__all__ = ["CompileOptions", "renamed_choices", "recompute_policy_to_solve", "OPTIMIZER_STATE_TENSORS",
           "optimizer_state_factor"]

# State tensors per parameter, each shaped and typed like the parameter (torch.optim keeps
# exp_avg / exp_avg_sq and momentum_buffer in the parameter's dtype): AdamW/Adam 2, SGD
# with momentum 1 (SGD without momentum keeps none: pass optimizer=0.0).
OPTIMIZER_STATE_TENSORS = {"adamw": 2, "adam": 2, "sgd": 1}


def optimizer_state_factor(optimizer: str | float, param_bytes: int, param_count: int) -> float:
    """Optimizer state bytes per parameter byte, the figure the solver's memory model uses.

    Args:
        optimizer: a name in ``OPTIMIZER_STATE_TENSORS`` (state follows the parameters'
            dtype, so bf16 weights have bf16 state), or bytes of state per parameter
            (element), e.g. 12.0 for AdamW with fp32 state and an fp32 master copy of bf16
            weights (4 + 4 + 4).
        param_bytes: trainable parameter bytes of the model (its dtypes).
        param_count: trainable parameter elements.

    Returns:
        ``state bytes / parameter bytes`` (>= 0); 0.0 for a model without parameters.

    Raises:
        PlanError: an unknown name, or a negative / non-numeric figure.
    """
    if isinstance(optimizer, str):
        if optimizer.lower() not in OPTIMIZER_STATE_TENSORS:
            raise PlanError(f"optimizer={optimizer!r}; expected one of "
                            f"{sorted(OPTIMIZER_STATE_TENSORS)} or the optimizer state's bytes "
                            "per parameter (a number >= 0)")
        return float(OPTIMIZER_STATE_TENSORS[optimizer.lower()])
    if isinstance(optimizer, bool) or not isinstance(optimizer, (int, float)) or optimizer < 0:
        raise PlanError(f"optimizer={optimizer!r} must be a name "
                        f"({sorted(OPTIMIZER_STATE_TENSORS)}) or bytes per parameter >= 0")
    return float(optimizer) * param_count / param_bytes if param_bytes else 0.0


def _positive_seconds(name: str, value: Any, default: str, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise PlanError(f"{name}={value!r} must be a number of seconds > 0 ({default})")


def _positive_int(name: str, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlanError(f"{name}={value!r} must be an integer >= 1 (or None to let the solver "
                        "choose)")


#: Older keyword -> the name every layer uses now (plan files, the solver, CompileOptions).
RENAMED = {"schedule": "schedule_kind"}


def recompute_policy_to_solve(policy: str, fuse: bool) -> str:
    """The recompute policy to solve with for stages compiled (``fuse``) or not: ``policy``,
    but ``"full"`` for ``"auto"`` with ``fuse``.

    Raises:
        PlanError: ``"selective"`` or ``"op"`` with ``fuse``: Inductor's code calls matmuls'
            ``out=`` forms and fuses the graph's nodes, which torch's selective checkpointing
            cannot keep, so they would run again as under ``"full"`` while the plan priced
            them kept.
    """
    if fuse and policy in CHECKPOINTED_POLICIES:
        raise PlanError(f"recompute_policy={policy!r} with fuse=True: torch.compile'd stages "
                        "call matmuls' out= forms and fuse the graph's nodes, which selective "
                        "checkpointing cannot keep; use recompute_policy='full' (or 'auto'), "
                        "or fuse=False")
    return "full" if fuse and policy == "auto" else policy


def renamed_choices(choices: dict[str, Any]) -> dict[str, Any]:
    """``choices`` with older keyword names (:data:`RENAMED`) under their current ones.

    Raises:
        PlanError: both the older and the current name were given.
    """
    out = dict(choices)
    for old, new in RENAMED.items():
        if old in out:
            if new in out:
                raise PlanError(f"pass {new}= only ({old}= is its older name)")
            out[new] = out.pop(old)
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class CompileOptions:
    """The choices of :func:`autopart.compile` (keyword-only, frozen, checked on creation).

    ``None`` leaves a choice to the solver; a replayed ``plan`` fixes them all, so giving
    one that disagrees with the plan is an error (:meth:`check_plan`). See
    :func:`autopart.compile` for what each one means.

    Attributes:
        devices: one device string per rank (local backend only).
        num_stages: total stages S = ranks x stages_per_rank, >= 1.
        num_microbatches: m >= 1.
        optimize: ``"speed"`` or ``"memory"``; ``None`` means ``"speed"`` (a replayed plan
            keeps its own).
        schedule_kind: one of ``gpipe``, ``1f1b``, ``interleaved_1f1b``, ``zero_bubble``
            (ZB-H1), ``zbv`` (ZB-V), ``dualpipev`` (DualPipe-V) (the plan's and the
            solver's name; ``compile(schedule=...)`` is still accepted).
        stages_per_rank: v >= 1 (v > 1 needs ``interleaved_1f1b``; ``zbv`` and
            ``dualpipev`` run v = 2, rank r holding stages r and 2p - 1 - r).
        recompute: every stage (True), none (False), solver's choice (None).
        recompute_policy: what a recomputing stage recomputes (``Plan.recompute_policy``):
            ``"full"`` its whole forward, ``"selective"`` all but the outputs of matmuls,
            attention and tp's reductions (torch's selective activation checkpointing with
            torchtitan's op policy), ``"op"`` all but the nodes the solver keeps per stage
            under the memory cap (:mod:`autopart.solver.recompute_choice`), ``"auto"`` the
            better of ``"full"`` and ``"op"`` by the objective
            (``SolveOptions.recompute_policy``; the selective policy's cost is measured only
            where the full policy's plan recomputes a stage,
            :func:`autopart.planning.solve_auto_recompute`). None (default): ``"auto"`` when
            solving (``"full"`` with ``fuse``); a replayed plan keeps its own.
        fuse: compile each stage with ``torch.compile`` (both backends); the plan is then
            priced on compiled segments' times (``ProfileOptions.fuse``).
        backend: ``"local"`` or ``"distributed"``; ``None`` picks distributed inside an
            initialised process group of more than one rank.
        checkpoint: distributed only: a ``pipe.save`` directory the rank loads its weights
            from.
        mesh: distributed only: a ``DeviceMesh`` with dims ``("pp", "dp")`` or ``("pp",
            "dp", "tp")``; None (default): built from the plan's layout
            (:func:`autopart.runtime.distributed.mesh.mesh_groups`).
        time_limit_s: CP-SAT wall-clock limit per solve, seconds, > 0 (default 10).
        step_timeout_s: distributed only: a pipeline send or receive that waits this long
            fails the step, naming the rank that died or hangs (default 300 s).
        optimizer: the optimizer whose state the plan's per-rank memory counts:
            ``"adamw"`` (default) / ``"adam"`` (2 tensors like each parameter), ``"sgd"``
            (momentum, 1), or bytes of state per parameter (see
            :func:`optimizer_state_factor`). Ignored when a plan is replayed.
        tp: tensor-parallel degree >= 1. Distributed only (the local backend refuses tp,
            dp and zero_stage, :meth:`check_runtime`): giving any of the three makes rank 0
            search the (tp, pp, dp, ZeRO) layouts of the world's ranks with the others
            free (:func:`autopart.layout_planning.plan_layout`); none of them (default):
            every rank a pipeline rank, as before.
        dp: data-parallel replicas >= 1, or None; as ``tp``.
        zero_stage: ZeRO stage over dp, 0-3, or None; as ``tp``.
        issue_threads: local only: host threads that issue the ranks' work, rank ``r`` on
            thread ``r % issue_threads`` (default 1: the caller's thread issues every stage);
            None: a worker thread per rank (torchgpipe's scheme; same numerics). Settable
            later as ``pipe.issue_threads``. The distributed backend has a process, so a
            thread, per rank.
        cuda_graphs: local only: replay each CUDA stage's training forward and backward as
            CUDA graphs after the first step (default False; a stage that cannot be graphed
            runs eagerly and says why once; ``pipe.cuda_graphs``). The plan is priced for it:
            no host issue time on graphed actions (``RuntimeDescription.cuda_graphs``).
        layout_search: distributed only: ``True`` searches the (tp, pp, dp, ZeRO) layouts
            even with none of ``tp``, ``dp``, ``zero_stage`` given (all chosen); ``None``
            (default) searches them only when one is given.
        overlap_grad_reduce: distributed, layout search only: ZeRO-0 plans all-reduce
            gradients over dp in buckets during each stage's last backward, priced so
            (default True, as Megatron-LM's ``--overlap-grad-reduce`` and DDP run); False:
            after the pipeline flush. The plan records it; a replayed plan runs as it says.
        zero_layer_units: distributed, layout search only: ZeRO 1-3 plans shard each layer
            of a stage as its own FSDP unit (default True; not with ``fuse=True``, whose
            compiled stage is one unit), so a stage is never gathered whole; False: one
            unit per stage. The plan records it (``Plan.zero_layer_units``).
        sequence_parallel: distributed, layout search only: tp > 1 plans run Megatron-LM's
            sequence parallelism (layer norms, dropouts and residual adds between tp pairs
            on 1/tp of the tokens; ``autopart/codegen/sequence_parallel.py``), priced so.
            Default False. The plan records it (``Plan.sequence_parallel``).
        ep: distributed, layout search only: expert-parallel degree >= 1 (default 1): each
            MoE layer's experts split over ep of the dp replicas, tokens dispatched by
            all-to-all (``Plan.ep``; ``autopart/codegen/expert_parallel.py``). With ep > 1
            the search keeps tp 1 and a dp that ep divides (ZeRO shards the dense parameters,
            leaving the experts whole). None: searched with the
            other degrees (among the divisors of dp that divide the model config's expert
            count).
        cp: distributed, layout search only: context-parallel degree >= 1 (default 1): each
            sequence split over cp ranks (two load-balanced chunks each), attention
            all-gathering keys and values over them (``Plan.cp``;
            ``autopart/codegen/context_parallel.py``); the layout search then lays out the
            world's ranks / cp as tp x pp x dp on the model captured at S / cp tokens. The
            model must take ``position_ids``, attend through ``scaled_dot_product_attention``
            with a causal or no mask, and S be a multiple of 2 cp. Not with ep > 1. The
            loss must pair output and target position by position (pass the target already
            shifted, as Megatron-LM's and torchtitan's data loaders do): a loss that shifts
            inside would pair the last token of a rank's first chunk with the first of its
            second. None: searched with the other degrees (among the divisors of the ranks
            that divide S / 2, where the model can take it): the search prices whole sequences
            split per cp rank, and a chosen cp > 1 is profiled again at S / cp tokens and
            solved at that cp.
        cp_attention: with cp > 1, how attention spans the cp ranks (``Plan.cp_attention``):
            ``"all_gather"`` (keys and values all-gathered) or ``"ulysses"`` (all-to-alls
            between sequence and head sharding; the heads per tp rank must divide by cp).
            None (the default): the layout search prices both and keeps the better.

    Raises:
        PlanError: a value out of range or of the wrong type, naming it and the fix.
    """

    devices: tuple[str, ...] | None = None
    num_stages: int | None = None
    num_microbatches: int | None = None
    optimize: str | None = None
    schedule_kind: str | None = None
    stages_per_rank: int | None = None
    recompute: bool | None = None
    recompute_policy: str | None = None
    fuse: bool = False
    backend: str | None = None
    checkpoint: str | os.PathLike[str] | None = None
    mesh: Any = None
    time_limit_s: float = 10.0
    step_timeout_s: float | None = None
    optimizer: str | float = "adamw"
    tp: int | None = None
    dp: int | None = None
    zero_stage: int | None = None
    layout_search: bool | None = None
    overlap_grad_reduce: bool = True
    zero_layer_units: bool = True
    sequence_parallel: bool = False
    ep: int | None = 1
    cp: int | None = 1
    cp_attention: str | None = None
    issue_threads: int | None = 1
    cuda_graphs: bool = False

    def __post_init__(self) -> None:
        optimizer_state_factor(self.optimizer, 1, 1)  # checks the name or figure
        for name in ("num_stages", "num_microbatches", "stages_per_rank", "tp", "dp", "ep", "cp"):
            _positive_int(name, getattr(self, name))
        if (self.cp or 1) > 1 and (self.ep or 1) > 1:
            raise PlanError(f"cp={self.cp!r} with ep={self.ep!r}: context and expert "
                            "parallelism do not run together yet; fix one of them to 1")
        if self.cp_attention not in (None, *CP_ATTENTIONS):
            raise PlanError(f"cp_attention={self.cp_attention!r}: expected one of "
                            f"{CP_ATTENTIONS}, or None to let the layout search choose")
        if self.zero_stage is not None:
            check_zero_stage(self.zero_stage)
        if self.optimize is not None and self.optimize not in OPTIMIZE_TARGETS:
            raise PlanError(f"optimize={self.optimize!r}; expected one of {OPTIMIZE_TARGETS}")
        if self.schedule_kind is not None and self.schedule_kind not in SCHEDULE_KINDS:
            raise PlanError(f"schedule_kind={self.schedule_kind!r}; expected one of {SCHEDULE_KINDS} or "
                            "None (the solver chooses)")
        if (self.stages_per_rank or 1) > 1 and self.schedule_kind not in (
                None, "interleaved_1f1b", "zbv", "dualpipev"):
            raise PlanError(f"stages_per_rank={self.stages_per_rank} needs schedule_kind="
                            f"'interleaved_1f1b' (or None), not {self.schedule_kind!r}")
        if self.schedule_kind in ("zbv", "dualpipev") and self.stages_per_rank not in (None, 2):
            raise PlanError(f"schedule_kind={self.schedule_kind!r} runs 2 stages per rank (a V); "
                            f"stages_per_rank={self.stages_per_rank} must be 2 or None")
        if self.layout_search not in (None, True):
            raise PlanError(f"layout_search={self.layout_search!r} must be True or None (None: "
                            "search the layout only when tp=, dp= or zero_stage= is given)")
        if self.recompute not in (None, True, False):
            raise PlanError(f"recompute={self.recompute!r} must be True, False or None")
        if self.recompute_policy not in (None, *RECOMPUTE_POLICIES, "auto"):
            raise PlanError(f"recompute_policy={self.recompute_policy!r} must be one of "
                            f"{(*RECOMPUTE_POLICIES, 'auto')} or None")
        self.solve_recompute_policy()  # selective with fuse refused
        if self.backend is not None and self.backend not in BACKENDS:
            raise PlanError(f"backend={self.backend!r}; expected one of {BACKENDS} or None")
        if self.devices is not None and not self.devices:
            raise PlanError("devices is empty; pass at least one device, e.g. "
                            "['cuda:0', 'cuda:1']")
        if self.issue_threads is not None and (isinstance(self.issue_threads, bool) or not
                                               isinstance(self.issue_threads, int)
                                               or self.issue_threads < 1):
            raise PlanError(f"issue_threads={self.issue_threads!r} must be an int >= 1, or None "
                            "for one thread per rank")
        _positive_seconds("time_limit_s", self.time_limit_s, "default 10")
        _positive_seconds("step_timeout_s", self.step_timeout_s, "or None: 300 s",
                          optional=True)

    def solve_recompute_policy(self) -> str:
        """The recompute policy to solve with: ``recompute_policy``, ``"auto"`` when None,
        and ``"full"`` for ``"auto"`` with ``fuse`` (compiled stages cannot keep their
        matmuls' outputs, see ``autopart.codegen.recompute.run_recomputed``)."""
        return recompute_policy_to_solve(self.recompute_policy or "auto", self.fuse)

    def state_factor(self, model: nn.Module) -> float:
        """Optimizer state bytes per parameter byte for :attr:`optimizer` on ``model``'s
        trainable parameters, in their dtypes (:func:`optimizer_state_factor`)."""
        trainable = [p for p in model.parameters() if p.requires_grad]
        return optimizer_state_factor(self.optimizer,
                                      sum(p.numel() * p.element_size() for p in trainable),
                                      sum(p.numel() for p in trainable))

    def check_runtime(self, plan: Plan | None = None, backend: str = "local") -> None:
        """Refuse a tensor- or data-parallel layout where it cannot run: the local backend
        (one process) has no tensor-parallel or data-parallel ranks. The distributed backend
        runs any layout (its (pp, dp, tp) mesh: :mod:`autopart.runtime.distributed.mesh`).

        Args:
            plan: a replayed plan, or None.
            backend: ``"local"`` or ``"distributed"``.

        Raises:
            PlanError: with the local backend, tp > 1 or dp > 1 (given, or in the replayed
                plan), or a ZeRO stage > 0 given (nothing to shard without dp), naming the
                values and what to do instead.
        """
        if backend != "local":
            return
        tp = max(self.tp or 1, plan.tp if plan is not None else 1)
        dp = max(self.dp or 1, plan.dp if plan is not None else 1)
        zero = max(self.zero_stage or 0, plan.zero_stage if plan is not None else 0)
        cp = max(self.cp or 1, plan.cp if plan is not None else 1)
        if cp > 1:
            raise PlanError(f"cp={cp}: the local "
                            "backend runs one process, and context parallelism splits each "
                            "sequence over ranks; launch with torchrun and "
                            "backend='distributed', or drop cp=")
        if max(self.ep or 1, plan.ep if plan is not None else 1) > 1:
            raise PlanError(f"ep={max(self.ep or 1, plan.ep if plan is not None else 1)}: the local "
                            "backend runs one process, and expert parallelism splits the "
                            "experts over dp ranks; launch with torchrun and "
                            "backend='distributed' (dp= a multiple of ep), or drop ep=")
        if tp > 1 or dp > 1 or zero > 0:
            raise PlanError(f"tp={tp}, dp={dp}, zero_stage={zero}: the local backend runs every "
                            "stage in one process, so it has no tensor- or data-parallel ranks "
                            "and runs tp=1, dp=1, zero_stage=0 only. Launch tp x pp x dp "
                            "processes with torchrun (e.g. torchrun --nproc-per-node=4 with "
                            "tp=1, dp=2 for pp 2 x dp 2), or drop tp=/dp=/zero_stage=")

    def check_backend(self, backend: str) -> None:
        """Refuse what ``backend`` cannot honour.

        Raises:
            PlanError: ``checkpoint``, ``mesh``, ``step_timeout_s`` or ``layout_search`` with
                the local backend; ``issue_threads`` > 1 or ``cuda_graphs`` with the
                distributed one (a rank is a process with its own thread);
                ``devices`` with the distributed one (each rank runs on its own
                ``LOCAL_RANK`` device).
        """
        if backend == "local":
            for name in ("checkpoint", "mesh", "step_timeout_s", "layout_search"):
                if getattr(self, name) is not None:
                    raise PlanError(f"{name}= is for backend='distributed' (a torchrun launch); "
                                    f"the local backend got {name}={getattr(self, name)!r}. Drop "
                                    "it, or launch with torchrun")
        elif (self.issue_threads or 1) > 1 or self.cuda_graphs:
            raise PlanError(f"issue_threads={self.issue_threads}, cuda_graphs={self.cuda_graphs} "
                            "are for backend='local' (one process issuing every stage); with "
                            "backend='distributed' each rank is a process with its own thread. "
                            "Drop them")
        elif self.devices is not None:
            raise PlanError(f"devices={list(self.devices)} cannot be honoured with backend="
                            "'distributed': each rank runs on its own device (cuda:LOCAL_RANK, or "
                            "cpu). Drop devices=, and launch one process per device")

    def check_plan(self, plan: Plan, *, ranks: int | None = None) -> None:
        """Refuse choices that a replayed ``plan`` contradicts (it fixes them all).

        Args:
            plan: the plan to replay.
            ranks: the number of ranks that will run it, when known (devices or world size).

        Raises:
            PlanError: naming the argument, the value given, the plan's value and the fix.
        """
        recompute = {st.recompute for st in plan.stages}
        given = [("num_stages", self.num_stages, plan.num_stages),
                 ("num_microbatches", self.num_microbatches, plan.num_microbatches),
                 ("schedule_kind", self.schedule_kind, plan.schedule_kind),
                 ("stages_per_rank", self.stages_per_rank, plan.stages_per_rank),
                 ("optimize", self.optimize, plan.optimize),
                 ("tp", self.tp, plan.tp), ("dp", self.dp, plan.dp),
                 ("zero_stage", self.zero_stage, plan.zero_stage),
                 ("ep", None if self.ep == 1 else self.ep, plan.ep),
                 ("cp", None if self.cp == 1 else self.cp, plan.cp),
                 ("cp_attention", self.cp_attention if plan.cp > 1 else None,
                  plan.cp_attention),
                 ("recompute", self.recompute,
                  next(iter(recompute)) if len(recompute) == 1 else "per stage"),
                 ("recompute_policy", None if self.recompute_policy == "auto"
                  else self.recompute_policy, plan.recompute_policy)]
        for name, value, planned in given:
            if value is not None and value != planned:
                raise PlanError(f"{name}={value!r} conflicts with the replayed plan, which has "
                                f"{name}={planned!r}; drop {name}= to replay the plan, or drop "
                                "plan= to solve again with it")
        if ranks is not None and ranks != len(plan.ranks):
            raise PlanError(f"the plan has {len(plan.ranks)} ranks but {ranks} devices were "
                            f"given; pass one device per rank ({len(plan.ranks)}), or re-plan "
                            f"for {ranks}")
