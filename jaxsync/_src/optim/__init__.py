"""The distributed optimizer (ZeRO-1/2) as an optax transformation: its plan,
state, checks and metrics, whole-matrix owners, loss scaling, clipping, and the
DP-size-independent (portable) form of its state.

Import from the modules; this package re-exports nothing (no import order to keep).
"""
