"""A stage estimate straight from CostModel's per-node lines: the two-point tests' oracle."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from autopart.solver._cost_model import CostModel

__all__ = ["StageEstimate", "stage_estimates"]


@dataclass(frozen=True, slots=True)
class StageEstimate:
    """Predicted per-microbatch cost of op nodes ``start .. stop - 1`` run as stage ``stage``.

    Attributes:
        stage: stage index (= rank).
        start: first op node index.
        stop: one past the last op node index.
        fwd_us: forward time, µs.
        bwd_us: backward time, µs (0 for inference).
        comm_us: forward send of the outgoing cut plus, when training, the gradient send of the
            incoming cut, µs.
        peak_memory_bytes: parameter state + saved activations of all microbatches + largest
            single-node output + incoming and outgoing crossing bytes.
        param_bytes: bytes of every parameter and buffer its nodes read.
        num_parameters: elements of the trainable parameters its nodes read.
    """

    stage: int
    start: int
    stop: int
    fwd_us: float
    bwd_us: float
    comm_us: float
    peak_memory_bytes: int
    param_bytes: int
    num_parameters: int

    @property
    def time_us(self) -> float:
        """Stage time per microbatch, µs: fwd + bwd + comm."""
        return self.fwd_us + self.bwd_us + self.comm_us


def stage_estimates(model: CostModel, positions: Sequence[int], m: int) -> list[StageEstimate]:
    """Simple per-stage time and memory of cuts at node ``positions`` at ``m`` microbatches:
    the closed-form check of :class:`CostModel`'s scaling that the two-point tests read.

    Communication uses the actual link between the two ranks of each cut.
    """
    costs, r = model.costs, model.ratio(m)
    n = len(costs.nodes)
    bounds = [0, *positions, n]
    out: list[StageEstimate] = []
    for s, (a, z) in enumerate(itertools.pairwise(bounds)):
        if model._measured_at(r) is not None:
            fwd = model.part_us("fwd", a, z, r)
            bwd = (model.part_us("bwd_input", a, z, r) + model.part_us("bwd_weight", a, z, r)
                   if model.training else 0.0)
        else:
            fwd = sum(f + ln * r for f, ln in model._node_fwd[a:z])
            bwd = sum(f + ln * r for f, ln in model._node_bwd[a:z]) if model.training else 0.0
        cross_in = model.scale_bytes(model.crossing[a], r)
        cross_out = model.scale_bytes(model.crossing[z], r)
        comm = model.cluster.transfer_us(cross_out, s, s + 1) if z < n else 0.0
        if model.training and a > 0:
            comm += model.cluster.transfer_us(cross_in, s, s - 1)
        params = sorted({p for nd in costs.nodes[a:z] for p in nd.params})
        state = sum(model.state_bytes[p] for p in params)
        saved = m * model.scale_bytes(model._saved[z] - model._saved[a], r) if model.training else 0
        transient = max(model.scale_bytes(nd.output_bytes, r) for nd in costs.nodes[a:z])
        out.append(StageEstimate(
            stage=s, start=a, stop=z, fwd_us=fwd, bwd_us=bwd, comm_us=comm,
            peak_memory_bytes=(state + saved + transient + cross_in + cross_out
                               + model.cluster.devices[s % model.cluster.num_ranks]
                               .workspace_bytes),
            param_bytes=sum(costs.param_sizes[p] for p in params),
            num_parameters=sum(costs.param_numel[p] for p in params if p in costs.trainable),
        ))
    return out
