"""``jaxsync.train_step``: the builder that checks the options, the built step
(init, the jitted step, the state API) and its per-mode bodies on 1-D meshes.

Import from the modules; this package re-exports nothing (no import order to keep).
"""
