"""On one CUDA GPU (skipped without one; run by ``benchmarks/gpu/run_all.sh``): the profiler
measures the host's issue time of every node beside its device time, and the local runtime's
plans are priced with the one issuing thread's host time."""

from __future__ import annotations

import json

import pytest
import torch

from autopart.core.capture import capture
from autopart.core.cluster import Cluster, device_preset
from autopart.core.costgraph import CostGraph
from autopart.profiler.measure import profile_graph
from autopart.runtime.description import describe
from autopart.solver import SolveOptions, solve
from autopart.solver.predict import predict

pytestmark = pytest.mark.requires_cuda


def _mlp_profile(width: int) -> CostGraph:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(4):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers).cuda()
    x = torch.randn(64, width, device="cuda")
    cap = capture(model, (x,))
    return profile_graph(cap, cap.flatten_inputs((x,), {}), device="cuda:0")


def test_a_cuda_profile_has_host_and_device_times_per_node() -> None:
    costs = _mlp_profile(4096)
    assert costs.has_host_times
    for n in costs.nodes:
        assert n.host_times is not None and min(n.host_times) >= 0
        assert n.host_fwd_us > 0  # type: ignore[operator]
    # a 64 x 4096 x 4096 fp32 matmul runs far longer on the device than its launch takes
    mm = max(costs.nodes, key=lambda n: n.fwd_us)
    assert mm.host_fwd_us < mm.fwd_us  # type: ignore[operator]
    again = CostGraph.from_dict(json.loads(json.dumps(costs.to_dict())))
    assert again == costs


def test_a_one_thread_plan_is_never_below_its_host_time() -> None:
    costs = _mlp_profile(256)  # small: host-bound on any GPU
    cluster = Cluster.uniform(device_preset("h100-sxm"), ["cuda:0", "cuda:0"])
    opts = SolveOptions(batch_size=costs.batch_size, runtime=describe("local"), recompute=False,
                        time_limit_s=10)
    plan = solve(costs, cluster, opts)
    host_step = plan.num_microbatches * costs.total_host_us()
    assert plan.predicted_step_time_us >= host_step * (1 - 1e-9)
    assert predict(plan, costs, cluster, opts).host_bound_us == pytest.approx(host_step)


def test_the_device_wait_holds_the_stream_and_small_ops_time_their_kernels_alone() -> None:
    import autopart.profiler.timer as timer

    dev = torch.device("cuda:0")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    timer._device_wait(dev, 1.0)  # calibrates
    start.record()
    timer._device_wait(dev, 2_000.0)
    end.record()
    end.synchronize()
    assert 1.0 <= start.elapsed_time(end) <= 4.0  # ms: the spin kernel's clock is calibrated
    x = torch.ones(1024, device=dev)
    host: list[float] = []
    samples, _ = timer.time_samples(dev, lambda: lambda: x + 1, 2, 5, host=host)
    # a 1,024-element add runs in a few µs; launching it from Python takes longer
    assert len(host) == len(samples) == 5
    assert sorted(samples)[2] < sorted(host)[2]
