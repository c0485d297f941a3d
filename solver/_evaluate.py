"""Exact costing of a candidate (cuts, m, v, kind, recompute): closed form, simulator, plan."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from autopart.core.cluster import Cluster
from autopart.core.costgraph import CostGraph
from autopart.core.plan import (
    BaselineReport,
    Cut,
    LowerBounds,
    ParetoPoint,
    Plan,
    RankPlan,
    SolverReport,
    StagePlan,
)
from autopart.core.schedule import (
    build_schedule,
    forward_schedule,
    in_flight_counts,
    splits_backward,
)
from autopart.solver._costmodel import CostModel
from autopart.solver._schedule_cost import (
    busy_us,
    closed_form_peaks,
    closed_form_step_us,
    in_flight,
)
from autopart.solver.candidates import CutCandidates
from autopart.solver.chain import ChainAnswer
from autopart.solver.simulate import StageCosts, rank_peaks, simulate

__all__ = ["Candidate", "evaluate", "build_plan", "lower_bounds", "pareto"]


@functools.lru_cache(maxsize=256)
def _training_schedule(kind: str, p: int, m: int, v: int, recompute: tuple[int, ...]) -> Any:
    """``build_schedule``'s action lists, cached (the solver costs many cuts per schedule)."""
    return build_schedule(kind, p, m, v, recompute=recompute)


@dataclass(frozen=True, slots=True)
class Candidate:
    """One fully costed option.

    Attributes:
        kind, v, m: schedule kind, stages per rank, microbatches.
        positions: cut positions (node indices), ascending.
        recompute: per stage.
        costs: per-stage costs as the simulator takes them.
        param_info: per stage (parameter bytes, trainable elements).
        step_us: predicted step time, µs (closed form, or simulator once ``is_simulated``).
        bubble: idle share of a rank's step.
        peaks: per rank peak memory, bytes.
        stage_peaks: per stage peak memory (static + in-flight saved + backward extra + what
            it keeps until the step ends), bytes.
        caps: per rank cap (None: no cap).
        sub: the subproblem it came from (opaque to this module).
        name: a baseline's name, ``""`` for the solver's own candidates.
        training: fwd + bwd, or forward only.
        is_simulated: ``step_us``, ``bubble``, ``peaks`` come from the simulator.
        sync_us: the end-of-step all-reduce of tied parameters' gradients, µs (part of
            ``step_us``; :meth:`CostModel.tied_sync_us`).
    """

    kind: str
    v: int
    m: int
    positions: tuple[int, ...]
    recompute: tuple[bool, ...]
    costs: StageCosts
    param_info: tuple[tuple[int, int], ...]
    step_us: float
    bubble: float
    peaks: tuple[int, ...]
    stage_peaks: tuple[int, ...]
    caps: tuple[int, ...] | None
    sub: Any = None
    name: str = ""
    training: bool = True
    is_simulated: bool = False
    sync_us: float = 0.0

    @property
    def max_peak(self) -> int:
        """Largest rank peak, bytes."""
        return max(self.peaks)

    @property
    def fits(self) -> bool:
        """Every rank within its cap."""
        return self.caps is None or all(a <= b for a, b in zip(self.peaks, self.caps, strict=True))

    def simulated(self) -> Candidate:
        """This candidate with step time, bubble and per-rank peaks from the simulator."""
        if self.is_simulated:
            return self
        p = len(self.peaks)
        recompute = [s for s, rc in enumerate(self.recompute) if rc]
        sched = (build_schedule(self.kind, p, self.m, self.v, recompute=recompute)
                 if self.training else forward_schedule(p, self.m, self.v))
        res = simulate(sched, self.costs)
        return replace(self, step_us=res.step_time_us + self.sync_us, bubble=res.bubble_fraction,
                       peaks=res.peak_memory_bytes, is_simulated=True)


