"""RuntimeDescription: what the runtime that will run a plan costs and holds, as the profiler
and the solver see it (no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field

from autopart.core.errors import PlanError

__all__ = ["RuntimeDescription", "BACKENDS"]

#: The runtimes :func:`autopart.compile` can hand stages to.
BACKENDS = ("local", "distributed")


@dataclass(frozen=True, slots=True, kw_only=True)
class RuntimeDescription:
    """The costs and memory policy of the runtime a plan is made for (keyword-only).

    The runtime package gives one per backend (:func:`autopart.runtime.description.describe`);
    the profiler reads how that runtime runs (``split_engine``, ``ranks_are_processes``,
    ``transfer_steps``) and fills in what it measures of it; the solver charges the figures.
    Nothing here imports a runtime. The default describes a runtime
    that costs nothing beyond the profiled ops and allocates buffers as values arrive (the
    one-process stream executor).

    Attributes:
        name: a label for messages and reports only (default ``"local"``); the solver never
            reads it to decide anything.
        receive_buffers_per_microbatch: when training, every stage holds one receive buffer
            per microbatch for its input and one for its outputs' gradient for the whole
            step, and keeps each microbatch's sent output and input gradient until the step
            ends, as torch.distributed.pipelining's stages allocate them (True for the
            distributed runtime). Default False: one receive buffer of each, allocated as
            values arrive.
        transfer_overhead_us: what the runtime spends on each transfer between ranks that
            an action posts or waits on, beside the link time, µs (default 0.0; must be
            >= 0): the schedule's own code for the action, posting the send or receive and
            completing it. An ``F``, ``B`` or ``I`` pays it once per neighbour stage on
            another rank (its input's and its output's transfers); a split's ``W``, which
            transfers nothing, does not.
        split_backward_us_per_node: what splitting one backward into its input- and
            weight-gradient parts (``I`` then ``W``, zero-bubble) adds per node that has a
            backward, per microbatch, µs (default 0.0; must be >= 0), the same at every
            microbatch size; charged to ``W``. Replaced by ``split_backward_points`` when
            those are given.
        split_backward_points: ``(rows per microbatch, µs per node)`` pairs: the split's cost
            per node measured at several microbatch sizes (default ``()``: none, and
            ``split_backward_us_per_node`` applies at every size). At a microbatch of ``r``
            rows the cost is read off the piecewise line through the points, extended beyond
            the ends by its end pieces, and never below 0. Rows must be > 0 and distinct,
            costs >= 0.
        selective_us_per_node: ``(forward, backward)`` µs per node per microbatch that a
            stage recomputing under the selective policy (``Plan.recompute_policy``) spends
            beyond running its unkept nodes again: torch's selective checkpointing's dispatch
            modes (default ``(0.0, 0.0)``; each must be >= 0; measured by
            ``autopart.profiler.selective_cost.measure_selective_overhead``). The same at every
            microbatch size.
        checkpoint_held_bytes: what each checkpointed forward (a recomputing stage's, per
            microbatch) holds on the rank's device from its forward until its backward
            beyond the activations it keeps, bytes (default 0; must be >= 0): on CPU ranks
            the generator state ``torch.utils.checkpoint`` saves (``preserve_rng_state``,
            ``torch.get_rng_state()``: 5056 bytes in torch 2.13), set by the profiler; a
            CUDA generator's state is saved on the host, so 0 there.
        ranks_are_processes: each rank is a process computing at the same time as the host's
            other ranks (default False): the profiler then calibrates beside co-runners.
        transfer_steps: ``"module:function"`` the profiler's two timing processes call to
            run this runtime's steps (default None: no per-transfer cost is measured); named,
            not imported, so the profiler never imports a runtime.
        issue_threads: how many host threads issue the ranks' work, rank ``r`` on thread
            ``r % issue_threads`` (default 1: one thread issues every stage, as the local
            one-process runtime does); None: one per rank (the distributed runtime, a
            process per rank). The solver bounds a step below by the host issue times of
            the actions that share a thread, where the profile has them
            (``NodeCost.host_times``).
        cuda_graphs: the local runtime replays each CUDA stage's forward and backward as
            CUDA graphs (``CompileOptions.cuda_graphs``; default False). The solver then
            charges no host issue time to those actions (one graph launch issues all of an
            action's kernels), except for stages that recompute or split their backward,
            which the runtime runs eagerly (:func:`autopart.runtime.local.cuda_graphs.graph_refusal`).
            Measured on one H200 (torch 2.11, ``benchmarks/gpu/README.md``): 4 graphed
            stages of a small GPT-2 at 1F1B m = 8 stepped in 0.039 s, against 0.112 s issued
            eagerly from one thread. A capture that fails at run time falls back to eager
            issue, which this does not foresee.
        ranks_per_core: how many ranks share each unit that computes: a CPU core of a host,
            when there are more rank processes than cores, or a device that several of the
            one-process runtime's stages name (default 1.0: every rank computes on a core or
            GPU of its own; must be > 0, and values <= 1 change nothing). CPU ranks on ``c``
            cores, ``n`` ranks: ``n / c`` (:func:`autopart.planning.cpu_ranks_per_core`); the
            local runtime's ranks: ranks per distinct device
            (:func:`autopart.planning.ranks_per_device`). Every rank of the world runs a
            copy of one pipeline rank's actions (dp replicas, tp shards), so a step is no
            shorter than the
            pipeline ranks' mean busy time times this figure
            (:func:`autopart.solver.simulate.core_bound_us`); idle time in the schedule's
            bubbles is shared for free.
        collective_overhead_points: ``(work µs, µs per collective)`` pairs: what one collective
            among ranks (a tp all-reduce or all-gather, a dp gradient reduction) costs beyond
            its ring steps (:mod:`autopart.solver.collectives`), after a rank has computed
            ``work`` µs since the previous one (default ``()``: nothing; GPU ranks, whose
            NCCL ring steps carry their fixed cost). On CPU ranks of one host this is the
            wait for the group's slowest rank and for the waiting process to be woken and
            scheduled again, which grows with the work between collectives (a longer
            computation is more often preempted) and with the ranks per core; it is
            measured on the host at the world's ranks per core
            (:func:`autopart.profiler.collective_probe.probe_collective_overhead`), in core
            time (the measured time divided by ``ranks_per_core``, which the shared-core
            replay stretches back). Read off the piecewise line through the points
            (:meth:`collective_overhead_at`). Work must be >= 0 and distinct, costs >= 0.
        transfer_wait_points: ``(work µs, µs per transfer)`` pairs: what one transfer between
            rank processes costs beyond its link time after an action of ``work`` µs, where
            that is more than ``transfer_overhead_us`` (default ``()``: nothing). Measured
            beside the collectives' points (the same probe, in the world's processes, at the
            host's load): a receiver woken by a message waits for a core, longer when ranks
            share cores or other jobs run; the larger of the two figures is charged
            (:meth:`transfer_cost_at`). Same rules as ``collective_overhead_points``.
        collective_bandwidth_bytes_per_s: the bus bandwidth the runtime's collectives reach
            between ranks of a host, bytes/s (default 0.0: unmeasured, the link's own; must
            be >= 0). Measured by the same probe for gloo, whose all-reduce runs far below
            the point-to-point link (it reduces and copies on the CPU); the layout search
            prices tp and dp collectives with it (``HostTopology.collective_efficiency``).
        copy_bytes_per_s: how fast the runtime copies the tensors it moves around its
            collectives, bytes per second of one copy (default 0.0: not charged; must be
            >= 0): a data-parallel reduction packs the gradients into one flat bucket, divides
            it and copies it back (``runtime/_dist_comm.average_over``: three passes), and the
            tp ops clone each all-reduced tensor and concatenate the gathered logits
            (``codegen/_tp_ops.py``). Measured by the same probe on CPU ranks, where these
            copies cost about as much as the collectives' rings.
        time_sharing_factor: how much more CPU time a rank's computation takes when rank
            processes share cores (``ranks_per_core`` > 1) than with a core to itself
            (default 1.0: none; must be >= 1). Two processes time-sliced on one core each
            find the core's caches and branch predictors filled by the other after every
            switch: on this project's 2-core CPU (AMD EPYC, torch 2.13.0+cpu, one thread per
            process) a GPT-2-like model's forward and backward on 2 x 64 tokens took 12 %
            more CPU time with four processes on the 2 cores than with two, while a chain of
            256 x 256 matmuls took 0 % more (``benchmarks/fidelity_3d/time_slicing.py``). The
            profiler measures it on the model (:func:`autopart.profiler.corunners.
            time_sharing_factor`) for CPU ranks that are processes and outnumber the cores;
            the solver multiplies every action's compute by it while ``ranks_per_core`` > 1,
            and never otherwise.
        collectives_share_compute: the runtime's collectives run on the ranks' own compute
            units (default False: NCCL reduces on SMs of its own beside the compute). True
            for gloo CPU ranks, whose reductions, copies and socket transfers take the
            rank's cores: measured on this project's 2-core CPU (torch 2.13.0+cpu, a
            GPT-2-like model of 7.6M parameters, dp 2), ZeRO-0's gradient all-reduce
            overlapped with the backward left the step where it was (134.1 against 134.6 ms;
            the backward's compute grew by what the reduction's wait shrank). The solver
            then prices an overlapped reduction as the serialized one.
        reduce_scatter_as_all_reduce: the runtime's reduce-scatter costs an all-reduce of
            the same buffer, not half of one as a ring's does (default False: NCCL). True
            for gloo, which reduces the whole buffer: on this project's 2-core CPU (torch
            2.13.0+cpu, 2 ranks, median of 30) a 2 MiB reduce-scatter took 3.39 ms, its
            all-reduce 3.59 ms and its all-gather 2.59 ms (64 KiB: 0.35, 0.27, 0.27 ms).
            The solver then prices sequence parallelism's and FSDP2's reduce-scatters as
            all-reduces.
        split_engine: how the runtime splits a backward into I and W, an object with the
            profiler's ``SplitEngine`` methods (:class:`autopart.profiler.split_cost.SplitEngine`;
            default None: the split's cost is not measured). Not compared or printed.

    Raises:
        PlanError: ``issue_threads`` below 1, ``ranks_per_core`` not above 0,
            ``time_sharing_factor`` below 1, a negative cost, or split points with a row
            count <= 0, repeated rows or a negative cost (the message names the field and
            the value).
    """

    name: str = "local"
    receive_buffers_per_microbatch: bool = False
    transfer_overhead_us: float = 0.0
    split_backward_us_per_node: float = 0.0
    split_backward_points: tuple[tuple[float, float], ...] = ()
    selective_us_per_node: tuple[float, float] = (0.0, 0.0)
    checkpoint_held_bytes: int = 0
    ranks_are_processes: bool = False
    transfer_steps: str | None = None
    issue_threads: int | None = 1
    cuda_graphs: bool = False
    ranks_per_core: float = 1.0
    collective_overhead_points: tuple[tuple[float, float], ...] = ()
    transfer_wait_points: tuple[tuple[float, float], ...] = ()
    collective_bandwidth_bytes_per_s: float = 0.0
    copy_bytes_per_s: float = 0.0
    time_sharing_factor: float = 1.0
    collectives_share_compute: bool = False
    reduce_scatter_as_all_reduce: bool = False
    split_engine: object | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "split_backward_points",
                           tuple((r, us) for r, us in self.split_backward_points))
        for name in ("collective_overhead_points", "transfer_wait_points"):
            points = tuple(sorted((float(w), float(us)) for w, us in getattr(self, name)))
            object.__setattr__(self, name, points)
            work = [w for w, _ in points]
            if (any(not (w >= 0.0) for w in work) or len(set(work)) != len(work)
                    or any(not (us >= 0.0) for _, us in points)):
                raise PlanError(f"{name}={points} must be (work µs >= 0, µs >= 0) pairs with "
                                "distinct work")
        object.__setattr__(self, "selective_us_per_node",
                           tuple(float(x) for x in self.selective_us_per_node))
        if len(self.selective_us_per_node) != 2 or not min(self.selective_us_per_node) >= 0.0:
            raise PlanError(f"selective_us_per_node={self.selective_us_per_node} must be "
                            "(forward µs, backward µs) per node, each >= 0")
        if not self.checkpoint_held_bytes >= 0:
            raise PlanError(f"checkpoint_held_bytes={self.checkpoint_held_bytes} must be >= 0 "
                            "(bytes a checkpointed forward holds until its backward)")
        if not self.split_backward_us_per_node >= 0.0:
            raise PlanError(f"split_backward_us_per_node={self.split_backward_us_per_node} "
                            "must be >= 0 (splitting a backward cannot make it cheaper)")
        rows = [r for r, _ in self.split_backward_points]
        if (any(not (r > 0) for r in rows) or len(set(rows)) != len(rows)
                or any(not (us >= 0.0) for _, us in self.split_backward_points)):
            raise PlanError(f"split_backward_points={self.split_backward_points} must be "
                            "(rows > 0, µs per node >= 0) pairs with distinct rows")
        if self.issue_threads is not None and self.issue_threads < 1:
            raise PlanError(f"issue_threads={self.issue_threads} must be >= 1, or None for one "
                            "thread per rank")
        if not self.ranks_per_core > 0.0:
            raise PlanError(f"ranks_per_core={self.ranks_per_core} must be > 0 (rank processes "
                            "per CPU core; 1.0 when every rank has a core of its own)")
        for name in ("collective_bandwidth_bytes_per_s", "copy_bytes_per_s"):
            if not getattr(self, name) >= 0.0:
                raise PlanError(f"{name}={getattr(self, name)} must be >= 0 (0: not measured)")
        if not self.time_sharing_factor >= 1.0:
            raise PlanError(f"time_sharing_factor={self.time_sharing_factor} must be >= 1 "
                            "(sharing a core does not make a rank's computation cheaper)")
        if not self.transfer_overhead_us >= 0.0:
            raise PlanError(f"transfer_overhead_us={self.transfer_overhead_us} must be >= 0 (a "
                            "transfer cannot cost less than its link time)")

    def collective_overhead_at(self, work_us: float) -> float:
        """What one collective costs beyond its ring steps after ``work_us`` µs of a rank's
        computation, µs: 0.0 without :attr:`collective_overhead_points`; else the piecewise
        line through them, held at the first and last points' costs beyond their work (a
        measurement is not extrapolated)."""
        return _on_line(self.collective_overhead_points, work_us)

    def transfer_cost_at(self, work_us: float) -> float:
        """What the runtime spends on one transfer an action of ``work_us`` µs posts or waits
        on, beside the link time, µs: the larger of :attr:`transfer_overhead_us` and
        :attr:`transfer_wait_points` read as :meth:`collective_overhead_at` reads its
        points."""
        return max(self.transfer_overhead_us, _on_line(self.transfer_wait_points, work_us))

    def issue_thread_of(self, rank: int) -> int:
        """The host thread that issues ``rank``'s actions (``rank`` itself with one per rank)."""
        return rank if self.issue_threads is None else rank % self.issue_threads


def _on_line(points: tuple[tuple[float, float], ...], x: float) -> float:
    """The piecewise line through sorted ``(x, y)`` points at ``x``, held at the end points'
    ``y`` beyond them; 0.0 without points."""
    if not points:
        return 0.0
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:], strict=False):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[-1][1]
