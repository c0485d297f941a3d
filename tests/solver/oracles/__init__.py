"""Test oracles for the solver: exact and brute-force references no package code uses."""
