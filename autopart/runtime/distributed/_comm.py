"""A distributed pipeline's process groups, its gathers through the rendezvous store, its
share of the host's cores, and the error a failed step raises."""

from __future__ import annotations

import datetime
import json
import os
import socket
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from autopart.core.errors import PipelineFailure
from autopart.core.plan import Plan
from autopart.core.trace import TraceEvent
from autopart.runtime._torch_private import default_store, set_group_timeout
from autopart.runtime.distributed.heartbeat import Heartbeat
from autopart.runtime.host import affinity_enabled, core_share

__all__ = ["StoreGather", "broadcast_outputs", "cpu_share", "pipelines_of", "timed_group",
           "tied_groups", "mesh_coordinates", "time_out_groups", "step_failure", "average_over",
           "BUCKET_BYTES", "mean_into"]

#: Gradients are averaged over data-parallel replicas in buckets of at most this many bytes
#: (DDP's default ``bucket_cap_mb=25``): one all-reduce per bucket, close to the one ring
#: all-reduce of a rank's gradient bytes that the cost model prices
#: (:mod:`autopart.solver.data_parallel`); one all-reduce per tensor paid gloo's per-call
#: latency for each of a stage's dozens of tensors.
BUCKET_BYTES = 25 * 2**20

#: pipelines built in this process, per pipeline group (``"0-1"``): names their store keys
_BUILT: dict[str, int] = {}


def cpu_share(device: torch.device) -> tuple[int, ...] | None:
    """This rank's own share of the host's cores for its steps.

    Every rank of the world takes part (one ``all_gather_object`` of host name and allowed
    cores); a CPU rank gets a share only where it shares the host with other ranks that are
    allowed the same cores (ranks a user pinned apart are left as they are), there are at
    least as many cores as ranks there, and ``$AUTOPART_CPU_AFFINITY`` is not off.

    Returns:
        The share (:func:`autopart.runtime.host.core_share`), or None.
    """
    cores = (tuple(sorted(os.sched_getaffinity(0))) if affinity_enabled()
             and device.type == "cpu" else ())
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, (socket.gethostname(), cores))
    me = dist.get_rank()
    host, mine = every[me]
    local = [r for r, (h, _) in enumerate(every) if h == host]
    if not mine or len(local) < 2 or any(every[r][1] != mine for r in local):
        return None
    return core_share(mine, local.index(me), len(local)) or None


def pipelines_of(pp_group: dist.ProcessGroup | None) -> tuple[list[tuple[int, ...]], list[int]]:
    """Every pipeline replica's global ranks (sorted), and this rank's pipeline (collective
    over the world)."""
    mine = (dist.get_process_group_ranks(pp_group) if pp_group is not None
            else list(range(dist.get_world_size())))
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return sorted({tuple(ranks) for ranks in every}), mine


def timed_group(pipelines: list[tuple[int, ...]], mine: list[int],
                timeout_s: float) -> dist.ProcessGroup:
    """The pipeline's ranks again, as a group whose operations time out after ``timeout_s``:
    its sends, receives and loss broadcast. ``new_group`` is collective over the whole world,
    so every rank makes every replica's group."""
    timeout = datetime.timedelta(seconds=timeout_s)
    made = [dist.new_group(list(pipeline), timeout=timeout) for pipeline in pipelines]
    return made[pipelines.index(tuple(mine))]


def mesh_coordinates(pp_group: dist.ProcessGroup | None, dp_group: dist.ProcessGroup | None,
                     tp_group: dist.ProcessGroup | None,
                     timeout_s: float) -> dict[int, tuple[int, int, int]]:
    """Every global rank's ``(pp, dp, tp)`` coordinates: its index in its pipeline (the world
    when ``pp_group`` is None), in its data-parallel and its tensor-parallel group (0 where
    there is none). Collective over the world, through the rendezvous store
    (:class:`StoreGather`, not a gloo all-gather; waits at most ``timeout_s`` seconds).

    Raises:
        RuntimeError: a rank did not take part within ``timeout_s`` (the store's error).
    """
    mine = (dist.get_rank(pp_group), *(dist.get_rank(g) if g is not None else 0
                                       for g in (dp_group, tp_group)))
    gather = StoreGather(list(range(dist.get_world_size())), dist.get_rank(), timeout_s,
                         lambda exchange: exchange())
    every = [json.loads(blob) for blob in gather.gather_bytes(json.dumps(mine).encode())]
    return {r: (int(c[0]), int(c[1]), int(c[2])) for r, c in enumerate(every)}


def time_out_groups(groups: list[dist.ProcessGroup | None], timeout_s: float) -> None:
    """Make the collectives of ``groups`` (the pipeline's data- and tensor-parallel groups;
    None entries skipped) time out after ``timeout_s``, as the pipeline's own sends and
    receives do (:func:`timed_group`): a gradient all-reduce, an FSDP2 gather or a
    tensor-parallel all-reduce waiting for a rank that hangs then fails the step within the
    step timeout, where the groups a ``DeviceMesh`` makes would wait 30 minutes (gloo's
    default). The groups are changed in place (a user's mesh's too): their stage graphs and
    FSDP2's mesh address them by name, so they cannot be swapped for timed copies."""
    for group in groups:
        if group is not None:
            set_group_timeout(group, timeout_s)