def evaluate(model: CostModel, cands: CutCandidates | None, kind: str, p: int, v: int, m: int,
             answer: ChainAnswer | Sequence[int], caps: Sequence[int] | None, *,
             sub: Any = None, name: str = "",
             recompute: bool | Sequence[bool] = False) -> Candidate:
    """Cost an answer exactly (closed-form step time; per-rank peaks following the schedule).

    Args:
        model: the cost model.
        cands: the candidates the answer's cut indices refer to; ``None`` when ``answer`` is a
            tuple of node positions (a baseline).
        kind, p, v, m: schedule kind, ranks, stages per rank, microbatches.
        answer: a chain answer (cut indices + recompute) or node positions.
        caps: per-rank memory caps, bytes (None: no cap).
        recompute: for node positions only: every stage recomputes (True), none does (the
            default), or one flag per stage.
    """
    if isinstance(answer, ChainAnswer):
        assert cands is not None
        positions = tuple(cands.positions[i] for i in answer.cuts)
        rc = tuple(answer.recompute)
    else:
        positions = tuple(answer)
        rc = ((recompute,) * (len(positions) + 1) if isinstance(recompute, bool)
              else tuple(recompute))
    training, ratio, cluster = model.training, model.ratio(m), model.cluster
    n = len(model.costs.nodes)
    bounds = [0, *positions, n]
    s_total = len(bounds) - 1
    cols: dict[str, list[Any]] = {key: [] for key in (
        "fwd", "bi", "bw", "sf", "sb", "static", "saved", "extra", "held", "wgrad", "kept")}
    info = []
    # torch's stages, on a profile that says which saved storages nodes returned
    # (CostModel.held_parts): what they hold is counted part by part
    torch_held = model.receive_buffers_per_microbatch and model.held_bytes_cover_outputs
    for s in range(s_total):
        a, z, r = bounds[s], bounds[s + 1], s % p
        f = model.speed(r)
        fwd = model.part_us("fwd", a, z, ratio) * f
        # ZB-H1 splits each backward, at the runtime's measured cost, except where the
        # schedule runs the stage's backward whole (autopart.core.schedule.splits_backward)
        split = model.split_factor if splits_backward(kind, rc[s]) and s > 0 else 1.0
        bi = model.part_us("bwd_input", a, z, ratio) * f * split + (fwd if rc[s] else 0.0)
        bw = model.part_us("bwd_weight", a, z, ratio) * f * split
        if splits_backward(kind, rc[s]):
            if s == 0:
                # the first stage's inputs need no gradient: its I computes nothing and its W
                # is one whole backward, unsplit (torch's stages run it as "full"; the local
                # executor's SplitBackward seeds it from the roots). Measured with ZB-H1 on
                # the fidelity GPT-2 (m = 16): its W 25.8 ms against its B under 1F1B, 25.8
                # ms; the CNN (m = 8): 26.3 ms against 26.8 ms
                bi, bw = 0.0, bi + bw
            else:
                # the split's own cost goes to W (measured: I as fast as its share of B, W
                # slower)
                bw += model.split_overhead_us(a, z, ratio) * f
        if splits_backward(kind, False) and not splits_backward(kind, rc[s]):
            bi, bw = bi + bw, 0.0  # one B where its I would be; no W
        # the runtime's own cost of each transfer between ranks an action posts or waits on
        # (SolveOptions.transfer_overhead_us): F receives the stage's input and sends its
        # output, B (or I) receives the output's gradient and sends the input's; a split's W
        # neither (charged one too, a negligible-compute ZB-H1 pipeline at m = 16 was
        # predicted at 29.7 ms a step against 20.3 ms measured)
        if p > 1:
            transfers = (s > 0) + (s < s_total - 1)
            fwd += model.transfer_overhead_us * transfers
            bi += model.transfer_overhead_us * transfers if training else 0.0
        cross_in = model.scale_bytes(model.crossing[a], ratio)
        cross_out = model.scale_bytes(model.crossing[z], ratio)
        state, pbytes, numel = model.state_of(a, z)
        transient = model.transient_bytes(a, z, ratio)
        cols["fwd"].append(fwd)
        cols["bi"].append(bi if training else 0.0)
        cols["bw"].append(bw if training else 0.0)
        cols["sf"].append(cluster.transfer_us(cross_out, r, (s + 1) % p) if s < s_total - 1
                          else 0.0)
        cols["sb"].append(cluster.transfer_us(cross_in, r, (s - 1) % p)
                          if s > 0 and training else 0.0)
        # torch's stages receive into one buffer per microbatch: the input (not on the first
        # stage, which reads the user's microbatches) and the output gradient (not on the
        # last, which starts from the loss)
        many = m if training and model.receive_buffers_per_microbatch else 1
        # the stage's compute stream holds cuBLAS workspaces on a GPU (0 on the CPU)
        # training, the last stage holds each microbatch's outputs from its F to its B
        # (counted below) and in no output buffer: neither runtime returns them (measured
        # on the fidelity GPT-2's last rank, 1F1B m = 8: its 8 MiB of logits were counted
        # twice)
        out_buffers = many if s < s_total - 1 else 0 if training else 1
        cols["static"].append(state + cluster.devices[r].workspace_bytes
                              + (many if s > 0 else 1) * cross_in + out_buffers * cross_out
                              + (0 if training else transient))
        # the last stage's outputs (the logits the loss reads) stay held, in both runtimes,
        # from its forward until that microbatch's backward
        # (held_parts counts them where the profile says which storages nodes returned)
        held_out = cross_out if training and s == s_total - 1 else 0
        inside, outs, strided = (model.scale_bytes(x, ratio) for x in model.held_parts(a, z)) \
            if training else (0, 0, 0)
        if not rc[s]:
            saved = (inside + outs + strided if model.held_bytes_cover_outputs
                     else inside + held_out)
            recomputed = 0
        elif torch_held:
            # a recomputed stage of torch's keeps its outputs (the stage's cache), the copies
            # of strided values and the loss's saved set (the loss runs outside the
            # recomputed forward) from F to B; its inputs are receive buffers (static). The
            # backward recomputes the rest. Measured on the fidelity GPT-2's last rank (1F1B
            # m = 8): its logits and the loss's 8 MiB were charged twice in B, 14.7 % over
            loss = model.scale_bytes(model.costs.loss_saved_bytes, ratio) if s == s_total - 1 \
                else 0
            saved, recomputed = outs + strided + loss, inside - loss
        else:
            saved, recomputed = cross_in + held_out, inside + outs
        cols["saved"].append(saved)
        split_here = training and splits_backward(kind, rc[s])
        # the first stage's I computes nothing (its inputs need no gradient): no working set
        # (its W, the whole backward, has it). Charged, it put the fidelity CNN's first rank
        # 8 MiB over at every I (ZB-H1, m = 8)
        empty_i = split_here and s == 0
        cols["extra"].append(transient + recomputed if training and not empty_i else 0)
        # from I to W a split backward keeps the gradients W restarts from: where parameter
        # paths join the activations' (SplitBackward's intermediates); on the first stage,
        # whose inputs need no gradient, I computes nothing and W restarts from the stage's
        # outputs and their gradients, which torch's stages hold anyway (the outputs in
        # held_bytes, their gradients in receive buffers: measured, nothing more from I to W)
        cols["held"].append(0 if not split_here else (0 if torch_held else 2 * cross_out)
                            if s == 0 else model.split_held_bytes(a, z, ratio))
        # a W adds each parameter group's gradients to .grad before the next group's
        # (autopart's SplitBackward and torch's stage_backward_weight alike): one node's
        # working set. autopart's W on the first stage is the whole backward in one call,
        # whose gradients are returned together (CostModel.whole_backward_bytes)
        wgrad = (model.whole_backward_bytes(a, z, ratio)
                 if s == 0 and not model.receive_buffers_per_microbatch else transient)
        cols["wgrad"].append(wgrad if split_here else 0)
        # torch's stages keep what they send until the step ends: each sent output (the
        # schedule waits on every send at the step's end; until B its forward's saved set or
        # the stage's cache held it) and each input gradient (in the receive buffer's .grad
        # until the next step clears it). Measured on the fidelity CNN (1F1B, m = 8): each B
        # left 1 MiB more held on both ranks, 8 MiB by the last rank's last backward.
        keeps = training and model.receive_buffers_per_microbatch
        cols["kept"].append((cross_out if s < s_total - 1 else 0) + (cross_in if s > 0 else 0)
                            if keeps else 0)
        info.append((pbytes, numel))
    c = StageCosts(cols["fwd"], cols["bi"], cols["bw"], cols["sf"], cols["sb"], cols["static"],
                   cols["saved"], cols["extra"], cols["held"], cols["wgrad"], cols["kept"])
    k = in_flight(kind, p, m, v, training)
    sync = model.tied_sync_us(positions, p)
    step = closed_form_step_us(kind, p, m, v, c, training=training) + sync
    busy = busy_us(c, p, m, training)
    bubble = 1.0 - sum(busy) / len(busy) / step if step > 0 else 0.0
    if any(c.split_held_bytes) or any(c.weight_grad_bytes) or any(c.kept_bytes):
        # what ZB-H1 holds between I and W, and what torch's stages keep until the step ends,
        # follow the action order: count them there
        sched = _training_schedule(kind, p, m, v, tuple(s for s in range(s_total) if rc[s]))
        peaks = list(rank_peaks(sched, c))
        pending = in_flight_counts(sched, s_total)
    else:
        peaks = closed_form_peaks(c, k, p)
        pending = [0] * s_total
    stage_peaks = tuple(c.static_bytes[s] + k[s] * c.saved_bytes[s]
                        + max(c.backward_extra_bytes[s], c.weight_grad_bytes[s])
                        + pending[s] * c.split_held_bytes[s]
                        + m * c.kept_bytes[s]
                        for s in range(s_total))
    return Candidate(kind=kind, v=v, m=m, positions=positions, recompute=rc, costs=c,
                     param_info=tuple(info), step_us=step, bubble=min(max(bubble, 0.0), 1.0),
                     peaks=tuple(peaks), stage_peaks=stage_peaks,
                     caps=None if caps is None else tuple(caps), sub=sub, name=name,
                     training=training, sync_us=sync)


