"""Multi-turn agents: environments, tools, the python sandbox, and token-in/token-out episodes."""
