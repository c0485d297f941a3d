"""Every private torch API the runtimes use, in one place (``torch.utils._pytree`` aside).

Each entry says why no public API does the job and the torch versions it was read against
(the project supports torch >= 2.6, < 3; the installed one is 2.13). A torch upgrade that
breaks the runtimes should break here first: ``tests/runtime/test_torch_private.py``
checks that no other runtime module touches a private torch name.
"""

from __future__ import annotations

import contextlib
import datetime
import threading
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import _Action, _PipelineScheduleRuntime

from autopart.core.schedule import Schedule
from autopart.runtime.tracing import CollectiveTimer

__all__ = ["ScheduleRuntime", "ZeroIndexStage", "default_store", "found_non_finite",
           "incompatible_keys", "new_schedule_runtime", "overlap_pairs", "receive_buffers",
           "receives_first_order",
           "set_group_timeout", "split_stage_backward", "time_fsdp_collectives",
           "version_counter"]

#: torch's runtime for a schedule given as action lists (public schedules build their own
#: action lists; this one takes ours). Read on torch 2.6 and 2.13.
ScheduleRuntime = _PipelineScheduleRuntime


def new_schedule_runtime(stages: Sequence[PipelineStage], num_microbatches: int,
                         schedule: Schedule,
                         loss_fn: Callable[[Any, Any], torch.Tensor] | None,
                         pairs: Sequence[Collection[tuple[Any, Any]]] = (),
                         ) -> _PipelineScheduleRuntime:
    """torch's schedule runtime over ``stages`` running ``schedule`` (one action list per
    pipeline rank), with the sends and receives torch inserts between the actions.

    The actions are handed over in memory, as ``_load_csv`` would have read them from the
    CSV action format (``autopart.core.schedule.to_csv``), without the file, and checked and
    mapped to ranks as it does (``_validate_and_set_stage_mapping``). A forward-only
    schedule (inference), which torch's check refuses (it wants every backward), is mapped
    to ranks from where its actions are, as the check would have (each stage on the rank
    whose list holds it), and lowered as ``_prepare_schedule_with_comms`` lowers a
    compute-only schedule, without that check: the V schedules need this, because torch
    2.13's runtime fails in ``eval`` on a V training schedule's backwards ("can't
    steal_bwd_input"). Gradients are
    not scaled by torch (``scale_grads=False``): the caller divides by m once per step.
    Torch 2.13 lowers with ``_prepare_schedule_with_comms``; older releases (2.6) named it
    ``_load_actions``. The distributed runtime reorders the lowered actions of gloo ranks
    with :func:`receives_first_order`.

    ``pairs`` (per rank, default none): ``(F, B)`` pairs of ``(stage, kind, microbatch)``
    whose forward is followed at once by its backward on the rank; each becomes torch's
    ``OVERLAP_F_B`` action with the two as its sub-actions, which torch's lowering places
    and feeds as it does the two, and which the runtime runs one after the other unless a
    function is registered for it (:func:`overlap_pairs`).
    """
    runtime = _PipelineScheduleRuntime(  # type: ignore[no-untyped-call]
        list(stages), num_microbatches, loss_fn=loss_fn, scale_grads=False)
    for rank, actions in enumerate(schedule):
        runtime.pipeline_order[rank] = _with_pairs(
            [_Action.from_str(str(a)) for a in actions],
            pairs[rank] if rank < len(pairs) else ())
    if all(a.kind == "F" for acts in schedule for a in acts):
        _lower_forward_only(runtime, stages, schedule, num_microbatches)
    else:
        validate = getattr(runtime, "_validate_and_set_stage_mapping", None)
        if validate is not None:  # what _load_csv does after reading the rows
            validate(runtime.pipeline_order)
        lower = getattr(runtime, "_prepare_schedule_with_comms", None)
        if lower is None:
            lower = runtime._load_actions  # type: ignore[attr-defined]
        lower(runtime.pipeline_order)
    return runtime


