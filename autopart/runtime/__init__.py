"""Runtimes over the stages codegen builds, sharing one input signature, one schedule and one
checkpoint format:

- :mod:`autopart.runtime.local`: every stage in one process (:class:`PipelinedModule`);
- :mod:`autopart.runtime.distributed`: a rank per process under torchrun
  (:class:`DistributedPipeline`);
- :mod:`autopart.runtime.checkpoint`: save and load on any plan;
- beside them, what both share: the ``Pipeline`` base (``pipeline``), the runtimes as the
  profiler sees them (``description``, ``split_engines``), CPU hosts (``host``) and step
  traces (``tracing``)."""
