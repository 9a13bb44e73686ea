"""GPU programs without a GPU: compile-only meshes, XLA's schedule of a step read
back into a report, the roofline for what it skips, and HLO readers.

Import from the modules; this package re-exports nothing (no import order to keep).
"""