def _with_pairs(actions: list[_Action], pairs: Collection[tuple[Any, Any]]) -> list[_Action]:
    """``actions`` with each listed ``(F, B)`` pair (adjacent, in that order) as one
    ``OVERLAP_F_B`` action."""
    from torch.distributed.pipelining.schedules import OVERLAP_F_B

    # each action by its text ("2F0"), which is how the actions were made (_Action.from_str)
    wanted = {"{}{}{}".format(*f): "{}{}{}".format(*b) for f, b in pairs}
    out: list[_Action] = []
    i = 0
    while i < len(actions):
        a = actions[i]
        b = actions[i + 1] if i + 1 < len(actions) else None
        if b is not None and wanted.get(str(a)) == str(b):
            out.append(_Action(-1, OVERLAP_F_B, None, (a, b)))
            i += 2
            continue
        out.append(a)
        i += 1
    return out


def overlap_pairs(runtime: _PipelineScheduleRuntime,
                  side_thread: Callable[[], contextlib.AbstractContextManager[Any]],
                  on: bool = True) -> None:
    """Have ``runtime`` run each ``OVERLAP_F_B`` action's forward and backward at once: the
    backward on a thread of its own (inside ``side_thread()``), the forward on the calling
    thread, as torchtitan's DualPipe-V overlap callback runs them (``torchtitan/distributed/
    dual_pipe_v.py``, 2025). Each collective one of them issues then waits while the other
    computes. The receives both wait for are waited for first, on the calling thread, and
    the loss the backward starts from is taken before the thread starts; what the two hand
    to neighbouring stages of this rank (a V's turn) is handed after both end. The stages'
    collectives must keep one order per process group across ranks whatever the two
    threads' timing: the distributed runtime gives each V chunk's all-to-alls their own ep
    group, and overlaps only where the stages run no other collective
    (:func:`autopart.core.plan_rules.overlaps_expert_exchanges`).

    Private: torch 2.13's runtime calls a registered function with the action and a
    ``_PipelineContext``; what it must do for the two sub-actions is what torch's own
    ``_perform_action`` does for ``FORWARD`` and ``FULL_BACKWARD`` (``_wait_batch_p2p``,
    ``fwd_recv_ops`` / ``bwd_recv_ops``, ``_assert_unsharded``, ``_maybe_compute_loss``,
    ``_maybe_get_loss``, ``backward_counter``, ``set_local_fwd_input`` /
    ``set_local_bwd_input``), none of it public (read on torch 2.13). ``on=False`` removes
    the function again (``_comp_type_to_function_map``): torch then runs each pair's two
    sub-actions one after the other.
    """
    from torch.distributed.pipelining.schedules import OVERLAP_F_B, _wait_batch_p2p

    if not on:
        runtime._comp_type_to_function_map.pop(OVERLAP_F_B, None)
        return

    def run(action: _Action, ctx: Any) -> None:
        schedule = ctx.schedule_ref
        fwd, bwd = action.sub_actions  # type: ignore[misc]
        by_index = {st.stage_index: st for st in schedule._stages}
        f_stage, b_stage = by_index[fwd.stage_index], by_index[bwd.stage_index]
        f_mb, b_mb = fwd.microbatch_index, bwd.microbatch_index
        if not f_stage.is_first and fwd.stage_index - 1 not in by_index:
            _wait_batch_p2p(schedule.fwd_recv_ops.pop((fwd.stage_index, f_mb)))
        if not b_stage.is_last and bwd.stage_index + 1 not in by_index:
            _wait_batch_p2p(schedule.bwd_recv_ops.pop((bwd.stage_index, b_mb)))
        schedule._assert_unsharded(f_stage)
        schedule._assert_unsharded(b_stage)
        loss = schedule._maybe_get_loss(b_stage, b_mb)
        schedule.backward_counter[bwd.stage_index] += 1
        last = schedule.backward_counter[bwd.stage_index] == schedule._n_microbatches
        failed: list[BaseException] = []
        # a thread starts on its device's default stream: the backward's kernels go to the
        # caller's stream, as torchtitan's callback sets it
        device = getattr(b_stage, "device", torch.device("cpu"))
        stream = torch.cuda.current_stream(device) if device.type == "cuda" else None

        def backward() -> None:
            try:
                with side_thread(), (torch.cuda.stream(stream) if stream is not None
                                     else contextlib.nullcontext()):
                    b_stage.backward_one_chunk(b_mb, loss=loss, full_backward=True,
                                               last_backward=last)
            except BaseException as exc:  # re-raised on the calling thread
                failed.append(exc)

        thread = threading.Thread(target=backward, name=f"autopart-{bwd}", daemon=True)
        thread.start()
        try:
            output = f_stage.forward_one_chunk(f_mb, ctx.arg_mbs[f_mb], ctx.kwarg_mbs[f_mb])
            schedule._maybe_compute_loss(f_stage, output, ctx.target_mbs, f_mb)
        finally:
            thread.join()
        if failed:
            raise failed[0]
        if fwd.stage_index + 1 in by_index:
            by_index[fwd.stage_index + 1].set_local_fwd_input(output, f_mb)
        if bwd.stage_index - 1 in by_index:
            by_index[bwd.stage_index - 1].set_local_bwd_input(
                b_stage.get_local_bwd_output(b_mb), b_mb)

    runtime.register_custom_function(OVERLAP_F_B, run)


