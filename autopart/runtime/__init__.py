"""Runtimes over the stages codegen builds: the one-process stream executor
(:class:`PipelinedModule`) and the torch.distributed one (:class:`DistributedPipeline`),
sharing one input signature, one schedule and one checkpoint format."""
