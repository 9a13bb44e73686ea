"""Foundations every package builds on: mesh axis names, dotted param names,
PartitionSpec helpers, argument checks, and one CPU program in flight at a time.

Import from the modules; this package re-exports nothing (no import order to keep).
"""
