"""The gradient program every mode takes its gradients from: ``jax.value_and_grad``
traced once, rewritten exactly (the same values; less held, fewer bytes moved), and
evaluated.

Import from the modules; this package re-exports nothing (no import order to keep).
"""
