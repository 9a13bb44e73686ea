"""``jaxsync.train_step``: the builder that checks the options, the built step
(init, the jitted step, the state API), its mode values, and its per-mode bodies:
on 1-D meshes here, on 2-D meshes in :mod:`two_d`.

Import from the modules; this package re-exports nothing (no import order to keep).
"""
