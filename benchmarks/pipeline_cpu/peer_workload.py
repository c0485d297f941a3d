"""One workload of the measured-peers benchmark (issue 17): the model for autopart and the same model as DeepSpeed's layer list."""
from __future__ import annotations
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
import torch
from torch import nn

@dataclass(frozen=True)
class PeerWorkload:
    name: str                  # e.g. "gpt2_balanced", "gpt2_head_heavy", "resnet50", "t5_encdec", "hetero"
    description: str           # one line for the report
    batch: int                 # full batch rows
    num_microbatches: int      # m, the same for every arm
    build: Callable[[], tuple[nn.Module, tuple, Any, Callable]]   # seeded (seed 0): (model, example_inputs full batch, target, loss_fn(model_output, target))
    ds_layers: Callable[[nn.Module], list]   # layers for deepspeed.pipe.PipelineModule computing model(*inputs) exactly with `model`'s weights (nn.Module instances and/or LayerSpec/TiedLayerSpec)
    ds_loss_fn: Callable[[Any, Any], torch.Tensor]   # loss on the last DS layer's output and the labels
    ds_batch: Callable[[tuple, Any], tuple]   # (example_inputs, target) -> (inputs, labels) as DS's data iterator yields them (tensor or tuple of tensors; labels tensor); the harness slices both along dim 0 into microbatches
    ds_type_regex: str         # block class name for partition_method="type:<regex>"
    hand_split: Callable[[nn.Module], dict]  # {fqn: SplitPoint.BEGINNING}: the repeated blocks in 2 equal halves, what users write by hand with torch.distributed.pipelining.pipeline()
