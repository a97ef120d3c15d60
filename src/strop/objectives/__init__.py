"""What PPO trains and how: the role plan, the losses and their registries (core, backend-neutral)."""
