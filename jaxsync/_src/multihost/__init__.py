"""Multi-host runs: start-up through ``jax.distributed``, what the launcher is
told, what every process must agree on, and each host's part of the batch.

Import from the modules; this package re-exports nothing (no import order to keep).
"""
