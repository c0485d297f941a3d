"""Exact per-stage costs of one candidate: compute and sends (µs), memory by lifetime (bytes)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from autopart.core.schedule import splits_backward
from autopart.solver._cost_model import CostModel
from autopart.solver.simulate import StageCosts

__all__ = ["StageSpan", "StageTerms", "stage_terms", "stage_costs"]


@dataclass(frozen=True, slots=True)
class StageSpan:
    """Where one stage of a candidate sits.

    Attributes:
        index: stage index s, ``0 <= s < count``.
        count: stages of the candidate, ``p * v``.
        start, stop: its op nodes ``start .. stop - 1``.
        rank: the rank that runs it (``placement[s]``).
        num_ranks: p.
        recompute: whether it recomputes its forward in its backward.
        placement: stage -> rank of every stage of the candidate; empty (default): stage
            ``t`` on rank ``t % p``.
    """

    index: int
    count: int
    start: int
    stop: int
    rank: int
    num_ranks: int
    recompute: bool
    placement: tuple[int, ...] = ()

    def rank_of(self, stage: int) -> int:
        """The rank that runs ``stage`` of the candidate."""
        return self.placement[stage] if self.placement else stage % self.num_ranks

    @property
    def first(self) -> bool:
        """The first stage (it reads the user's microbatches; its inputs need no gradient)."""
        return self.index == 0

    @property
    def last(self) -> bool:
        """The last stage (its outputs go to the loss)."""
        return self.index == self.count - 1


@dataclass(frozen=True, slots=True)
class StageTerms:
    """What one stage costs per microbatch, as the simulator charges it
    (:class:`~autopart.solver.simulate.StageCosts` has one column per field but
    ``param_bytes`` and ``num_parameters``).

    Attributes:
        fwd_us, bwd_input_us, bwd_weight_us: F, I (or the whole B) and W compute, the runtime's
            cost per transfer included, µs (backward parts 0 for inference).
        send_fwd_us, send_bwd_us: sending the output forward and the input gradient back, µs.
        static_bytes: held for the whole step: parameter state, workspaces, buffers.
        saved_bytes: one microbatch's hold from its forward until its backward.
        backward_extra_bytes: live only while one backward runs (working set, recomputed).
        split_held_bytes: one microbatch's hold from its ``I`` until its ``W`` (ZB-H1).
        weight_grad_bytes: live while one ``W`` runs (ZB-H1).
        kept_bytes: what each backward leaves held until the step ends (torch's stages).
        kept_held_bytes: the part of ``kept_bytes`` held already before the backward (the
            sent output).
        param_bytes: bytes of every parameter and buffer its nodes read.
        num_parameters: elements of the trainable parameters its nodes read.
        host_fwd_us, host_bwd_input_us, host_bwd_weight_us: the host's issue time of F, I
            (or the whole B) and W, the runtime's cost per transfer included, µs (0.0: the
            profile has no host times).
        fwd_exchange_us, bwd_exchange_us: the expert all-to-alls inside F and inside a whole
            B (a recomputing stage's B runs its forward's again) that a DualPipe-V pair
            hides, µs (0.0 but under DualPipe-V on costs that record them apart:
            :meth:`CostModel.exchange_us`).
    """

    fwd_us: float
    bwd_input_us: float
    bwd_weight_us: float
    send_fwd_us: float
    send_bwd_us: float
    static_bytes: int
    saved_bytes: int
    backward_extra_bytes: int
    split_held_bytes: int
    weight_grad_bytes: int
    kept_bytes: int
    kept_held_bytes: int
    param_bytes: int
    num_parameters: int
    host_fwd_us: float = 0.0
    host_bwd_input_us: float = 0.0
    host_bwd_weight_us: float = 0.0
    fwd_exchange_us: float = 0.0
    bwd_exchange_us: float = 0.0


def stage_costs(terms: Sequence[StageTerms], issue_thread: Sequence[int] = (),
                ranks_per_core: float = 1.0) -> StageCosts:
    """The simulator's per-stage columns of ``terms``; ``issue_thread``: per stage, the host
    thread that issues it (default: none given, each rank its own); ``ranks_per_core``: the
    runtime's rank processes per CPU core (default 1.0, a core each). The host columns are
    left empty when every host time is 0 (a profile without host times)."""
    host = any(t.host_fwd_us or t.host_bwd_input_us or t.host_bwd_weight_us for t in terms)
    paired = any(t.fwd_exchange_us or t.bwd_exchange_us for t in terms)
    return StageCosts(
        [t.fwd_us for t in terms], [t.bwd_input_us for t in terms],
        [t.bwd_weight_us for t in terms], [t.send_fwd_us for t in terms],
        [t.send_bwd_us for t in terms], [t.static_bytes for t in terms],
        [t.saved_bytes for t in terms], [t.backward_extra_bytes for t in terms],
        [t.split_held_bytes for t in terms], [t.weight_grad_bytes for t in terms],
        [t.kept_bytes for t in terms], [t.kept_held_bytes for t in terms],
        host_fwd_us=[t.host_fwd_us for t in terms] if host else (),
        host_bwd_input_us=[t.host_bwd_input_us for t in terms] if host else (),
        host_bwd_weight_us=[t.host_bwd_weight_us for t in terms] if host else (),
        issue_thread=tuple(issue_thread) if host else (), ranks_per_core=ranks_per_core,
        fwd_exchange_us=[t.fwd_exchange_us for t in terms] if paired else (),
        bwd_exchange_us=[t.bwd_exchange_us for t in terms] if paired else ())


def stage_terms(model: CostModel, kind: str, span: StageSpan, m: int) -> StageTerms:
    """Cost one stage exactly at ``m`` microbatches under schedule ``kind``."""
    ratio, training = model.ratio(m), model.training
    (fwd, bi, bw), host = _compute_us(model, kind, span, ratio)
    cross_in = model.scale_bytes(model.crossing[span.start], ratio)
    cross_out = model.scale_bytes(model.crossing[span.stop], ratio)
    # the gradients sent back across each cut (MemoryModel.grad_crossing)
    grad_in, grad_out = (model.scale_bytes(model.grad_crossing[k], ratio)
                         for k in (span.start, span.stop))
    state, pbytes, numel = model.state_of(span.start, span.stop)
    transient = model.transient_bytes(span.start, span.stop, ratio)
    saved, recomputed = _saved_bytes(model, span, cross_in, cross_out, ratio)
    split_here = training and splits_backward(kind, span.recompute)
    # the first stage's I computes nothing (its inputs need no gradient): no working set (its
    # W, the whole backward, has it)
    empty_i = split_here and span.first
    held, wgrad = _split_bytes(model, span, cross_out, transient, ratio) \
        if split_here else (0, 0)
    kept, kept_held = _kept_bytes(model, span, grad_in, cross_out, split_here)
    cluster, s, r = model.cluster, span.index, span.rank
    return StageTerms(
        fwd_us=fwd, bwd_input_us=bi if training else 0.0, bwd_weight_us=bw if training else 0.0,
        send_fwd_us=cluster.transfer_us(cross_out, r, span.rank_of(s + 1))
        if not span.last else 0.0,
        send_bwd_us=cluster.transfer_us(cross_in, r, span.rank_of(s - 1))
        if not span.first and training else 0.0,
        static_bytes=_static_bytes(model, span, state, cross_in, cross_out, grad_out,
                                   transient, m),
        saved_bytes=saved,
        backward_extra_bytes=_backward_extra(model, span, kind, transient, recomputed,
                                             cross_out, ratio) if not empty_i else 0,
        split_held_bytes=held, weight_grad_bytes=wgrad,
        kept_bytes=kept, kept_held_bytes=kept_held,
        param_bytes=pbytes, num_parameters=numel,
        host_fwd_us=host[0], host_bwd_input_us=host[1] if training else 0.0,
        host_bwd_weight_us=host[2] if training else 0.0,
        **_exchanges(model, kind, span, ratio, fwd, bi + bw))


def _exchanges(model: CostModel, kind: str, span: StageSpan, ratio: float, fwd: float,
               bwd: float) -> dict[str, float]:
    """The stage's ``fwd_exchange_us`` and ``bwd_exchange_us`` (:class:`StageTerms`), at
    the rank's speed, within its ``F`` (``fwd``) and whole ``B`` (``bwd``), µs: only for
    training under DualPipe-V, whose pairs hide them, on costs that record them."""
    if kind != "dualpipev" or not model.training or not model.has_exchanges:
        return {}
    a, z, f = span.start, span.stop, model.speed(span.rank)
    fx = model.exchange_us("fwd", a, z, ratio) * f
    bx = model.exchange_us("bwd", a, z, ratio) * f + (fx if span.recompute else 0.0)
    return {"fwd_exchange_us": min(fx, fwd), "bwd_exchange_us": min(bx, bwd)}


def _backward_extra(model: CostModel, span: StageSpan, kind: str, transient: int,
                    recomputed: int, cross_out: int, ratio: float) -> int:
    """What one backward of the stage holds above what it began with, bytes: where the stage
    does not split its backward, the largest node working set less what the backward freed
    before reaching it (:meth:`MemoryModel.backward_working_bytes`), and where it
    recomputes, the forward it recomputes beside the larger of that and the recomputation's
    own working set (:meth:`MemoryModel.recomputation_bytes`); where it splits, the forward
    it recomputes (if it does) and the largest node working set whole (an ``I`` keeps the
    saved set for its ``W``). Less, on torch's last stage recomputing, the loss's saved set.

    Measured on 2 gloo ranks (1F1B m 4): the demo's GPT-2 (12 layers, n_embd 768, vocabulary
    50257, 2 x 128 tokens per microbatch), its first stage recomputing whole or selectively,
    peaked at 1781.5 and 1849.8 MiB, where the recomputed set beside the whole largest working
    set (the embedding table's dense gradient, made last, after the recomputed set is freed)
    priced 1918.2 and 1985.7 (1.08x); with the walk, 1783.0 and 1850.6 (1.00x). On the
    6-layer, n_embd 384 one and on a 4-layer Llama (every policy): 1.000-1.04x.

    torch's last stage runs the loss outside the forward it recomputes: the loss's backward
    runs first and frees what the loss saved, and only then does the stage's first saved
    tensor unpack and the recomputation begin. The stage holds the loss's saved set from F to
    B (:func:`_saved_bytes`), so while it recomputes it holds that much less: ``transient +
    max(recomputed - loss, 0)`` (the loss's own backward, the larger working set at worst,
    is covered by ``transient``). Measured on 2 gloo ranks (GPT-2, 6 layers, n_embd 384,
    vocabulary 8192, 2 x 256 tokens per microbatch, 1F1B m 4): the last stage recomputing
    (full or selective) peaked at 195.0 MiB, 19 MiB under the same cut without recompute
    (214.0), where counting the loss's saved set twice priced both at 226.8 MiB (1.16x).

    Measured on 2 gloo ranks (Llama, 4 layers, hidden 256, 4 x 1024 tokens, pp 2, the
    distributed runtime): with the credit, stages that recompute nothing were predicted
    1.01-1.07x of their measured peak (1.03-1.16x without). Recomputing stages: credited
    without the recomputation's own working set, the op-level policy's first rank was
    0.996x (its peak fell inside the recomputation); with it, 1.003x."""
    if not model.training:
        return 0
    if span.recompute or splits_backward(kind, span.recompute):
        freed = (model.scale_bytes(model.costs.loss_saved_bytes, ratio)
                 if span.recompute and span.last and _torch_held(model) else 0)
        if span.recompute and not splits_backward(kind, span.recompute):
            walk = model.backward_working_bytes(span.start, span.stop, ratio,
                                                0 if span.last else cross_out)
            return max(recomputed - freed, 0) + max(
                walk, model.recomputation_bytes(span.start, span.stop, ratio))
        return transient + max(recomputed - freed, 0)
    return model.backward_working_bytes(span.start, span.stop, ratio,
                                        0 if span.last else cross_out)


def _compute_us(model: CostModel, kind: str, span: StageSpan, ratio: float,
                ) -> tuple[tuple[float, float, float], tuple[float, float, float]]:
    """``((F, I, W), (host F, host I, host W))`` of the stage, µs; a backward run whole is
    all in ``I``.

    Each action costs the slower of its device time and its host's issue time, where the
    profile has host times (``CostModel.has_host_times``; else the host columns are 0 and
    the actions cost their device time, as before host times existed). A stage the runtime
    replays as CUDA graphs (``RuntimeDescription.cuda_graphs``; not one that recomputes or
    splits its backward, which run eagerly) has no host column: one launch issues a whole
    action. The runtime's cost per transfer is host work: it is added to both columns.
    """
    a, z, s = span.start, span.stop, span.index
    f = model.speed(span.rank)
    split_us = (model.split_overhead_us(a, z, ratio)
                if splits_backward(kind, span.recompute) and not span.first else 0.0)
    # a recomputation runs the stage's forward again up to its last saved tensor only
    again = model.recompute_stop(a, z) if span.recompute else z
    ends = {"recompute": again}
    fwd, bi, bw = _actions(kind, span, *(model.part_us(part, a, ends.get(part, z), ratio) * f
                                         for part in _PARTS), split_us * f)
    if span.recompute:  # the selective policy's checkpointing runs in the forward too
        fwd += model.recompute_fwd_extra_us(a, z) * f
    host = (0.0, 0.0, 0.0)
    graphed = (model.runtime.cuda_graphs and not span.recompute
               and not splits_backward(kind, span.recompute))
    if model.has_host_times and not graphed:  # a graph replay issues its kernels at once
        host = _actions(kind, span, *(model.host_part_us(part, a, ends.get(part, z))
                                      for part in _PARTS), split_us)
        if splits_backward(kind, span.recompute):  # I and W are actions of their own
            fwd, bi, bw = max(fwd, host[0]), max(bi, host[1]), max(bw, host[2])
        else:  # one B: the slower side of the whole backward, all in I
            fwd, bi, bw = max(fwd, host[0]), max(bi + bw, host[1] + host[2]), 0.0
            host = (host[0], host[1] + host[2], 0.0)
    # the runtime's own cost of each transfer between ranks an action posts or waits on
    # (RuntimeDescription.transfer_overhead_us, or its transfer_wait_points): F receives the
    # stage's input and sends its output, B (or I) receives the output's gradient and sends
    # the input's; a split's W neither. Two neighbouring stages on one rank (the bottom of a
    # V) hand their values over in memory: no transfer
    if span.num_ranks > 1:
        transfers = ((s > 0 and span.rank_of(s - 1) != span.rank)
                     + (s < span.count - 1 and span.rank_of(s + 1) != span.rank))
        # where ranks share cores a transfer also waits for its receiver to be scheduled,
        # which grows with the action's work (RuntimeDescription.transfer_cost_at)
        tax_f = model.runtime.transfer_cost_at(fwd) * transfers
        tax_b = model.runtime.transfer_cost_at(bi) * transfers if model.training else 0.0
        fwd += tax_f
        bi += tax_b
        if model.has_host_times:
            host = (host[0] + tax_f, host[1] + tax_b, host[2])
    return (fwd, bi, bw), host


#: The parts of a node's time, as ``CostModel.part_us`` names them.
_PARTS = ("fwd", "bwd_input", "bwd_weight", "recompute")


def _actions(kind: str, span: StageSpan, fwd: float, bi: float, bw: float, again: float,
             split_us: float) -> tuple[float, float, float]:
    """``(F, I, W)`` of a stage from the sums of its nodes' parts (device or host side), µs:
    recompute adds ``again`` (the forward it runs again: all of it under the ``"full"``
    policy, its unkept nodes' under ``"selective"``) to the backward; a split backward
    charges ``split_us`` to ``W``; a backward run whole is all in ``I``."""
    if span.recompute:
        bi = bi + again
    if splits_backward(kind, span.recompute):
        if span.first:
            # the first stage's inputs need no gradient: its I computes nothing and its W is
            # one whole backward, unsplit (torch's stages run it as "full"; the local
            # executor's SplitBackward seeds it from the roots)
            bi, bw = 0.0, bi + bw
        else:
            # the split's own cost goes to W (I runs as fast as its share of B)
            bw += split_us
    if splits_backward(kind, False) and not splits_backward(kind, span.recompute):
        bi, bw = bi + bw, 0.0  # one B where its I would be; no W
    return fwd, bi, bw


def _static_bytes(model: CostModel, span: StageSpan, state: int, cross_in: int,
                  cross_out: int, grad_out: int, transient: int, m: int) -> int:
    """Held for the whole step: parameter state, the device's workspaces, receive and send
    buffers, and (inference) the working set; ``grad_out``: the bytes of the output
    gradients the stage receives (its outputs that carry one)."""
    training = model.training
    # torch's stages receive into one buffer per microbatch: the input (not on the first
    # stage, which reads the user's microbatches) and the output gradient (not on the last,
    # which starts from the loss; only the outputs that carry a gradient get one)
    many = m if training and model.runtime.receive_buffers_per_microbatch else 1
    # training, the last stage holds each microbatch's outputs from its F to its B (in
    # saved_bytes) and in no output buffer: neither runtime returns them
    out_buffers = many if not span.last else 0 if training else 1
    # the stage's compute stream holds cuBLAS workspaces on a GPU (0 on the CPU)
    return (state + model.cluster.devices[span.rank].workspace_bytes
            + (many if not span.first else 1) * cross_in
            + out_buffers * (grad_out if training else cross_out)
            + (0 if training else transient))


def _saved_bytes(model: CostModel, span: StageSpan, cross_in: int, cross_out: int,
                 ratio: float) -> tuple[int, int]:
    """``(held from F to B, recomputed in B)`` per microbatch, bytes (0 for inference)."""
    training = model.training
    # the last stage's outputs (the logits the loss reads) stay held, in both runtimes, from
    # its forward until that microbatch's backward (held_parts counts them where the profile
    # says which storages nodes returned)
    held_out = cross_out if training and span.last else 0
    inside, outs, strided = (model.scale_bytes(x, ratio)
                             for x in model.held_parts(span.start, span.stop)) \
        if training else (0, 0, 0)
    if not span.recompute:
        saved = (inside + outs + strided if model.held_bytes_cover_outputs
                 else inside + held_out)
        return saved, 0
    # the selective policy also keeps its kept nodes' outputs from F to B; its backward
    # holds the saved set instead (MemoryModel.selective_kept_bytes; 0 under "full")
    kept = model.scale_bytes(model.selective_kept_bytes(span.start, span.stop), ratio) \
        if training else 0
    # what the checkpoint itself keeps from F to B (the CPU generator's state on CPU ranks)
    rng = model.runtime.checkpoint_held_bytes if training else 0
    if _torch_held(model):
        # a recomputed stage of torch's keeps its outputs (the stage's cache), the copies of
        # strided values and the loss's saved set (the loss runs outside the recomputed
        # forward) from F to B; its inputs are receive buffers (static). The backward
        # recomputes the rest
        loss = model.scale_bytes(model.costs.loss_saved_bytes, ratio) if span.last else 0
        return outs + strided + loss + kept + rng, max(inside - loss - kept, 0)
    return cross_in + held_out + kept + rng, max(inside + outs - kept, 0)


def _split_bytes(model: CostModel, span: StageSpan, cross_out: int,
                 transient: int, ratio: float) -> tuple[int, int]:
    """``(held from I to W, live during W)`` of a stage whose backward splits, bytes."""
    # from I to W a split backward keeps the gradients W restarts from: where parameter paths
    # join the activations' (SplitBackward's intermediates); on the first stage, whose inputs
    # need no gradient, I computes nothing and W restarts from the stage's outputs and their
    # gradients, which torch's stages hold anyway (the outputs in held_bytes, their gradients
    # in receive buffers)
    if span.first:
        held = 0 if _torch_held(model) else 2 * cross_out
    else:
        held = model.split_held_bytes(span.start, span.stop, ratio)
    # a W adds each parameter group's gradients to .grad before the next group's (autopart's
    # SplitBackward and torch's stage_backward_weight alike): one node's working set.
    # autopart's W on the first stage is the whole backward in one call, whose gradients are
    # returned together (MemoryModel.whole_backward_bytes)
    wgrad = (model.whole_backward_bytes(span.start, span.stop, ratio)
             if span.first and not model.runtime.receive_buffers_per_microbatch else transient)
    return held, wgrad


def _kept_bytes(model: CostModel, span: StageSpan, grad_in: int, cross_out: int,
                split: bool) -> tuple[int, int]:
    """``(kept, held before)``, bytes: what each backward of the stage leaves held until the
    step ends, and the part of it the stage held already when that backward began
    (``grad_in``: the bytes of its inputs' gradients; ``split``: its backward splits).

    torch's stages keep what they send: each sent output (the schedule waits on every send at
    the step's end; until B its forward's saved set or the stage's cache held it) and each
    input gradient (in the receive buffer's ``.grad`` until the next step clears it). The
    sent output is in the stage's saved set from its forward on (:meth:`MemoryModel.
    held_parts`), unless the stage recomputes (its saved set is rebuilt) or its backward
    splits (it sends a copy of its own).
    """
    if not (model.training and model.runtime.receive_buffers_per_microbatch):
        return 0, 0
    out = cross_out if not span.last else 0
    held = out if _torch_held(model) and not span.recompute and not split else 0
    return out + (grad_in if not span.first else 0), held


def _torch_held(model: CostModel) -> bool:
    """torch's stages on a profile that says which saved storages nodes returned
    (:meth:`CostModel.held_parts`): what they hold is counted part by part."""
    return model.runtime.receive_buffers_per_microbatch and model.held_bytes_cover_outputs