def pareto(cands: Sequence[Candidate]) -> tuple[ParetoPoint, ...]:
    """Non-dominated (step time, largest peak) points, ascending time, fitting or not."""
    pts = sorted({(round(c.step_us, 3), c.max_peak) for c in cands})
    out: list[ParetoPoint] = []
    for t, mem in pts:
        if not out or mem < out[-1].peak_memory_bytes:
            out.append(ParetoPoint(predicted_step_time_us=t, peak_memory_bytes=mem))
    return tuple(out)


def lower_bounds(model: CostModel, plan: Plan, p: int) -> LowerBounds:
    """Physical bounds: all compute of a step spread over the ranks (their speeds counted), and
    all parameter state spread over the ranks."""
    n = len(model.costs.nodes)
    m = plan.num_microbatches
    work = m * model.time_us(0, n, model.ratio(m))
    step_lb = work / sum(1.0 / model.speed(r) for r in range(p))
    mem_lb = -(-sum(model.state_bytes.values()) // p)
    peak = max(r.peak_memory_bytes for r in plan.ranks)
    return LowerBounds(step_time_us=round(step_lb, 3), peak_memory_bytes=mem_lb,
                       step_time_ratio=round(plan.predicted_step_time_us / step_lb, 6)
                       if step_lb > 0 else 1.0,
                       peak_memory_ratio=round(peak / mem_lb, 6) if mem_lb > 0 else 1.0)


def build_plan(costs: CostGraph, cluster: Cluster, model: CostModel, cands: CutCandidates,
               best: Candidate, optimize: str, batch_size: int, versions: dict[str, str],
               report: SolverReport, baselines: tuple[BaselineReport, ...],
               frontier: tuple[ParetoPoint, ...]) -> Plan:
    """The :class:`Plan` of the chosen candidate."""
    nodes = costs.nodes
    ratio = model.ratio(best.m)
    p = cluster.num_ranks
    cuts = tuple(Cut(position=q, after_node=nodes[q - 1].name, before_node=nodes[q].name,
                     crossing_bytes=model.scale_bytes(model.crossing[q], ratio))
                 for q in best.positions)
    bounds = [0, *best.positions, len(nodes)]
    c = best.costs
    stages = []
    for s in range(len(bounds) - 1):
        a, z, r = bounds[s], bounds[s + 1], s % p
        paths = [nd.module_path for nd in nodes[a:z] if nd.module_path]
        stages.append(StagePlan(
            stage_index=s, rank=r, device=cluster.device_names[r],
            first_node=nodes[a].name, last_node=nodes[z - 1].name, num_nodes=z - a,
            module_range=(paths[0], paths[-1]) if paths else ("", ""),
            num_parameters=best.param_info[s][1], param_bytes=best.param_info[s][0],
            predicted_fwd_us=round(c.fwd_us[s], 3),
            predicted_bwd_us=round(c.bwd_input_us[s] + c.bwd_weight_us[s], 3),
            predicted_comm_us=round(c.send_fwd_us[s] + c.send_bwd_us[s], 3),
            predicted_peak_memory_bytes=best.stage_peaks[s], recompute=best.recompute[s]))
    ranks = tuple(RankPlan(rank=r, device=cluster.device_names[r],
                           stage_indices=tuple(range(r, len(stages), p)),
                           peak_memory_bytes=best.peaks[r]) for r in range(p))
    return Plan(
        graph_fingerprint=costs.fingerprint, cluster_fingerprint=cluster.fingerprint(),
        cost_source=costs.source, library_versions=versions, optimize=optimize,
        batch_size=batch_size, num_microbatches=best.m, schedule_kind=best.kind, cuts=cuts,
        stages=tuple(stages), ranks=ranks, predicted_step_time_us=round(best.step_us, 3),
        bubble_fraction=round(best.bubble, 6), solver=report, baselines=baselines,
        stages_per_rank=best.v, pareto=frontier)
