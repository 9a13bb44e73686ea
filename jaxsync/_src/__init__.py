"""jaxsync's implementation, one package per concept; ``jaxsync`` re-exports the API."""
