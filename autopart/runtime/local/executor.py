"""Local executor: runs a schedule's actions in one process, each stage on its own device."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from autopart.codegen.recompute import check_recompute_policy, run_recomputed
from autopart.codegen.split_backward import SplitBackward
from autopart.core.errors import PlanError
from autopart.core.schedule import Action, Schedule
from autopart.runtime.local.cuda_graphs import StageGraphs
from autopart.runtime.local.issue_threads import IssueThreads, check_issue_threads, thread_orders
from autopart.runtime.tracing import ActionRecorder

__all__ = ["LocalExecutor", "StepResult"]

# loss_closure(mb_index, flat_outputs_of_last_stage) -> scalar loss already scaled by 1/m
LossClosure = Callable[[int, tuple[Any, ...]], torch.Tensor]
# scale_loss(loss) -> the tensor the last stage's backward starts from (a GradScaler's scale)
ScaleLoss = Callable[[torch.Tensor], torch.Tensor]
# on_action(action, live) with live[s] = microbatches whose activations stage s holds now
ActionHook = Callable[[Action, list[int]], None]


class StepResult:
    """What one run of a schedule produced.

    Attributes:
        outputs: per microbatch, the last stage's flat outputs (detached), in mb order;
            inference only: a training step keeps none, each is freed after its backward
            (all m of them held to the step's end had cost m x the logits).
        losses: per microbatch, the scaled loss (training only), detached.
        max_live_activations: per stage, the most microbatches whose forward state was held
            at once (the schedule's in-flight count: m for GPipe, p - s for 1F1B).
        training: the run computes losses and backward actions.
    """

    def __init__(self, num_microbatches: int, num_stages: int, training: bool = False) -> None:
        self.training = training
        self.outputs: list[tuple[Any, ...]] = [() for _ in range(num_microbatches)]
        self.losses: list[torch.Tensor | None] = [None] * num_microbatches
        self.max_live_activations = [0] * num_stages


def _as_leaf(sent: Any, received: Any, requires_grad: bool) -> Any:
    """Make the receiving stage's copy a fresh autograd leaf when the sent value needs grad."""
    if (requires_grad and isinstance(sent, torch.Tensor) and sent.requires_grad
            and isinstance(received, torch.Tensor) and received.is_floating_point()):
        received.requires_grad_(True)
    return received


class _MicrobatchState:
    """A stage's live state for one microbatch between its forward and its (last) backward."""

    __slots__ = ("inputs", "outputs", "roots", "root_grads", "split")

    def __init__(self, inputs: list[Any], outputs: tuple[Any, ...]) -> None:
        self.inputs = inputs  # the leaves the forward ran on
        self.outputs = outputs  # what it returned (sent on to the next stage)
        self.roots: list[torch.Tensor] = []  # where the backward starts (loss or outputs)
        self.root_grads: list[torch.Tensor | None] = []  # gradients of those roots
        self.split: SplitBackward | None = None  # between a split backward's I and its W


class _Streams:
    """CUDA streams and events of a run: one compute and one copy stream per CUDA stage.

    Work is issued from this one thread in schedule order; kernels run asynchronously, so
    stages on different streams (and GPUs) overlap. A value handed from stage ``a`` to
    stage ``b`` carries an event recorded on ``a``'s compute stream after it was produced;
    ``b``'s copy stream waits for it, copies across devices, and ``b``'s compute stream
    waits for the copy (torchgpipe's scheme). ``record_stream`` keeps the caching allocator
    from reusing a buffer another stream still reads. CPU stages get no streams: their work
    is synchronous.
    """

    def __init__(self, devices: Sequence[torch.device]) -> None:
        self.compute = [torch.cuda.Stream(d) if d.type == "cuda" else None for d in devices]
        self.copy = [torch.cuda.Stream(d) if d.type == "cuda" else None for d in devices]
        self.active = any(st is not None for st in self.compute)

    def start(self) -> None:
        """Order the step after the caller's queued work on each device (the optimizer's
        update of the weights, the inputs' copies), which ran on its current stream."""
        for stream in self.compute + self.copy:
            if stream is not None:
                stream.wait_stream(torch.cuda.current_stream(stream.device))

    @contextlib.contextmanager
    def on(self, s: int) -> Iterator[None]:
        """Make stage ``s``'s compute stream current (no-op on CPU)."""
        stream = self.compute[s]
        if stream is None:
            yield
            return
        with torch.cuda.stream(stream):
            yield

    def mark(self, s: int) -> torch.cuda.Event | None:
        """An event at the current end of stage ``s``'s compute stream."""
        stream = self.compute[s]
        if stream is None:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def move(self, value: Any, src_event: torch.cuda.Event | None, dst: int,
             device: torch.device) -> Any:
        """Bring ``value`` to stage ``dst``'s device, ordered after ``src_event``."""
        if not isinstance(value, torch.Tensor):
            return value
        compute, copy = self.compute[dst], self.copy[dst]
        if compute is None or copy is None:
            if src_event is not None:
                src_event.synchronize()
            return value.detach().to(device)
        if value.device == device:
            if src_event is not None:
                compute.wait_event(src_event)
            value.record_stream(compute)
            return value.detach()
        with torch.cuda.stream(copy):
            if src_event is not None:
                copy.wait_event(src_event)
            if value.is_cuda:
                value.record_stream(copy)
            moved = value.detach().to(device, non_blocking=True)
        compute.wait_stream(copy)
        moved.record_stream(compute)
        return moved

    def finish(self) -> None:
        """Make the caller's current streams wait for every stage's work."""
        for stream in self.compute:
            if stream is not None:
                torch.cuda.current_stream(stream.device).wait_stream(stream)


class LocalExecutor:
    """Runs F, B, I and W actions of a schedule on stage modules held in this process.

    Each forward runs under autograd (training) with its inputs as fresh leaves, so the
    backward of stage ``s`` stops at its inputs and their gradients are what stage ``s - 1``
    receives. ``B`` is the full backward (``torch.autograd.backward``); ``I`` computes only
    the input gradients and ``W`` the weight gradients from where ``I`` left them
    (:class:`autopart.codegen.split_backward.SplitBackward`), so ``I + W`` costs about one ``B``
    and equals it exactly. Which stages split is the schedule's to say
    (:func:`autopart.core.schedule.build_schedule` gives a recomputed stage a ``B``, see
    :func:`autopart.core.schedule.splits_backward`); the executor runs what it is given.
    A stage in ``recompute`` runs its training forward under non-reentrant
    ``torch.utils.checkpoint`` with ``recompute_policy``
    (:func:`autopart.codegen.recompute.run_recomputed`): under ``"full"`` only its inputs are
    kept and its whole forward runs again in its backward; under ``"selective"`` the outputs
    of its matmuls and attention are kept too and only the rest runs again.
    A stage's state for a microbatch is dropped as soon as its last backward action ran.
    With ``issue_threads=1`` actions are issued from the caller's thread in
    :func:`autopart.core.schedule.execution_order`; on CPU they run one after another, on
    CUDA each stage has its own compute stream and copies go on a copy stream, so stages
    overlap on the device as far as one host thread issues them fast enough (see
    :class:`_Streams`). With more threads (``None``: one per rank) each rank's actions are
    issued from a worker thread of its own, in the rank's order, a stage's ``F`` waiting for
    the previous stage's outputs and its ``B``/``I`` for the next stage's input gradients
    (:class:`autopart.runtime.local.issue_threads.IssueThreads`, torchgpipe's worker per device): CPU
    stages then run at the same time, CUDA stages are issued in parallel. The same kernels
    run on the same values either way.

    Args:
        stages: stage modules; stage ``s`` takes the values stage ``s - 1`` returns.
        devices: device of each stage.
        recompute: indices of stages that recompute their forward in backward.
        recompute_policy: what those stages recompute, one of
            :data:`autopart.core.recompute_policy.RECOMPUTE_POLICIES` (the plan's
            ``recompute_policy``; default ``"full"``).
        issue_threads: host threads that issue the ranks' actions, rank ``r`` on thread
            ``r % issue_threads`` (default 1: the caller's thread issues every action);
            None: one thread per rank.
        intra_op_threads: with several issuing threads, ``torch.set_num_threads`` per worker
            (default None: the caller's count divided among the workers, at least 1).

    Raises:
        PlanError: stages and devices differ in number, ``issue_threads`` below 1, or a
            ``recompute_policy`` not in ``RECOMPUTE_POLICIES``.
    """

    def __init__(self, stages: Sequence[nn.Module], devices: Sequence[torch.device],
                 recompute: Sequence[int] = (), *, recompute_policy: str = "full",
                 issue_threads: int | None = 1, intra_op_threads: int | None = None) -> None:
        if len(stages) != len(devices):
            raise PlanError(f"{len(stages)} stages but {len(devices)} devices; pass one device "
                            "per stage")
        self.stages = list(stages)
        self.devices = list(devices)
        self.recompute = frozenset(recompute)
        self.recompute_policy = check_recompute_policy(recompute_policy)
        self.issue_threads = issue_threads  # checked by the property
        self._threads = IssueThreads(intra_op_threads)
        # training forwards (and their backwards) replayed as CUDA graphs when set
        self.graphs: StageGraphs | None = None
        # made once and kept: PyTorch keeps a cuBLAS and a cuBLASLt workspace per stream
        # that runs matmuls, so streams made afresh every step would hold more after each step
        self._stream_set: _Streams | None = None
        self._scale_loss: ScaleLoss | None = None


    @property
    def issue_threads(self) -> int | None:
        """Host threads that issue the ranks' actions (None: one per rank); settable between
        steps.

        Raises:
            PlanError: set below 1.
        """
        return self._issue_threads

    @issue_threads.setter
    def issue_threads(self, value: int | None) -> None:
        check_issue_threads(value)
        self._issue_threads = value

    def run(self, schedule: Schedule, mb_inputs: list[list[Any]], *,
            loss_closure: LossClosure | None = None, on_action: ActionHook | None = None,
            recorder: ActionRecorder | None = None,
            scale_loss: ScaleLoss | None = None) -> StepResult:
        """Run every action of ``schedule``.

        Args:
            schedule: per-rank action lists.
            mb_inputs: per microbatch, the flat inputs of stage 0.
            loss_closure: training when given: called on the last stage's outputs of each
                microbatch; the backward starts from the loss it returns.
            on_action: called after every action with the live-microbatch count per stage.
            recorder: when given, every action (and the loss) is timed into it, on the track
                of the rank its stage belongs to (tracing off costs one ``is None`` test).
            scale_loss: training with loss scaling when given (``GradScaler.scale``): each
                microbatch's backward starts from ``scale_loss(loss)``, on the last stage's
                stream; the losses the result holds stay unscaled.

        Returns:
            The outputs, losses and live-activation counts (see :class:`StepResult`).
        """
        num_stages = len(self.stages)
        training = loss_closure is not None
        result = StepResult(len(mb_inputs), num_stages, training)
        # state[(s, i)]: stage s's inputs/outputs for microbatch i until its backward is done
        state: dict[tuple[int, int], _MicrobatchState] = {}
        # grads[(s, i)]: gradients w.r.t. stage s's outputs, sent back by stage s + 1
        grads: dict[tuple[int, int], list[torch.Tensor | None]] = {}
        live = [0] * num_stages
        if self._stream_set is None:
            self._stream_set = _Streams(self.devices)
        streams = self._stream_set
        streams.start()
        # done[(kind, s, i)]: event after stage s produced its outputs ("F") or input grads ("G")
        done: dict[tuple[str, int, int], torch.cuda.Event | None] = {}
        self._streams, self._done, self._scale_loss = streams, done, scale_loss
        if self.graphs is not None:
            self.graphs.begin_step(training)

        def issue(action: Action) -> None:
            if recorder is None:
                self._action(action, mb_inputs, state, grads, live, result, loss_closure)
                return
            s = action.stage_index
            rank = recorder.rank_of_stage(s)
            with recorder.span(rank, str(action), streams.compute[s]):
                self._action(action, mb_inputs, state, grads, live, result, None)
            if loss_closure is not None and action.kind == "F" and s == num_stages - 1:
                with recorder.span(rank, "loss", streams.compute[s], waits=False), \
                        streams.on(s):
                    i = action.mb_index
                    result.losses[i] = loss_closure(i, state[(s, i)].outputs)

        def after(action: Action) -> None:
            if on_action is not None:
                on_action(action, list(live))

        orders = thread_orders(schedule, num_stages, self.issue_threads)
        if len(orders) <= 1:
            for action in (orders[0] if orders else []):
                issue(action)
                after(action)
        else:
            present = frozenset(a for acts in schedule for a in acts)
            self._threads.run(orders, num_stages, present, issue, after)
        streams.finish()
        result.losses = [None if loss is None else loss.detach() for loss in result.losses]
        return result

    def _action(self, action: Action, mb_inputs: list[list[Any]],
                state: dict[tuple[int, int], _MicrobatchState],
                grads: dict[tuple[int, int], list[torch.Tensor | None]], live: list[int],
                result: StepResult, loss_closure: LossClosure | None) -> None:
        """Run one action (a last-stage ``F`` also computes the loss when ``loss_closure``)."""
        num_stages, streams = len(self.stages), self._streams
        training = result.training
        s, i = action.stage_index, action.mb_index
        if action.kind == "F":
            self._forward(s, i, mb_inputs, state, training)
            if s == num_stages - 1:
                outs = state[(s, i)].outputs
                if not training:
                    result.outputs[i] = tuple(o.detach() if isinstance(o, torch.Tensor) else o
                                              for o in outs)
                if loss_closure is not None:
                    with streams.on(s):
                        result.losses[i] = loss_closure(i, outs)
            if training:
                live[s] += 1
                result.max_live_activations[s] = max(result.max_live_activations[s], live[s])
            else:  # inference: what the next stage has received can go
                state.pop((s - 1, i), None)
                if s == num_stages - 1:
                    del state[(s, i)]
        else:
            st = state[(s, i)]
            with streams.on(s):
                if not st.roots:
                    self._set_roots(st, s, i, result, grads)
                if action.kind == "B":
                    if st.roots:
                        torch.autograd.backward(st.roots, st.root_grads)
                    input_grads = [a.grad if isinstance(a, torch.Tensor) else None
                                   for a in st.inputs]
                    if self.graphs is not None and self.graphs.release(s, i):
                        # a replay's input gradients are the graph's buffers: copy them out
                        input_grads = [None if g is None else g.clone() for g in input_grads]
                    self._send_input_grads(s, i, st, input_grads, grads)
                elif action.kind == "I":
                    self._send_input_grads(s, i, st, self._input_grads(s, st), grads)
                elif st.split is not None:  # W
                    st.split.weight_grads()
                    st.split = None
            if action.kind in "BW":
                del state[(s, i)]
                live[s] -= 1

    def _forward(self, s: int, i: int, mb_inputs: list[list[Any]],
                 state: dict[tuple[int, int], _MicrobatchState], training: bool) -> None:
        device = self.devices[s]
        streams = self._streams
        if s == 0:
            sent, event, grad = mb_inputs[i], None, False
        else:
            sent, event, grad = state[(s - 1, i)].outputs, self._done.get(("F", s - 1, i)), training
        args = [_as_leaf(v, streams.move(v, event, s, device), grad) for v in sent]
        with streams.on(s), torch.set_grad_enabled(training):
            if training and s in self.recompute:
                out = run_recomputed(self.stages[s], *args, policy=self.recompute_policy)
            elif training and self.graphs is not None:
                out = self.graphs.forward(s, i, args)
            else:
                out = self.stages[s](*args)
        self._done[("F", s, i)] = streams.mark(s)
        state[(s, i)] = _MicrobatchState(args, tuple(out))

    def _set_roots(self, st: _MicrobatchState, s: int, i: int, result: StepResult,
                   grads: dict[tuple[int, int], list[torch.Tensor | None]]) -> None:
        received = grads.pop((s, i), None)
        if received is None:  # last stage: the backward starts at the (scaled) loss
            loss = result.losses[i]
            assert loss is not None, "the last stage's forward computes the loss"
            root = loss if self._scale_loss is None else self._scale_loss(loss)
            st.roots, st.root_grads = [root], [None]
            # the step keeps the loss's value only: its graph must go with this state after
            # the last backward action (a split I runs with retain_graph, so until W frees
            # the state, only the state may hold what its graph saved)
            result.losses[i] = loss.detach()
            return
        pairs = [(o, g) for o, g in zip(st.outputs, received, strict=True)
                 if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
        st.roots = [o for o, _ in pairs]
        st.root_grads = [g for _, g in pairs]

    def _input_grads(self, s: int, st: _MicrobatchState) -> list[torch.Tensor | None]:
        tensors = [a for a in st.inputs if isinstance(a, torch.Tensor)]
        params = [p for p in self.stages[s].parameters() if p.requires_grad]
        st.split = SplitBackward(st.roots, st.root_grads, tensors, params)
        by_id = {id(a): g for a, g in zip(tensors, st.split.input_grads(), strict=True)}
        return [by_id.get(id(a)) if isinstance(a, torch.Tensor) else None for a in st.inputs]

    def _send_input_grads(self, s: int, i: int, st: _MicrobatchState,
                          input_grads: list[torch.Tensor | None],
                          grads: dict[tuple[int, int], list[torch.Tensor | None]]) -> None:
        if s == 0:
            return
        prev = self.devices[s - 1]
        event = self._streams.mark(s)
        grads[(s - 1, i)] = [self._streams.move(g, event, s - 1, prev) if g is not None else None
                             for g in input_grads]
