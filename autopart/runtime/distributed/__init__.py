"""The torch.distributed runtime: one rank per process under torchrun builds only its stages
(:class:`DistributedPipeline`), on the (pp, dp, tp) mesh built from the plan; its launch,
liveness (heartbeat), gradients, ZeRO sharding, tensor parallelism and loss scaling."""

from autopart.runtime.distributed.pipeline import DistributedPipeline

__all__ = ["DistributedPipeline"]
