"""Expert parallelism in a stage: the experts of each MoE layer split over an ep group, tokens
dispatched to them and combined back with all-to-all.

:func:`find_expert_blocks` reads the experts of a captured stage graph the way transformers 5
writes them: one module (``<layer>.mlp.experts``) holding the experts as two stacked 3-D
parameters, ``gate_up_proj`` ``[E, 2I, H]`` and ``down_proj`` ``[E, H, I]``, called with the
tokens ``[T, H]``, the router's top-k expert ids ``[T, k]`` and weights ``[T, k]``, and
computing ``out[t] = sum_j w[t, j] * down_e(act(gate_up_e(x_t)))`` with ``e = idx[t, j]``
through two grouped GEMMs (``aten._grouped_mm``, or transformers' ``grouped_mm_fallback`` on
CPU). Mixtral, Qwen3-MoE, DeepSeek-V3 and the other zoo models built on that experts module
export this way; the router and a shared expert stay outside the block and stay dense.
GPT-OSS's experts differ in two ways the pass reads too: their weights are stored
transposed (``[E, H, 2I]`` and ``[E, I, H]``, handed to the GEMM as they are) and each GEMM
adds a per-expert bias (``[E, 2I]``, ``[E, H]``) gathered by the rows' expert ids.

:func:`expert_parallel` rewrites each block into a call of :class:`ExpertParallelExperts` on
this ep rank's ``E / ep`` experts (experts ``[r E/ep, (r+1) E/ep)``, Megatron-Core's
contiguous placement) and returns the parameters' layouts (dimension 0 split over ep). The
call runs, for one microbatch:

1. the token-expert pairs sorted by expert, so the rows for each ep rank are contiguous;
2. the per-expert counts exchanged (one all-to-all of ``E`` integers), then the rows
   dispatched with an all-to-all (``torch.distributed._functional_collectives.
   all_to_all_single_autograd``: its backward is the reverse all-to-all);
3. the received rows grouped by local expert and run through the two grouped GEMMs (the
   kernel the captured graph used) and the activation, copied from the captured block;
4. the results combined back with the reverse all-to-all, weighted by the router and
   summed over the top-k, as the captured block does (same op order: the output equals
   the unsharded block's).

What the pass refuses, with a :class:`PlanError` naming the op and the fix (ep = 1): an
experts module with other parameters than the two weights and their biases (a bias added
any other way than per row of its expert), one whose routing weights are applied
to the inputs instead of the outputs (Llama 4), an activation that reads anything but the
first GEMM's output, and an expert count ep does not divide.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd

from autopart.codegen import _tp_ops
from autopart.codegen.tensor_parallel import hold_shard
from autopart.codegen.tp_layout import ShardLayout, TensorParallelRank
from autopart.core.capturedgraph import GROUPED_MM_OPS, node_module_path, weight_source
from autopart.core.errors import PlanError

__all__ = ["ExpertBlock", "ExpertParallelExperts", "expert_parallel", "find_expert_blocks"]

_FIX = "plan with ep=1 (CompileOptions(ep=1), autopart plan --ep 1) for this model"


@dataclass(frozen=True)
class ExpertBlock:
    """One experts module of a stage graph.

    Attributes:
        path: the module's FQN (``model.layers.0.mlp.experts``).
        nodes: its op nodes, in graph order.
        hidden, index, weights: the block's inputs: tokens ``[T, H]``, top-k expert ids
            ``[T, k]`` (integer) and routing weights ``[T, k]``.
        output: the node whose value leaves the block (``[T, H]``).
        gate_up, down: the ``get_attr`` nodes of the stacked expert weights.
        first_mm, second_mm: the two grouped GEMMs.
        act: the nodes between them (the activation: ``silu(gate) * up`` for Mixtral).
        gate_up_bias, down_bias: the ``get_attr`` nodes of the per-expert biases added to
            the GEMMs' outputs (``[E, 2I]``, ``[E, H]``; GPT-OSS), or None.
        transposed: per GEMM, whether it reads its weight transposed (``w.transpose(-2,
            -1)``, Mixtral's ``[E, 2I, H]``) rather than as stored (GPT-OSS's ``[E, H, 2I]``).
        num_experts: E, the layer's experts (the stacked weights' first dimension, as
            captured: the rewrite then shards the weights, not this).
    """

    path: str
    nodes: tuple[fx.Node, ...]
    hidden: fx.Node
    index: fx.Node
    weights: fx.Node
    output: fx.Node
    gate_up: fx.Node
    down: fx.Node
    first_mm: fx.Node
    second_mm: fx.Node
    act: tuple[fx.Node, ...]
    num_experts: int
    gate_up_bias: fx.Node | None = None
    down_bias: fx.Node | None = None
    transposed: tuple[bool, bool] = (True, True)


def _error(node: fx.Node, path: str, why: str) -> PlanError:
    return PlanError(f"expert parallelism cannot split the experts of {path or 'the model'} at "
                     f"op {node.name} ({node.target}): {why}; {_FIX}")


def _inside(node: fx.Node, path: str) -> bool:
    p = node_module_path(node)
    return p == path or p.startswith(path + ".")


def _is_mm(node: fx.Node) -> bool:
    return node.op == "call_function" and str(node.target) in GROUPED_MM_OPS


def find_expert_blocks(graph: fx.Graph) -> list[ExpertBlock]:
    """The experts modules of ``graph`` (a captured model or one stage of it), in graph order.

    Returns:
        One :class:`ExpertBlock` per module whose ops include grouped GEMMs of stacked 3-D
        parameters; ``[]`` when there is none (a dense model or stage).

    Raises:
        PlanError: such a module the pass cannot read (see the module docstring); names the
            op and the fix.
    """
    by_path: dict[str, list[fx.Node]] = {}
    for node in graph.nodes:
        if _is_mm(node):
            by_path.setdefault(node_module_path(node), []).append(node)
    blocks = []
    for path, mms in by_path.items():
        blocks.append(_read_block(graph, path, mms))
    return blocks


def _read_block(graph: fx.Graph, path: str, mms: list[fx.Node]) -> ExpertBlock:
    if len(mms) != 2:
        raise _error(mms[0], path, f"it runs {len(mms)} grouped GEMMs where two (gate/up, "
                     "down) are expected")
    first, second = mms
    weights = [weight_source(mm.args[1]) if len(mm.args) > 1 and isinstance(mm.args[1], fx.Node)
               else None for mm in mms]
    for mm, w in zip(mms, weights, strict=True):
        if w is None or w.meta["val"].dim() != 3:
            raise _error(mm, path, "its weight is not a stacked 3-D parameter")
        if len(mm.args) > 3 or mm.kwargs:  # (x, w, offs) only: a bias or other options
            raise _error(mm, path, "it passes more than (input, weight, offsets) to the "
                         "grouped GEMM (a bias?), which the split does not carry")
    gate_up, down = weights
    assert gate_up is not None and down is not None
    transposed = tuple(_transposed(mm, w, path) for mm, w in zip(mms, weights, strict=True))
    nodes = tuple(n for n in graph.nodes if n.op == "call_function" and _inside(n, path))
    inside = set(nodes)
    (first_out, gate_up_bias), (second_out, down_bias) = (_bias(mm, inside) for mm in mms)
    params = {gate_up, down} | {b for b in (gate_up_bias, down_bias) if b is not None}
    extra = [n for n in graph.nodes if n.op == "get_attr" and n not in params
             and any(u in inside for u in n.users)]
    if extra:
        raise _error(extra[0], path, f"it reads parameter {extra[0].target} besides the two "
                     "stacked expert weights and their per-expert biases")
    outside_in: list[fx.Node] = []
    for n in nodes:
        for a in n.all_input_nodes:
            if a not in inside and a not in params and a not in outside_in:
                outside_in.append(a)
    outs = [n for n in nodes if any(u not in inside for u in n.users)]
    if len(outs) != 1:
        raise _error(nodes[-1], path, f"{len(outs)} of its values are read outside it, where "
                     "one (its output) is expected")
    output = outs[0]
    ints = [a for a in outside_in if _dtype(a) is not None and not _dtype(a).is_floating_point]
    floats = [a for a in outside_in if _dtype(a) is not None and _dtype(a).is_floating_point]
    two_d = [a for a in floats if a.meta["val"].dim() == 2]
    if len(ints) != 1 or len(two_d) != 2 or len(outside_in) != 3:
        raise _error(nodes[0], path, "its inputs are not (tokens [T, H], expert ids [T, k], "
                     f"weights [T, k]): {[a.name for a in outside_in]}")
    index = ints[0]
    k_shape = tuple(index.meta["val"].shape)
    hidden = next((a for a in two_d if tuple(a.meta["val"].shape) != k_shape), None)
    routing = next((a for a in two_d if tuple(a.meta["val"].shape) == k_shape), None)
    if hidden is None or routing is None:
        raise _error(nodes[0], path, "its routing weights are not shaped like its expert ids")
    act = _activation(first_out, second, inside, path)
    _check_weights_after(second_out, routing, inside, path)
    return ExpertBlock(path, nodes, hidden, index, routing, output, gate_up, down, first,
                       second, act, int(gate_up.meta["val"].shape[0]), gate_up_bias,
                       down_bias, transposed)  # type: ignore[arg-type]


def _transposed(mm: fx.Node, weight: fx.Node, path: str) -> bool:
    """Whether ``mm`` reads ``weight`` as ``weight.transpose(-2, -1)`` (True) or as stored."""
    operand = mm.args[1]
    if operand is weight:
        return False
    assert isinstance(operand, fx.Node)
    if operand.target is torch.ops.aten.transpose.int and operand.args[0] is weight and \
            {d % 3 for d in operand.args[1:3]} == {1, 2}:  # type: ignore[operator]
        return True
    raise _error(mm, path, f"its weight reaches the grouped GEMM through {operand.target}, "
                 "not as stored or transposed")


def _bias(mm: fx.Node, inside: set[fx.Node]) -> tuple[fx.Node, fx.Node | None]:
    """``(the GEMM's output with its bias, the bias parameter)`` where the GEMM's one reader
    adds ``bias[expert id of each row]`` (GPT-OSS), else ``(mm, None)``."""
    users = list(mm.users)
    if len(users) != 1 or users[0].target is not torch.ops.aten.add.Tensor:
        return mm, None
    add = users[0]
    other = add.args[1] if add.args[0] is mm else add.args[0]
    if not isinstance(other, fx.Node) or other.target is not torch.ops.aten.index.Tensor or \
            other not in inside:
        return mm, None
    param = other.args[0]
    if not isinstance(param, fx.Node) or param.op != "get_attr" or \
            param.meta["val"].dim() != 2 or len(other.args[1]) != 1:  # type: ignore[arg-type]
        return mm, None
    return add, param


def _dtype(node: fx.Node) -> torch.dtype | None:
    val = node.meta.get("val")
    return val.dtype if isinstance(val, torch.Tensor) else None


def _activation(first: fx.Node, second: fx.Node, inside: set[fx.Node], path: str,
                ) -> tuple[fx.Node, ...]:
    """The ops from the first GEMM's output to the second's input, each reading only the
    first GEMM's output or another such op."""
    target = second.args[0]
    assert isinstance(target, fx.Node)
    on_path: list[fx.Node] = []
    todo, seen = [target], set()
    while todo:
        n = todo.pop()
        if n in seen or n is first:
            continue
        seen.add(n)
        if n not in inside:
            raise _error(second, path, "its second GEMM reads a value made outside the block")
        on_path.append(n)
        todo.extend(n.all_input_nodes)
    for n in on_path:
        for a in n.all_input_nodes:
            if a is not first and a not in seen:
                raise _error(n, path, f"the activation reads {a.name}, not only the first "
                             "GEMM's output")
    order = {n: i for i, n in enumerate(first.graph.nodes)}
    return tuple(sorted(on_path, key=order.__getitem__))


def _check_weights_after(second: fx.Node, routing: fx.Node, inside: set[fx.Node],
                         path: str) -> None:
    """The routing weights must scale the second GEMM's output (a ``mul`` of it by values
    derived from the weights), as transformers' experts do; Llama 4 scales the inputs."""
    for user in second.users:
        if user.op == "call_function" and user.target is torch.ops.aten.mul.Tensor:
            other = user.args[1] if user.args[0] is second else user.args[0]
            if isinstance(other, fx.Node) and _derives_from(other, routing, inside):
                return
    raise _error(second, path, "the routing weights do not scale the experts' outputs")


def _derives_from(node: fx.Node, source: fx.Node, inside: set[fx.Node]) -> bool:
    todo, seen = [node], set()
    while todo:
        n = todo.pop()
        if n is source:
            return True
        if n in seen or n not in inside:
            continue
        seen.add(n)
        todo.extend(n.all_input_nodes)
    return False


def _act_module(block: ExpertBlock) -> fx.GraphModule:
    """The block's activation as a module of one input (the first GEMM's ``[N, 2I]`` output,
    its bias added) and one output (the second GEMM's ``[N, I]`` input), for any N."""
    g = fx.Graph()
    source = block.first_mm if block.gate_up_bias is None else next(iter(block.first_mm.users))
    env: dict[fx.Node, fx.Node] = {source: g.placeholder("gate_up")}
    for n in block.act:
        env[n] = g.node_copy(n, lambda a: env[a])
    g.output(env[block.second_mm.args[0]])  # type: ignore[index]
    return fx.GraphModule(nn.Module(), g, class_name="ExpertActivation")


class ExpertParallelExperts(nn.Module):
    """One MoE layer's experts on this ep rank, with the dispatch and combine all-to-alls.

    Called as ``(hidden [T, H], index [T, k], weights [T, k], gate_up [E/ep, 2I, H],
    down [E/ep, H, I][, gate_up_bias [E/ep, 2I], down_bias [E/ep, H]]) -> [T, H]`` (the
    captured block's contract, with this rank's experts; the weights ``[E/ep, H, 2I]`` and
    ``[E/ep, I, H]`` where ``transposed`` says the block read them as stored).
    Collective over the ep group: every ep rank calls it for the same microbatches in the
    same order (dp replicas run the same schedule), whatever tokens each routes where.

    Args:
        act: the activation from the captured block (:func:`_act_module`).
        grouped_mm: the grouped GEMM the block used, ``(x [N, K], w [G, K, M], offs [G]
            int32 cumulative rows) -> [N, M]``.
        num_experts: E, the layer's experts over all ep ranks.
        ep: this rank's place in its ep group.
        transposed: per GEMM, whether the block read its weight transposed (default both,
            transformers' usual ``[E, out, in]`` storage).
    """

    def __init__(self, act: fx.GraphModule, grouped_mm: Callable[..., torch.Tensor],
                 num_experts: int, ep: TensorParallelRank,
                 transposed: tuple[bool, bool] = (True, True)) -> None:
        super().__init__()
        self.act = act
        self.grouped_mm = grouped_mm
        self.num_experts = num_experts
        self.ep_size, self.group_name = ep.size, ep.group_name
        self.transposed = transposed

    def forward(self, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
                gate_up: torch.Tensor, down: torch.Tensor,
                gate_up_bias: torch.Tensor | None = None,
                down_bias: torch.Tensor | None = None) -> torch.Tensor:
        tokens, top_k = index.shape
        local = gate_up.shape[0]
        group = _tp_ops._group(self.group_name)  # addressed by name, as tp's collectives are
        flat = index.reshape(-1)
        order = torch.sort(flat, stable=True).indices
        rows = hidden[order // top_k]  # token-expert pairs, by expert: each ep rank's contiguous
        per_expert = torch.bincount(flat, minlength=self.num_experts)
        received = torch.empty_like(per_expert)
        dist.all_to_all_single(received, per_expert, group=group)  # [src, local expert]
        send = per_expert.view(self.ep_size, local).sum(1).tolist()
        recv = received.view(self.ep_size, local).sum(1).tolist()
        mine = all_to_all_single_autograd(rows, recv, send, group)
        expert_of = torch.repeat_interleave(
            torch.arange(local, device=index.device).repeat(self.ep_size), received)
        by_expert = torch.sort(expert_of, stable=True).indices
        offs = torch.cumsum(torch.bincount(expert_of, minlength=local), 0, dtype=torch.int32)
        w1 = gate_up.transpose(-2, -1) if self.transposed[0] else gate_up
        w2 = down.transpose(-2, -1) if self.transposed[1] else down
        h = self.grouped_mm(mine[by_expert], w1, offs)
        if gate_up_bias is not None or down_bias is not None:
            row_expert = expert_of[by_expert]  # each grouped row's local expert
        if gate_up_bias is not None:
            h = h + gate_up_bias[row_expert]
        y = self.grouped_mm(self.act(h), w2, offs)
        if down_bias is not None:
            y = y + down_bias[row_expert]
        y = y[_inverse(by_expert)]  # back in received order
        back = all_to_all_single_autograd(y, send, recv, group)
        pairs = back[_inverse(order)]  # (token, slot) order
        out = (pairs * weights.reshape(-1, 1)).view(tokens, top_k, -1).sum(1)
        return out.to(hidden.dtype)


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


def _mm_callable(node: fx.Node) -> Callable[..., torch.Tensor]:
    target = node.target
    assert callable(target)
    return target  # type: ignore[return-value]


def expert_parallel(gm: fx.GraphModule, ep: TensorParallelRank, *,
                    made: dict[int, nn.Parameter] | None = None) -> dict[str, ShardLayout]:
    """Rewrite ``gm`` in place into ep rank ``ep.rank``'s share of its experts.

    Args:
        gm: one stage as :func:`autopart.codegen.params.build_stage_modules` builds it.
        ep: this process's place in its ep group (rank, degree, group name).
        made: id of a whole expert tensor -> its shard already made for another stage of
            this process (reused, as :func:`autopart.codegen.tensor_parallel.shard_stage`
            does).

    Returns:
        FQN -> layout (dimension 0, over ep) of every expert weight split here; ``{}`` for a
        stage without experts.

    Raises:
        PlanError: an experts module the pass cannot read (:func:`find_expert_blocks`), or
            an expert count ``ep.size`` does not divide.
    """
    made = {} if made is None else made
    layouts: dict[str, ShardLayout] = {}
    for block in find_expert_blocks(gm.graph):
        if block.num_experts % ep.size:
            raise _error(block.first_mm, block.path, f"ep={ep.size} does not divide its "
                         f"{block.num_experts} experts")
        # under the experts module's own path, so a layer grouped into its own submodule
        # (ZeRO's per-layer FSDP units, codegen/fsdp_units.py) takes it along
        name = f"{block.path}.expert_parallel"
        gm.add_submodule(name, ExpertParallelExperts(_act_module(block), _mm_callable(
            block.first_mm), block.num_experts, ep, block.transposed))
        biases = [b for b in (block.gate_up_bias, block.down_bias) if b is not None]
        with gm.graph.inserting_before(block.output.next):
            call = gm.graph.call_module(name, (block.hidden, block.index, block.weights,
                                               block.gate_up, block.down),
                                        {"gate_up_bias": block.gate_up_bias,
                                         "down_bias": block.down_bias} if biases else {})
        call.meta.update({k: block.output.meta[k] for k in ("val", "nn_module_stack",
                                                             "stack_trace")
                          if k in block.output.meta})
        block.output.replace_all_uses_with(call)
        for n in reversed(block.nodes):
            if not n.users:
                gm.graph.erase_node(n)
        layout = ShardLayout(0, (block.num_experts,))
        for attr in (block.gate_up, block.down, *biases):
            layouts[str(attr.target)] = layout
            hold_shard(gm, attr, layout, ep, made)
    if layouts:
        gm.graph.lint()
        gm.recompile()
    return layouts

