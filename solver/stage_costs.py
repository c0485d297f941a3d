"""StageCosts: what the schedule simulator replays, per stage (times, memory) and per link."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from autopart.core.errors import PlanError

__all__ = ["StageCosts"]


@dataclass(frozen=True, slots=True)
class StageCosts:
    """Per-microbatch costs of every stage, as the simulator charges them.

    All lists have one entry per stage (``S = p * v``). Times in µs, memory in bytes.

    Attributes:
        fwd_us: forward compute of stage s.
        bwd_input_us: input-gradient compute (``I``), recompute's extra forward included.
        bwd_weight_us: weight-gradient compute (``W``); a full ``B`` costs ``I + W``.
        send_fwd_us: time stage s spends sending its output to stage s + 1 (0 for the last).
        send_bwd_us: time stage s spends sending its input gradient to s - 1 (0 for the first).
        static_bytes: parameter state and other memory held for the whole step.
        saved_bytes: memory one microbatch keeps from its forward until its backward ends
            (the stage input only, when the stage recomputes).
        backward_extra_bytes: memory live only while one backward of the stage runs (the
            recomputed activations plus the transient working set).
        split_held_bytes: memory one microbatch holds from its ``I`` until its ``W`` on
            top of ``saved_bytes``: the gradients ``W`` restarts autograd from (those of
            the outputs of the ops that read a trainable parameter; ZB-H1 only, Qi et al.
            2024). Default: none.
        weight_grad_bytes: memory live while one ``W`` of the stage runs: the parameter
            gradients its autograd calls return before they are added to ``.grad``, and
            their working set (ZB-H1 only). Default: none.
        kept_bytes: memory each ``B`` (or ``I``) of the stage leaves held until the step
            ends: with torch.distributed.pipelining, the output the microbatch sent (held
            by its forward's saved set or the stage's cache until then, then by the send,
            which the schedule waits on at the step's end) and the input gradient it sent
            (in the receive buffer's ``.grad`` until the next step). Default: none.
        kept_held_bytes: the part of ``kept_bytes`` the rank holds already when the ``B`` (or
            ``I``) starts: the sent output, in ``saved_bytes`` (or a receive buffer passed
            on, in ``static_bytes``) since the forward. The backward's peak adds only the
            rest (the input gradient it makes); after it ends the whole ``kept_bytes`` stays
            while ``saved_bytes`` goes. Default: none (all of ``kept_bytes`` is new).
        host_fwd_us, host_bwd_input_us, host_bwd_weight_us: the host's issue time of the
            stage's ``F``, ``I`` (a full ``B`` issues ``I + W``) and ``W``, µs; the device
            columns above already cost each action at the slower of its two sides. Default:
            none (the host runs the ops itself, as on the CPU: no host bound).
        issue_thread: per stage, the host thread that issues its actions; stages sharing
            one are bounded by the sum of their host times (:func:`host_bound_us`). Default:
            none given: each rank's stages share the rank's own thread.
        ranks_per_core: rank processes per CPU core of the host
            (``RuntimeDescription.ranks_per_core``; default 1.0: a core each, no bound);
            above 1, a step is no shorter than :func:`core_bound_us`.
        fwd_exchange_us, bwd_exchange_us: the part of ``fwd_us`` and of a full ``B``
            (``bwd_input_us``) that is expert parallelism's all-to-alls, which the other
            action of a DualPipe-V pair hides under its compute where the runtime overlaps
            them (:func:`autopart.core.plan_rules.overlaps_expert_exchanges`): the pair then
            takes :meth:`pair_us`. Default: none (pairs run one after the other).
    """

    fwd_us: Sequence[float]
    bwd_input_us: Sequence[float]
    bwd_weight_us: Sequence[float]
    send_fwd_us: Sequence[float]
    send_bwd_us: Sequence[float]
    static_bytes: Sequence[int]
    saved_bytes: Sequence[int]
    backward_extra_bytes: Sequence[int]
    split_held_bytes: Sequence[int] = ()
    weight_grad_bytes: Sequence[int] = ()
    kept_bytes: Sequence[int] = ()
    kept_held_bytes: Sequence[int] = ()
    host_fwd_us: Sequence[float] = ()
    host_bwd_input_us: Sequence[float] = ()
    host_bwd_weight_us: Sequence[float] = ()
    issue_thread: Sequence[int] = ()
    ranks_per_core: float = 1.0
    fwd_exchange_us: Sequence[float] = ()
    bwd_exchange_us: Sequence[float] = ()

    def __post_init__(self) -> None:
        n = len(self.fwd_us)
        if not self.ranks_per_core > 0.0:
            raise PlanError(f"StageCosts.ranks_per_core={self.ranks_per_core} must be > 0")
        optional = ("split_held_bytes", "weight_grad_bytes", "kept_bytes", "kept_held_bytes")
        for name in optional:
            if not getattr(self, name):
                object.__setattr__(self, name, (0,) * n)
        for name in ("bwd_input_us", "bwd_weight_us", "send_fwd_us", "send_bwd_us",
                     "static_bytes", "saved_bytes", "backward_extra_bytes", *optional):
            if len(getattr(self, name)) != n:
                raise PlanError(f"StageCosts.{name} has {len(getattr(self, name))} entries, "
                                f"fwd_us has {n}; give one per stage")
        for name in ("host_fwd_us", "host_bwd_input_us", "host_bwd_weight_us", "issue_thread",
                     "fwd_exchange_us", "bwd_exchange_us"):
            if len(getattr(self, name)) not in (0, n):
                raise PlanError(f"StageCosts.{name} has {len(getattr(self, name))} entries, "
                                f"fwd_us has {n}; give one per stage or none")
        if len({len(self.host_fwd_us), len(self.host_bwd_input_us),
                len(self.host_bwd_weight_us)}) > 1:
            raise PlanError("StageCosts: give the three host columns (host_fwd_us, "
                            "host_bwd_input_us, host_bwd_weight_us) together or none of them")

    @property
    def overlaps_pairs(self) -> bool:
        """Whether DualPipe-V's forward-backward pairs hide all-to-alls (the exchange columns
        are given and not all 0)."""
        return any(self.fwd_exchange_us) or any(self.bwd_exchange_us)

    def pair_us(self, forward: int, backward: int) -> float:
        """One DualPipe-V pair, stage ``forward``'s ``F`` with stage ``backward``'s whole
        ``B`` at once, as the runtime runs it (the backward on a second thread): each
        thread's own chain of compute and all-to-alls, and the two computes one after the
        other (they share the device: a GPU's streams, a CPU rank's cores), so the longest
        of the three; the sends after both, as torch sends after the pair. µs.

        ``max(Fc + Bc, Fc + Fx, Bc + Bx) + send_F + send_B`` with ``Fx``, ``Bx`` the
        exchange columns and ``Fc = F - Fx``, ``Bc = I + W - Bx``.
        """
        fx = self.fwd_exchange_us[forward] if self.fwd_exchange_us else 0.0
        bx = self.bwd_exchange_us[backward] if self.bwd_exchange_us else 0.0
        f = self.fwd_us[forward]
        b = self.bwd_input_us[backward] + self.bwd_weight_us[backward]
        fc, bc = f - fx, b - bx
        return (max(fc + bc, f, b) + self.send_fwd_us[forward]
                + self.send_bwd_us[backward])

    @property
    def has_host(self) -> bool:
        """Whether the host's issue times are given (then :func:`host_bound_us` applies)."""
        return bool(self.host_fwd_us)
