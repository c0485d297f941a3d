"""The one-process runtime: every stage in this process, each on its device's stream
(:class:`PipelinedModule`), its actions run by the local executor, optionally issued by a
thread per rank and replayed as CUDA graphs."""

from autopart.runtime.local.module import PipelinedModule

__all__ = ["PipelinedModule"]
