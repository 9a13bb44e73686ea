"""Gradient sync: bucketed collectives, local gradients and their DP reduction,
in-loop taps for scanned layers and the rules for where they sit, finalize rules.

Import from the modules; this package re-exports nothing (no import order to keep).
"""
