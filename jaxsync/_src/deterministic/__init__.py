"""Deterministic mode: units of work, exact fixed-point sums, and the exact
reductions that make results bitwise identical at any DP size.

Import from the modules; this package re-exports nothing (no import order to keep).
"""