def receives_first_order(actions: Sequence[_Action]) -> list[_Action]:
    """A rank's lowered actions with every receive (``RECV_F``, ``RECV_B``) moved to the
    front, in their own order, the other actions after them in theirs.

    torch posts each receive just before the action that needs it. A gloo send whose
    receive is not yet posted waits (gloo's TCP pairs hand over a message only once the
    receiver has announced its buffer): the receiver's announcement must then be answered by
    the sender process's gloo thread, which, where rank processes share cores, waits for a
    core behind its own rank's computation. Measured on this project's 2-core CPU (4 gloo
    ranks of a pp 2 x dp 2 GPT-2, 1F1B m = 4, torch 2.13): stage 0 waited up to 10 ms for a
    gradient its neighbour had sent 4 ms before it asked for it. Posted at the start, every
    receive is announced before its send, which then goes out at once.

    Matching is unchanged: gloo (and torch's stages, which send and receive without tags)
    pair a link's messages in the order each side posts them, and each side keeps its
    order. Every receive buffer is torch's own per microbatch (``args_recv_info`` and
    ``grad_recv_info``), held for the whole step anyway, so nothing more is allocated. Not
    for NCCL: its receives run in stream order, and a receive posted first would hold back
    the same link's sends queued behind it, whose data it may be waiting for.
    """
    from torch.distributed.pipelining.schedules import _ComputationType

    recv = (_ComputationType.RECV_F, _ComputationType.RECV_B)
    return ([a for a in actions if a.computation_type in recv]
            + [a for a in actions if a.computation_type not in recv])


def _lower_forward_only(runtime: _PipelineScheduleRuntime, stages: Sequence[PipelineStage],
                        schedule: Schedule, num_microbatches: int) -> None:
    """``_prepare_schedule_with_comms`` of a forward-only schedule (torch 2.13), less the
    check that wants every backward: stage -> rank from the actions, then torch's own
    lowering passes (``_add_unshard_reshard``, ``_add_reduce_grad``, ``_add_send_recv``)."""
    from torch.distributed.pipelining.schedules import (
        _add_reduce_grad,
        _add_send_recv,
        _add_unshard_reshard,
    )

    mapping = {a.stage_index: rank for rank, acts in enumerate(schedule) for a in acts}
    runtime.stage_index_to_group_rank = mapping
    for stage in stages:
        stage.stage_index_to_group_rank = mapping
    order = {rank: _add_reduce_grad(_add_unshard_reshard(list(acts)), num_microbatches)
             for rank, acts in runtime.pipeline_order.items()}
    runtime.pipeline_order_with_comms = _add_send_recv(
        order, stage_to_rank=mapping.__getitem__, num_stages=runtime._num_stages)


