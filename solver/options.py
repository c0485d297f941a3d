"""SolveOptions: what solve() searches over (m, v, schedule kind, recompute) and its limits."""

from __future__ import annotations

from dataclasses import dataclass, field

from autopart.core.errors import PlanError
from autopart.core.plan import OPTIMIZE_TARGETS, SCHEDULE_KINDS, Plan
from autopart.core.recompute_policy import RECOMPUTE_POLICIES
from autopart.core.runtime_model import RuntimeDescription
from autopart.core.schedule import splits_backward
from autopart.core.v_schedules import V_SCHEDULE_KINDS

__all__ = ["SolveOptions"]

#: The v searched for ``interleaved_1f1b`` when ``stages_per_rank`` is None.
_V_CHOICES = (1, 2, 4)


@dataclass(frozen=True, slots=True, kw_only=True)
class SolveOptions:
    """What to solve for (keyword-only).

    Attributes:
        batch_size: the full batch (leading dimension) the plan is for.
        num_stages: S = ranks x stages_per_rank; ``None`` (default) = the cluster's ranks times
            the chosen v. Giving it fixes v = S / ranks.
        num_microbatches: m; ``None`` = choose among the divisors of ``batch_size``.
        microbatch_candidates: restricts the m searched when ``num_microbatches`` is None;
            each must divide ``batch_size``.
        optimize: ``"speed"`` (smallest step time with every rank under its cap) or
            ``"memory"`` (smallest largest-rank peak memory, then step time).
        training: plan for fwd + bwd (True) or forward-only inference (GPipe forward schedule).
        schedule_kind: one of ``SCHEDULE_KINDS``; ``None`` = the solver chooses (training).
        stages_per_rank: v; ``None`` = the solver chooses among 1, 2, 4 (v > 1 only with
            ``interleaved_1f1b``, which needs m to be a multiple of the ranks, and v = 2
            with the V schedules ``zbv`` and ``dualpipev``, the latter needing m >= 2p).
        recompute: ``True`` every stage recomputes, ``False`` none, ``None`` the solver picks
            per stage.
        recompute_policy: what a recomputing stage recomputes (``Plan.recompute_policy``):
            ``"full"`` (default) its whole forward, ``"selective"`` all but the outputs of
            matmuls, attention and tp's reductions (torch's selective activation
            checkpointing with torchtitan's op policy), priced so; ``"op"``: the same
            checkpointing, keeping per recomputing stage the nodes the solver chooses under
            the ranks' caps (:mod:`autopart.solver.recompute_choice`; ``StagePlan.
            recompute_kept``); ``"auto"``: the better of ``"full"`` and ``"op"`` by the
            objective, solved with ``"op"`` as well only where the ``"full"`` plan
            recomputes a stage (:func:`autopart.solver.solve`;
            :func:`autopart.solver.predict.plan_at` takes ``"full"`` for it).
        memory_cap_bytes: per-device cap, bytes; ``None`` = each device's ``memory_bytes``.
        optimizer_state_bytes_per_param_byte: optimizer state per trainable parameter byte
            (AdamW: 2.0); weights + grads + state = ``(2 + this) x`` parameter bytes.
        state_bytes_per_param_byte: bytes a GPU holds per trainable parameter byte it owns,
            weights, gradients and optimizer state together, after any ZeRO sharding (the
            layout search passes what the runtime holds at a step's peak,
            :func:`autopart.solver.data_parallel.held_state_multiplier`); ``None`` (default) =
            ``2 + optimizer_state_bytes_per_param_byte``. Must be > 0.
        layer_unit_factors: ZeRO 1-3 with one FSDP unit per layer (``Plan.zero_layer_units``):
            per stage, bytes held gathered at its peak beyond ``state_bytes_per_param_byte``
            times its trainable parameter bytes, as ``(a, b, c, d)`` per byte of those
            parameters, of those outside every layer (``R``), of its largest layer (``L``)
            and of ``max(R, L)`` (:func:`autopart.solver.data_parallel.layer_unit_factors`);
            ``None`` (default): nothing beyond. Each must be >= 0.
        whole_state_params: trainable parameters that ZeRO leaves whole on every GPU that
            holds them (an ep rank's experts, ``fully_shard``'s ``ignored_params``): they hold
            ``2 + optimizer_state_bytes_per_param_byte`` times their bytes whatever
            ``state_bytes_per_param_byte`` says, and are in no layer unit's gather. Default
            none.
        time_limit_s: CP-SAT wall-clock limit per solve, seconds (a safety net; the search
            is bounded by ``deterministic_time`` so that it is reproducible).
        deterministic_time: CP-SAT deterministic time limit per solve (default 2.0).
        max_cpsat_solves: how many (kind, v, m) subproblems are refined (threshold search
            and CP-SAT, see :func:`autopart.solver.solve`), best DP seeds first (default 8);
            the rest keep their DP answer.
        max_simulated: how many best candidates the schedule simulator replays (default 4;
            only the best when a replay has more than 8192 microbatch-stage pairs, and
            baselines then keep their closed-form time).
        split_backward: which schedules are searched by how they run a stage's backward:
            ``None`` (default) all; ``False`` those that run it whole (GPipe, 1F1B,
            interleaved 1F1B); ``True`` those that split it into ``I`` and ``W`` (ZB-H1, ZB-V,
            DualPipe-V: :func:`autopart.core.schedule.splits_backward`). The layout search
            searches the two apart to price ZeRO's per-layer FSDP units, which a split
            backward does not run (one unit per stage there). A ``schedule_kind`` of the
            other group raises ``PlanError``.
        hint: a previous plan whose cuts seed the search (warm start after a change of
            batch, sequence length or device count).
        library_versions: package -> version recorded in the plan (ortools is added).
        runtime: what the runtime that will run the plan costs and holds (its cost per
            transfer, the split backward's cost, its receive buffers); default: a runtime
            that costs nothing beyond the profiled ops and allocates buffers as values
            arrive (:class:`autopart.core.runtime_model.RuntimeDescription`).
        baselines: evaluate the baseline partitioners on the same costs, report them in the
            plan and take a faster fitting one (default True); False skips them (the 3D
            layout search screens layouts without them).
        explain_infeasible: when nothing fits the memory cap, say what would (the smallest
            peak any configuration reaches, and a device count that fits, each found by
            solving again; default True). False raises at once, naming the cap: the 3D
            layout search, which keeps a line per layout and explains at the layout level,
            spent minutes here on thousands of GPUs.
        crossing_factor, window, max_candidates: see
            :func:`autopart.solver.candidates.find_candidates`.
    """

    batch_size: int
    num_stages: int | None = None
    num_microbatches: int | None = None
    microbatch_candidates: tuple[int, ...] | None = None
    optimize: str = "speed"
    training: bool = True
    schedule_kind: str | None = None
    stages_per_rank: int | None = None
    recompute: bool | None = None
    recompute_policy: str = "full"
    memory_cap_bytes: int | None = None
    optimizer_state_bytes_per_param_byte: float = 2.0
    state_bytes_per_param_byte: float | None = None
    layer_unit_factors: tuple[float, float, float, float] | None = None
    whole_state_params: frozenset[str] = frozenset()
    time_limit_s: float = 10.0
    deterministic_time: float = 2.0
    max_cpsat_solves: int = 8
    max_simulated: int = 4
    split_backward: bool | None = None
    hint: Plan | None = None
    library_versions: dict[str, str] = field(default_factory=dict)
    runtime: RuntimeDescription = RuntimeDescription()
    baselines: bool = True
    explain_infeasible: bool = True
    crossing_factor: float = 2.0
    window: int = 32
    max_candidates: int = 128

    def __post_init__(self) -> None:
        if self.schedule_kind is not None and self.schedule_kind not in SCHEDULE_KINDS:
            raise PlanError(f"schedule_kind={self.schedule_kind!r}; expected one of "
                            f"{SCHEDULE_KINDS} or None")
        if self.stages_per_rank is not None and self.stages_per_rank < 1:
            raise PlanError(f"stages_per_rank={self.stages_per_rank} must be >= 1 or None")
        if (self.stages_per_rank or 1) > 1 and self.schedule_kind not in (
                None, "interleaved_1f1b", *V_SCHEDULE_KINDS):
            raise PlanError(f"stages_per_rank={self.stages_per_rank} needs schedule_kind "
                            f"'interleaved_1f1b' (or None), not {self.schedule_kind!r}")
        if self.schedule_kind in V_SCHEDULE_KINDS and self.stages_per_rank not in (None, 2):
            raise PlanError(f"schedule_kind={self.schedule_kind!r} runs 2 stages per rank (a V); "
                            f"stages_per_rank={self.stages_per_rank} must be 2 or None")
        if self.split_backward is not None and self.schedule_kind is not None \
                and splits_backward(self.schedule_kind, False) != self.split_backward:
            raise PlanError(f"schedule_kind={self.schedule_kind!r} is not among the schedules "
                            f"split_backward={self.split_backward} leaves in; pass "
                            "split_backward=None or another schedule kind")
        if self.recompute_policy not in (*RECOMPUTE_POLICIES, "auto"):
            raise PlanError(f"recompute_policy={self.recompute_policy!r}; expected one of "
                            f"{(*RECOMPUTE_POLICIES, 'auto')}")
        if self.optimize not in OPTIMIZE_TARGETS:
            raise PlanError(f"optimize={self.optimize!r}; expected one of {OPTIMIZE_TARGETS}")
        if self.batch_size < 1 or (self.num_stages is not None and self.num_stages < 1):
            raise PlanError(f"num_stages={self.num_stages} and batch_size={self.batch_size} "
                            "must be >= 1")
        if self.memory_cap_bytes is not None and self.memory_cap_bytes <= 0:
            raise PlanError(f"memory_cap_bytes={self.memory_cap_bytes} must be > 0 or None")
        if self.state_bytes_per_param_byte is not None and self.state_bytes_per_param_byte <= 0:
            raise PlanError(f"state_bytes_per_param_byte={self.state_bytes_per_param_byte} must "
                            "be > 0 or None")
        if self.layer_unit_factors is not None and (
                len(self.layer_unit_factors) != 4 or min(self.layer_unit_factors) < 0):
            raise PlanError(f"layer_unit_factors={self.layer_unit_factors} must be four "
                            "factors >= 0 (stage, root, largest layer, larger unit) or None")
        if (self.optimizer_state_bytes_per_param_byte < 0 or self.time_limit_s <= 0
                or self.deterministic_time <= 0 or self.max_cpsat_solves < 0
                or self.max_simulated < 1):
            raise PlanError("optimizer_state_bytes_per_param_byte must be >= 0, time_limit_s "
                            "and deterministic_time > 0, max_cpsat_solves >= 0, "
                            "max_simulated >= 1")

    def microbatch_counts(self) -> tuple[int, ...]:
        """The m values to search, ascending.

        Raises:
            PlanError: a requested m does not divide ``batch_size``.
        """
        if self.num_microbatches is not None:
            wanted: tuple[int, ...] = (self.num_microbatches,)
        elif self.microbatch_candidates is not None:
            wanted = self.microbatch_candidates
        else:
            return tuple(d for d in range(1, self.batch_size + 1) if self.batch_size % d == 0)
        bad = [m for m in wanted if m < 1 or self.batch_size % m]
        if bad or not wanted:
            valid = [d for d in range(1, self.batch_size + 1) if self.batch_size % d == 0]
            raise PlanError(f"num_microbatches {bad or list(wanted)} must be >= 1 and divide "
                            f"batch_size={self.batch_size}; valid: {valid}")
        return tuple(sorted(set(wanted)))

    def configurations(self, num_ranks: int) -> list[tuple[str, int]]:
        """The (schedule kind, v) pairs to search.

        Raises:
            PlanError: ``num_stages`` is not a multiple of the ranks, or disagrees with
                ``stages_per_rank``.
        """
        v_fixed = self.stages_per_rank
        if self.num_stages is not None:
            if self.num_stages % num_ranks or (v_fixed is not None
                                               and self.num_stages != v_fixed * num_ranks):
                raise PlanError(f"num_stages={self.num_stages} but the cluster has {num_ranks} "
                                f"ranks and stages_per_rank={v_fixed}: num_stages must equal "
                                "ranks x stages_per_rank; pass num_stages=None to let the "
                                "solver choose")
            v_fixed = self.num_stages // num_ranks
        if self.schedule_kind in V_SCHEDULE_KINDS and v_fixed not in (None, 2):
            raise PlanError(f"schedule_kind={self.schedule_kind!r} runs 2 stages per rank but "
                            f"num_stages={self.num_stages} on {num_ranks} ranks gives "
                            f"{v_fixed}; pass num_stages={2 * num_ranks} or None")
        if not self.training:
            kind = self.schedule_kind or "gpipe"
            return [(kind, 2 if kind in V_SCHEDULE_KINDS else v_fixed or 1)]
        kinds = (self.schedule_kind,) if self.schedule_kind else SCHEDULE_KINDS
        if self.split_backward is not None:
            kinds = tuple(k for k in kinds if splits_backward(k, False) == self.split_backward)
        out = []
        for kind in kinds:
            vs: tuple[int, ...]
            if kind in V_SCHEDULE_KINDS:
                vs = (2,) if v_fixed in (None, 2) else ()
            elif kind == "interleaved_1f1b":
                if self.schedule_kind is None:  # v = 1 is plain 1F1B: searched under that name
                    vs = () if v_fixed == 1 else ((v_fixed,) if v_fixed else (2, 4))
                else:
                    vs = (v_fixed,) if v_fixed else _V_CHOICES
            else:
                vs = (1,) if v_fixed in (None, 1) else ()
            out += [(kind, v) for v in vs]
        return out
