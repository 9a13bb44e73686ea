"""The flat-buffer layout: which buffer, bucket and offset each param gets, and
which rank owns each whole matrix. Static: built from shapes and dtypes only.

Import from the modules; this package re-exports nothing (no import order to keep).
"""
