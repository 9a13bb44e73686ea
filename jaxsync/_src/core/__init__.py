"""Foundations every package builds on: mesh axis names, dotted param names,
PartitionSpec helpers, argument checks, one CPU program in flight at a time, and XLA
option names that change between jaxlib releases.

Import from the modules; this package re-exports nothing (no import order to keep).
"""
