"""Fully sharded data parallelism (ZeRO-3 / FSDP2): units, the gather whose
backward reduce-scatters, the model's view, the optimizer over shards, offload.

Import from the modules; this package re-exports nothing (no import order to keep).
"""
