"""Training checkpoints: model and optimizer state by FQN on torch.distributed.checkpoint, any
plan loading any other's (:mod:`autopart.runtime.checkpoint.save_load`); what one process reads
and writes (:mod:`autopart.runtime.checkpoint.state`); the files, read without unpickling."""

from autopart.runtime.checkpoint.save_load import (
    checkpoint_extra,
    checkpoint_plan,
    checkpoint_tensors,
    load_checkpoint,
    save_checkpoint,
)

__all__ = ["save_checkpoint", "load_checkpoint", "checkpoint_extra", "checkpoint_plan",
           "checkpoint_tensors"]
