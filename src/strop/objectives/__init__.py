"""What the updates optimise and who trains, below the backends and the loops: the role plan,
array-level losses over a backend's ``ArrayOps``, their registries, and the loss weights
(numpy; no jax, no torch)."""
