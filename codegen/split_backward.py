"""Zero-bubble backward split: input gradients now (``I``), weight gradients later (``W``).

The algorithm is the one ``torch.distributed.pipelining`` uses for its zero-bubble
schedules (``stage_backward_input`` / ``stage_backward_weight``, after Qi et al., *Zero
Bubble Pipeline Parallelism*, ICLR 2024): walk the stage's autograd graph once, find the
*intermediates* — nodes on a path from the backward roots to a stage input where a path
to a parameter branches off — record the gradients flowing into them during ``I``, and in
``W`` restart autograd from those nodes alone. Written here rather than imported because
torch keeps those functions private; this version also covers parameters that reach a
root without crossing an input path (stage 0, whose inputs need no gradient, and outputs
computed from parameters alone), which it seeds from the roots themselves.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Sequence

import torch
from torch.autograd.graph import GradientEdge, Node

__all__ = ["SplitBackward"]


def _grad_node(t: torch.Tensor) -> Node | None:
    """The autograd node a gradient for ``t`` flows into (its grad_fn or grad accumulator)."""
    if t.grad_fn is not None:
        return t.grad_fn
    if t.requires_grad:  # a leaf: its AccumulateGrad node, reached through a view
        return t.view_as(t).grad_fn.next_functions[0][0]
    return None


class SplitBackward:
    """One microbatch's backward of one stage, run as ``input_grads()`` then ``weight_grads()``.

    ``input_grads`` returns the gradients of the stage inputs (what the previous stage
    needs) and computes nothing that only parameters need; ``weight_grads`` then adds each
    parameter's gradient to ``.grad``. The two together compute exactly what
    ``torch.autograd.backward(roots, root_grads)`` would, each autograd node's gradient being
    summed from the same terms; the test matrix checks this against the unpartitioned model.

    Args:
        roots: tensors the backward starts from (the loss, or the stage outputs).
        root_grads: their gradients (``None`` for a scalar loss).
        inputs: the stage's input leaves; those that require grad get gradients.
        params: the stage's parameters that require grad.
    """

    def __init__(self, roots: Sequence[torch.Tensor], root_grads: Sequence[torch.Tensor | None],
                 inputs: Sequence[torch.Tensor], params: Sequence[torch.Tensor]) -> None:
        self.inputs = list(inputs)
        params = list(params)
        root_nodes = [_grad_node(r) for r in roots]
        parents: dict[Node, list[Node]] = defaultdict(list)  # node -> nodes with an edge to it
        seen = {n for n in root_nodes if n is not None}
        queue = deque(seen)
        while queue:
            node = queue.popleft()
            for child, _ in node.next_functions:
                if child is None:
                    continue
                parents[child].append(node)
                if child not in seen:
                    seen.add(child)
                    queue.append(child)
        # nodes from which some stage input is reachable: I executes exactly these
        on_input_path: set[Node] = set()
        queue = deque(n for n in (_grad_node(x) for x in self.inputs) if n in seen)
        on_input_path.update(queue)
        while queue:
            for parent in parents[queue.popleft()]:
                if parent not in on_input_path:
                    on_input_path.add(parent)
                    queue.append(parent)
        # walk up from each parameter to the input-path nodes where its gradient branches
        # off (the intermediates). Parameters whose walks meet (a shared intermediate or a
        # shared weight-only node) form one group: W runs one autograd call per group, so
        # no call recomputes input-path gradients that lead only to another group.
        group = list(range(len(params)))

        def find(k: int) -> int:
            while group[k] != k:
                group[k] = group[group[k]]
                k = group[k]
            return k

        owner: dict[Node, int] = {}  # weight-only node or intermediate -> a parameter's index
        intermediates: set[Node] = set()
        for k, p in enumerate(params):
            start = _grad_node(p)
            if start is None or start not in seen:
                continue
            if start in owner:
                group[find(k)] = find(owner[start])
                continue
            owner[start] = k
            queue = deque([start])
            while queue:
                for parent in parents[queue.popleft()]:
                    if parent in owner:
                        group[find(k)] = find(owner[parent])
                        continue
                    owner[parent] = k
                    if parent in on_input_path:
                        intermediates.add(parent)
                    else:
                        queue.append(parent)
        self._groups: dict[int, _Group] = {}
        for k, p in enumerate(params):
            self._groups.setdefault(find(k), _Group()).params.append(p)
        for node in intermediates:
            self._groups[find(owner[node])].intermediates.append(node)
        self._input_roots: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        for r, g, node in zip(roots, root_grads, root_nodes, strict=True):
            if node is not None and node in owner and node not in on_input_path:
                # a root off every input path: W seeds it with its own gradient
                self._groups[find(owner[node])].weight_roots.append((r, g))
            elif r.requires_grad:
                self._input_roots.append((r, g))
        self._captured: dict[Node, tuple[torch.Tensor | None, ...]] = {}

    def input_grads(self) -> list[torch.Tensor | None]:
        """Run ``I``: the gradients of ``inputs`` (``None`` where one needs none)."""
        wanted = [x for x in self.inputs if x.requires_grad]
        seeds = self._input_roots

        def capture(node: Node):
            def hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
                self._captured[node] = grad_outputs
            return hook

        handles = [n.register_prehook(capture(n))
                   for grp in self._groups.values() for n in grp.intermediates]
        try:
            got: Sequence[torch.Tensor | None] = [None] * len(wanted)
            if wanted and seeds:
                got = torch.autograd.grad([r for r, _ in seeds], wanted, [g for _, g in seeds],
                                          retain_graph=True, allow_unused=True)
        finally:
            for h in handles:
                h.remove()
        by_id = {id(x): g for x, g in zip(wanted, got, strict=True)}
        return [by_id.get(id(x)) for x in self.inputs]

    def weight_grads(self) -> None:
        """Run ``W``: add every parameter's gradient to its ``.grad``; frees the graph."""
        groups = [g for g in self._groups.values() if g.intermediates or g.weight_roots]
        for n, grp in enumerate(groups):
            edges: list[GradientEdge] = []
            seeds: list[torch.Tensor] = []
            for node in grp.intermediates:
                for k, g in enumerate(self._captured.get(node, ())):
                    if g is not None:
                        edges.append(GradientEdge(node, k))
                        seeds.append(g)
            for root, g in grp.weight_roots:
                node = _grad_node(root)
                assert node is not None
                edges.append(GradientEdge(node, root.output_nr if root.grad_fn is not None else 0))
                seeds.append(torch.ones_like(root) if g is None else g)
            if not edges:
                continue
            # an intermediate below another of the group would also receive that one's
            # contribution: pin each to the total it received in I, which includes it
            handles = [node.register_prehook(lambda _g, saved=self._captured[node]: saved)
                       for node in grp.intermediates if node in self._captured]
            try:
                got = torch.autograd.grad(edges, grp.params, seeds, allow_unused=True,
                                          retain_graph=n < len(groups) - 1)
            finally:
                for h in handles:
                    h.remove()
            with torch.no_grad():
                for p, g in zip(grp.params, got, strict=True):
                    if g is not None:
                        p.grad = g if p.grad is None else p.grad.add_(g)
        self._captured.clear()


class _Group:
    """Parameters whose weight gradients W computes in one autograd call."""

    __slots__ = ("params", "intermediates", "weight_roots")

    def __init__(self) -> None:
        self.params: list[torch.Tensor] = []
        self.intermediates: list[Node] = []
        self.weight_roots: list[tuple[torch.Tensor, torch.Tensor | None]] = []
