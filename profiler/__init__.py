"""Profiler: measure (or model) what every node of a captured graph costs, as a CostGraph."""

from autopart.profiler._oputil import EXTRA_FLOP_FORMULAS, flop_formulas
from autopart.profiler.analytical import profile_analytical
from autopart.profiler.measure import MeasureReport, profile_graph, profile_graph_report

__all__ = ["profile_graph", "profile_graph_report", "profile_analytical", "MeasureReport",
           "EXTRA_FLOP_FORMULAS", "flop_formulas"]