def tied_groups(placement: Any, plan: Plan, pipelines: list[tuple[int, ...]], mine: list[int],
                pp_rank: int, held: dict[str, torch.Tensor],
                timeout_s: float) -> list[tuple[str, dist.ProcessGroup | None]]:
    """One group per parameter read on several pipeline ranks, per pipeline replica.

    ``new_group`` is collective over the whole world: every rank creates every replica's
    groups in the same order (with a pp x dp mesh each data-parallel replica has its own
    pipeline group), and keeps those it belongs to (``(fqn, group)`` for each tensor of
    ``held`` it shares).
    """
    groups: list[tuple[str, dist.ProcessGroup | None]] = []
    timeout = datetime.timedelta(seconds=timeout_s)
    for fqn in sorted(placement.replicas):
        readers = [placement.owner[fqn], *placement.replicas[fqn]]
        ranks = sorted({plan.stages[s].rank for s in readers})
        if len(ranks) < 2:
            continue
        for pipeline in pipelines:
            group = dist.new_group([pipeline[r] for r in ranks], timeout=timeout)
            if list(pipeline) == mine and pp_rank in ranks and fqn in held:
                groups.append((fqn, group))
    return groups


class StoreGather:
    """All-gathers of small payloads between a pipeline's ranks, through the rendezvous store.

    Not a gloo ``all_gather``: gloo runs a collective on its worker thread, which drops its
    last reference to the collective's tensors some time after the caller's wait returns.
    When that comes after the interpreter has started to exit (a process that ends right
    after a memory-measured step), the thread cannot take the GIL to free them and the
    process aborts ("terminate called without an active exception"). Each rank deletes its
    own key of the gather before last, which every rank has read by then.

    Pipelines are built collectively, in the same order on every rank: the n-th one of a
    set of ranks has the same number everywhere, and its gathers their own keys.

    Args:
        ranks: the pipeline's global ranks (names its keys).
        pp_rank: this rank's index in the pipeline.
        timeout_s: how long a gather waits for the other ranks.
        guard: runs each exchange, turning its errors into the pipeline's.
    """

    def __init__(self, ranks: list[int], pp_rank: int, timeout_s: float,
                 guard: Callable[[Callable[[], Any]], Any]) -> None:
        self.store = default_store()
        group = "-".join(map(str, ranks))
        _BUILT[group] = _BUILT.get(group, 0) + 1
        self._prefix = f"autopart/gather/{group}/{_BUILT[group]}"
        self._size, self._rank = len(ranks), pp_rank
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._guard = guard
        self._gathers = 0

    def gather_bytes(self, payload: bytes) -> list[bytes]:
        """Every pipeline rank's ``payload``, in pipeline-rank order (JSON, never pickle)."""
        self._gathers += 1
        n = self._gathers
        keys = [f"{self._prefix}/{n}/{r}" for r in range(self._size)]

        def exchange() -> list[bytes]:
            self.store.set(keys[self._rank], payload)
            self.store.wait(keys, self._timeout)
            got = [bytes(self.store.get(k)) for k in keys]
            if n > 1:
                self.store.delete_key(f"{self._prefix}/{n - 1}/{self._rank}")
            return got

        return self._guard(exchange)

    def gather_events(self, events: list[TraceEvent]) -> list[TraceEvent]:
        """Every pipeline rank's trace events, rank after rank."""
        rows = [[e.rank, e.name, e.start_us, e.end_us] for e in events]
        out: list[TraceEvent] = []
        for blob in self.gather_bytes(json.dumps(rows).encode()):
            out.extend(TraceEvent(int(r), str(n), float(a), float(b))
                       for r, n, a, b in json.loads(blob))
        return out

    def gather_ints(self, value: int) -> list[int]:
        """Every pipeline rank's ``value``, in pipeline-rank order."""
        return [int(blob) for blob in self.gather_bytes(str(int(value)).encode())]


