"""Steps on 2-D meshes, where the compiler shards params over other axes too:
each param's data-axis cut and collectives, the taps, the body, the portable form.

Import from the modules; this package re-exports nothing (no import order to keep).
"""