class ZeroIndexStage(PipelineStage):
    """``PipelineStage`` whose shape-inference inputs of integer and bool type are zeros.

    torch (2.6 - 2.13) runs each stage's forward once on ``torch.empty`` inputs made from
    the received metadata (``PipelineStage._to_tensor``), to infer shapes. Uninitialised
    integer inputs are out-of-range indices (a stage whose input is the token ids fails in
    ``embedding`` with an IndexError); zeros are a valid index for any non-empty dimension.
    Floating inputs stay as torch makes them. No public hook exists for these inputs.
    """

    def _to_tensor(self, arg: Any) -> torch.Tensor:
        tensor: torch.Tensor = super()._to_tensor(arg)
        if (not isinstance(arg, torch.Tensor) and type(tensor) is torch.Tensor
                and not (tensor.is_floating_point() or tensor.is_complex())):
            tensor.zero_()
        return tensor


def receive_buffers(stage: PipelineStage) -> list[torch.Tensor]:
    """The buffers ``stage`` receives into: one per microbatch for each input and each output
    gradient, allocated once by torch and held across steps (``args_recv_info`` and
    ``grad_recv_info``, internal tables without a public accessor; torch 2.6 - 2.13)."""
    infos = [info for table in (stage.args_recv_info, getattr(stage, "grad_recv_info", {}))
             for group in table.values() for info in group]
    return [buffer for info in infos
            if isinstance(buffer := getattr(info, "buffer", None), torch.Tensor)]


def default_store() -> dist.Store:
    """The rendezvous store of the default process group (``_get_default_store``: torch has
    no public getter; torch 2.6 - 2.13)."""
    return dist.distributed_c10d._get_default_store()


def set_group_timeout(group: dist.ProcessGroup, timeout_s: float) -> None:
    """Make ``group``'s operations (gloo's collectives, NCCL's watchdog) time out after
    ``timeout_s`` seconds from now on (``distributed_c10d._set_pg_timeout``: a group's timeout
    is otherwise fixed when it is made, and a ``DeviceMesh`` makes its groups with the
    backend's default, 30 minutes for gloo; torch 2.6 - 2.13)."""
    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=timeout_s), group)


def incompatible_keys(missing: list[str], unexpected: list[str]) -> Any:
    """What ``nn.Module.load_state_dict`` returns (``_IncompatibleKeys``, a named tuple of
    missing and unexpected keys, private in torch 2.6 - 2.13), for a drop-in override."""
    return nn.modules.module._IncompatibleKeys(missing, unexpected)


def version_counter(tensor: torch.Tensor) -> int:
    """The tensor's in-place version counter (``Tensor._version``, bumped by every in-place
    write such as ``opt.step()``; no public accessor in torch 2.6 - 2.13)."""
    return int(tensor._version)


