"""What the updates optimise, below the backends and the loops: array-level losses over a
backend's ``ArrayOps``, their registries, and the loss weights (numpy; no jax, no torch)."""
