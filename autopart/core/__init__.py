"""The data contracts every layer shares (CostGraph, Cluster, Plan, schedule actions,
CapturedGraph), typed errors, JSON I/O and capture. Imports nothing of autopart above it;
only ``capture`` imports torch, so the solver can use the rest without it."""
