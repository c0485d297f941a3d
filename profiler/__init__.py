"""Profiler: measure (or model) what every node of a captured graph costs, as a CostGraph."""

from autopart.profiler.measure import profile_graph

__all__ = ["profile_graph"]