def found_non_finite(grads: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """1.0 when any of ``grads`` holds an inf or a nan, else 0.0 (a 0-dim float32 tensor on
    ``device``), checked with the kernel ``GradScaler.unscale_`` runs
    (``torch._amp_foreach_non_finite_check_and_unscale_``, here with an inverse scale of 1,
    which leaves the gradients as they are), so this and the scaler agree on what counts.
    No public API checks a list of tensors in one pass; read on torch 2.6 and 2.13.

    Args:
        grads: gradients, on any devices and of any floating dtypes.
        device: where the flag is returned.
    """
    found = torch.zeros((), dtype=torch.float32, device=device)
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        if g.is_sparse:  # its stored values, as the scaler checks them
            g = g.coalesce().values()
        groups.setdefault((g.device, g.dtype), []).append(g)
    with torch.no_grad():
        for (dev, _), tensors in groups.items():
            flag = torch.zeros((), dtype=torch.float32, device=dev)
            torch._amp_foreach_non_finite_check_and_unscale_(
                tensors, flag, torch.ones((), dtype=torch.float32, device=dev))
            found = torch.maximum(found, flag.to(device))
    return found


def split_stage_backward(roots: list[torch.Tensor], grads: list[torch.Tensor],
                         inputs: list[torch.Tensor], params: list[nn.Parameter],
                         ) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """``(I, W)`` as torch.distributed.pipelining's zero-bubble stages run them
    (``_backward.stage_backward_input`` then ``stage_backward_weight``: the stages' own
    split, with no public entry; torch 2.6 - 2.13)."""
    from torch.distributed.pipelining._backward import (
        stage_backward_input,
        stage_backward_weight,
    )

    groups: list[Any] = []

    def run_i() -> Any:
        grads_in, param_groups = stage_backward_input(roots, grads, inputs, iter(params))
        groups.append(param_groups)
        return grads_in

    return run_i, lambda: stage_backward_weight(iter(params), groups[-1])


def time_fsdp_collectives(module: Any, label: str, timer: CollectiveTimer) -> bool:
    """Have FSDP2 module ``module``'s all-gathers and reduce-scatters report to ``timer``
    (named ``"all_gather <label>"``, ``"reduce_scatter <label>"``) during a traced step.

    The seam is public: ``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter``
    (FSDP2 calls the object given with the collective's buffers and group, and it runs the
    collective). What is private is torch's own default collective to delegate to
    (``_fsdp_collectives.DefaultAllGather`` / ``DefaultReduceScatter``: ``all_gather_single``
    and ``reduce_scatter_single`` into buffers from ``torch.empty``), subclassed so that
    FSDP's checks of the comm's type still pass. A collective FSDP2 runs synchronously
    (its reduce-scatters, and on CPU its all-gathers in the hooks) is timed issue to
    completion, all of it exposed. An asynchronous one (the all-gather of torch's pipeline
    ``UNSHARD`` action, ``unshard(async_op=True)``) is timed from its issue to its
    completion (the work's future), and FSDP's later ``wait()`` on it as exposed: the work
    is handed back wrapped in a ``torch.distributed.Work`` subclass whose ``wait`` reports
    (FSDP checks ``isinstance(work, Work)`` and only waits on it). Read on torch 2.13;
    where the seam or the defaults are missing (torch 2.6), nothing is installed.

    Args:
        module: a module ``fully_shard`` returned (an ``FSDPModule``).
        label: the unit's name in the trace (a layer's path, ``"stage 1"``).
        timer: the rank's timer (recording only while a recorder is attached).

    Returns:
        Whether the collectives are timed.
    """
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
            DefaultAllGather,
            DefaultReduceScatter,
        )
    except ImportError:
        return False
    if not (hasattr(module, "set_custom_all_gather")
            and hasattr(module, "set_custom_reduce_scatter")):
        return False
    gather_name, scatter_name = f"all_gather {label}", f"reduce_scatter {label}"

    def timed(name: str, run: Callable[[], Any], async_op: bool) -> Any:
        if not async_op:
            return timer.blocking(name, run)
        work = run()
        slot = timer.issued(name, work)
        return work if slot is None or work is None else _TimedWork(work, timer, slot)

    class TimedAllGather(DefaultAllGather):
        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                     group: dist.ProcessGroup, async_op: bool = False) -> Any:
            return timed(gather_name, lambda: super(TimedAllGather, self).__call__(
                output_tensor, input_tensor, group, async_op), async_op)

    class TimedReduceScatter(DefaultReduceScatter):
        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                     group: dist.ProcessGroup, op: Any, async_op: bool = False) -> Any:
            return timed(scatter_name, lambda: super(TimedReduceScatter, self).__call__(
                output_tensor, input_tensor, group, op, async_op), async_op)

    module.set_custom_all_gather(TimedAllGather())
    module.set_custom_reduce_scatter(TimedReduceScatter())
    return True


class _TimedWork(dist.Work):
    """An asynchronous collective's work whose ``wait`` is timed as exposed
    (:meth:`CollectiveTimer.wait`); the rest is the work's own."""

    def __init__(self, work: dist.Work, timer: CollectiveTimer, slot: int) -> None:
        super().__init__()
        self._work, self._timer, self._slot = work, timer, slot

    def wait(self, timeout: Any = None) -> bool:
        if timeout is not None:
            return bool(self._work.wait(timeout))
        self._timer.wait(self._slot, self._work)
        return True

    def is_completed(self) -> bool:
        return bool(self._work.is_completed())

    def get_future(self) -> Any:
        return self._work.get_future()

    def exception(self) -> Any:
        return self._work.exception()
