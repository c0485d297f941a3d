"""Builders for hand-made CostGraphs and clusters used by the solver tests (no torch)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from autopart.core.cluster import Cluster, DeviceSpec
from autopart.core.costgraph import CostGraph, NodeCost


class Build:
    """Small constructors for NodeCost, CostGraph and Cluster instances."""

    @staticmethod
    def node(name: str, inputs: Sequence[str] = (), *, fwd: float = 10.0, bwd: float = 20.0,
             out: int = 100, saved: int = 0, params: Sequence[str] = (), param_bytes: int = 0,
             tensor: bool = True, module: str = "") -> NodeCost:
        return NodeCost(name=name, op="aten.test.default", module_path=module, fwd_us=fwd,
                        bwd_input_us=bwd / 2, bwd_weight_us=bwd / 2, flops=0, bytes_accessed=0,
                        output_bytes=out, saved_bytes=saved, param_bytes=param_bytes,
                        inputs=tuple(inputs), params=tuple(params), output_is_tensor=tensor)

    @staticmethod
    def graph(nodes: Sequence[NodeCost], *, inputs: dict[str, int] | None = None,
              outputs: Sequence[str] | None = None,
              params: dict[str, tuple[int, int]] | None = None,
              buffers: Sequence[str] = (), batch_size: int = 8) -> CostGraph:
        """``params``: FQN -> (bytes, numel); all trainable except those named in ``buffers``."""
        params = params or {}
        return CostGraph(
            nodes=tuple(nodes), graph_inputs=dict(inputs if inputs is not None else {"x": 100}),
            graph_outputs=tuple(outputs if outputs is not None else (nodes[-1].name,)),
            param_sizes={k: v[0] for k, v in params.items()},
            param_numel={k: v[1] for k, v in params.items()},
            trainable=frozenset(k for k in params if k not in buffers),
            source="analytical:test", bwd_source="measured", batch_size=batch_size,
            fingerprint="test-graph")

    @staticmethod
    def chain(n: int, *, fwd: float = 10.0, bwd: float = 20.0, out: int = 100, saved: int = 50,
              param_bytes: int = 0, batch_size: int = 8) -> CostGraph:
        """x -> n0 -> ... -> n{n-1}; node i reads parameter ``l{i}.w`` when param_bytes > 0."""
        nodes, params = [], {}
        prev = "x"
        for i in range(n):
            ps = (f"l{i}.w",) if param_bytes else ()
            if param_bytes:
                params[f"l{i}.w"] = (param_bytes, param_bytes // 4)
            nodes.append(Build.node(f"n{i}", (prev,), fwd=fwd, bwd=bwd, out=out, saved=saved,
                                    params=ps, param_bytes=param_bytes, module=f"layers.{i}"))
            prev = f"n{i}"
        return Build.graph(nodes, inputs={"x": out}, params=params, batch_size=batch_size)

    @staticmethod
    def cluster(num_ranks: int, *, memory_bytes: int = 10**12, link_bw: float = 1e9,
                latency_us: float = 0.0, overhead_us: float = 0.0) -> Cluster:
        spec = DeviceSpec("test-dev", memory_bytes, 1e12, 1e12, link_bw, latency_us,
                          "made up for tests", op_overhead_us=overhead_us)
        return Cluster.uniform(spec, [f"cpu:{r}" for r in range(num_ranks)])


@pytest.fixture
def build() -> type[Build]:
    """The :class:`Build` helpers."""
    return Build
