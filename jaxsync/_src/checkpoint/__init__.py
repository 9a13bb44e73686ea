"""Checkpoints through orbax: the Checkpointer, the whole train state at any DP
size, what is recorded beside the arrays, checksums, one writer per directory.

Import from the modules; this package re-exports nothing (no import order to keep).
"""
