"""autopart.solver: cut candidates, chain partition (CP-SAT, exact DP) and solve(); no torch."""

from __future__ import annotations

from autopart.solver.candidates import CutCandidates, Segment, crossing_values, find_candidates
from autopart.solver.options import SolveOptions
from autopart.solver.solve import solve

__all__ = ["solve", "SolveOptions", "find_candidates", "crossing_values", "CutCandidates",
           "Segment"]
