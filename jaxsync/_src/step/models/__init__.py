"""How the model libraries meet the step: flax NNX modules split into params and
the rest, linen's boxed params turned into placements, linen ``nn.scan`` stacks
tapped for in-loop sync.

Import from the modules; this package re-exports nothing (no import order to keep).
"""