def step_failure(exc: Exception, heartbeat: Heartbeat, plan: Plan,
                 coords: Mapping[int, tuple[int, int, int]], rank: int,
                 step_timeout_s: float) -> PipelineFailure:
    """The error a failed step raises: which rank died or hangs, and in which action.

    Any rank of the world is named, a tensor- or data-parallel peer as much as a pipeline
    neighbour, by its global rank, its ``(pp, dp, tp)`` coordinates and the stages it runs
    (``rank 3 (pp 1, dp 0, tp 1; stages [1])``). A hung rank (inside one action, not
    waiting in a collective, for at least half the step timeout while this rank's
    operation timed out: :meth:`Heartbeat.diagnose`) is told to exit.

    Args:
        exc: what this rank's step raised.
        heartbeat: the pipeline's heartbeat (who is alive, who hangs where).
        plan: the plan (which stages each pipeline rank runs).
        coords: global rank -> ``(pp, dp, tp)`` of every rank of the world
            (:func:`mesh_coordinates`).
        rank: this process's global rank.
        step_timeout_s: the step timeout.
    """
    dead, hung = heartbeat.diagnose(hung_after_s=step_timeout_s / 2)
    stages_of = {r: [st.stage_index for st in plan.stages if st.rank == r]
                 for r in range(len(plan.ranks))}

    def name(g: int) -> str:
        if g not in coords:
            return f"rank {g}"
        pp, dp, tp = coords[g]
        return f"rank {g} (pp {pp}, dp {dp}, tp {tp}; stages {stages_of.get(pp, '?')})"

    text = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    who = [f"{name(g)} died or stopped responding" for g in dead]
    for g, (action, stuck_s) in sorted(hung.items()):
        reason = (f"it hangs in action {action} (no progress for {stuck_s:.0f} s, step "
                  f"timeout {step_timeout_s:g} s)")
        told = ("it was told to exit" if heartbeat.tell_to_exit(g, reason)
                else "telling it to exit was not acknowledged")
        who.append(f"{name(g)} hangs in action {action} (no progress for {stuck_s:.0f} s; "
                   f"{told})")
    if not who:
        return PipelineFailure(f"pipeline step failed on {name(rank)}: {text}")
    return PipelineFailure(f"pipeline step failed on {name(rank)}: {'; '.join(who)} "
                           f"({text}); restart the job (from the last checkpoint) once the "
                           "rank is healthy")


def mean_into(flat: torch.Tensor, targets: list[tuple[int, torch.Tensor | None]],
              size: int) -> None:
    """Divide ``flat``, the sum over ``size`` ranks of tensors packed end to end (shape
    ``(total elements,)``), by ``size`` in place and copy each piece into its tensor.

    Args:
        flat: the all-reduced bucket.
        targets: per packed piece, in packing order, its element count and the tensor to
            write into (None: the piece is skipped, e.g. zeros packed for a missing ``.grad``).
        size: the group's ranks.
    """
    flat.div_(size)
    offset = 0
    for n, t in targets:
        if t is not None:
            t.copy_(flat[offset:offset + n].view_as(t))
        offset += n


def average_over(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Replace each tensor by its mean over ``group``'s ranks, in place: tensors of one dtype
    and device are packed into buckets of up to :data:`BUCKET_BYTES` (in the order given,
    which must be the same on every rank), each all-reduced once.

    Args:
        tensors: this rank's tensors, the same shapes in the same order on every rank.
        group: the ranks to average over.
    """
    size = dist.get_world_size(group)
    buckets: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}

    def flush(bucket: list[torch.Tensor]) -> None:
        flat = torch.cat([t.reshape(-1) for t in bucket])  # (total elements,)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        mean_into(flat, [(t.numel(), t) for t in bucket], size)
        bucket.clear()

    for t in tensors:
        bucket = buckets.setdefault((t.dtype, t.device), [])
        if bucket and (sum(b.numel() for b in bucket) + t.numel()) * t.element_size() > BUCKET_BYTES:
            flush(bucket)
        bucket.append(t)
    for bucket in buckets.values():
        if bucket:
            flush(bucket)


def broadcast_outputs(out: Any, output_meta: list[Any], m: int, src: int,
                      group: dist.ProcessGroup, device: torch.device,
                      guarded: Callable[[Callable[[], Any]], Any]) -> list[Any]:
    """The last stage's flat outputs of an inference run, on every rank of the pipeline.

    Args:
        out: the last stage's output (a value or a tuple/list of them) on its rank, else None.
        output_meta: per flat output, ``(shape of one microbatch, dtype)`` or None for a
            non-tensor (sent as an object).
        m: microbatches the run had (tensor outputs are m microbatches long).
        src: the last stage's global rank.
        group: the pipeline's group.
        device: where the receive buffers go.
        guarded: runs each broadcast, turning a dead rank into ``PipelineFailure``.
    """
    flat_out: list[Any] = []
    for k, meta in enumerate(output_meta):
        mine = (out[k] if isinstance(out, (tuple, list)) else out) if out is not None else None
        if meta is None:  # not a tensor: sent as an object
            box = [mine]
            guarded(lambda box=box: dist.broadcast_object_list(box, src=src, group=group))
            flat_out.append(box[0])
            continue
        shape, dtype = meta
        shape = (shape[0] * m, *shape[1:]) if shape else shape
        buf = (mine.detach().contiguous() if isinstance(mine, torch.Tensor)
               else torch.empty(shape, dtype=dtype, device=device))
        guarded(lambda buf=buf: dist.broadcast(buf, src=src, group=group))
        flat_out.append(buf)
    return flat_out
