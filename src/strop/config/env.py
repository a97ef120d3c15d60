"""The ``env`` section: the environment ``strop ppo`` and ``strop eval`` play multi-turn episodes in
(:mod:`strop.agents`; docs/agents.md). ``env.name: none`` (the default) keeps single-turn
completions."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from strop.config.sections import _Section

NONE = "none"


class EnvConfig(_Section):
    """Multi-turn episodes: which environment, and how far an episode may go."""

    name: str = Field(
        NONE,
        min_length=1,
        description="The environment `strop ppo` and `strop eval` play episodes in: none (single-turn "
        "completions, as without this section), a built-in (calculator, python), "
        "package.module:factory or path/to/file.py:factory; imported, and its factory called "
        "once with env.args, at preflight (a mistake: one line, before anything loads). "
        "Its reward parts, summed, are each episode's reward, plus ppo.reward's when it is "
        "given as weighted terms (they score the episode's last model turn); eval.reward does "
        "not apply.",
    )
    args: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments of the environment's factory (e.g. "
        "{max_turns: 2, system_prompt: null} for calculator), at preflight and for each "
        "episode.",
    )
    max_turns: int = Field(
        4,
        gt=0,
        description="The most model turns in an episode (the environment may end it sooner).",
    )
    max_episode_tokens: int = Field(
        1024,
        gt=0,
        description="The most tokens in an episode, its opening messages included; "
        "generation.max_new_tokens is the most one turn samples. Within the model's "
        "max_position_embeddings.",
    )
    step_timeout_s: float | None = Field(
        60.0,
        gt=0,
        description="Deadline of one reset or step of the environment; past it the episode "
        "fails (reward 0, counted in env/errors). null: no deadline. In an environment of "
        "strop's tools a turn's tool calls stop just before it (the calls it cuts are tool "
        "errors, not a failed episode).",
    )
    tool_timeout_s: float | None = Field(
        None,
        gt=0,
        description="Deadline of each tool call in an environment of strop's tools, counted "
        "from when the call starts; a call past it is a tool error the model reads. null: each "
        "tool's own (10 s; python: its sandbox's limits.wall_time_s + 5 s).",
    )
    tool_workers: int | None = Field(
        None,
        gt=0,
        description="Threads that run the episodes' tool calls at once (they mostly wait on a "
        "sandboxed child process); null: one per episode of the batch. Fewer queue the "
        "calls, and the wait counts against each step's deadline.",
    )
    max_tool_calls_per_turn: int = Field(
        8,
        gt=0,
        description="The most tool calls of one model turn that run in an environment of "
        "strop's tools (calculator, python, verifiers:..., any ToolEnv); the calls past it "
        "do not run and are answered with one error message.",
    )
    kv_cache: bool = Field(
        True,
        description="The native samplers (JAX, torch) continue each episode from the KV "
        "cache of its previous turn, prefilling only the new tokens (the last sampled one and "
        "the environment's messages); false: every turn re-prefills the whole episode. Both "
        "sample the same tokens.",
    )
    max_error_fraction: float = Field(
        0.5,
        ge=0,
        le=1,
        description="Stop the run when more than this share of one batch's episodes fail in "
        "the environment (it raised, returned something wrong, ran past step_timeout_s); "
        "a failed episode scores 0 and carries no loss weight. 1 = never stop.",
    )

    @field_validator("name")
    @classmethod
    def _none(cls, value: str) -> str:
        return NONE if value.strip() == NONE else value

    @property
    def enabled(self) -> bool:
        """Whether runs play episodes (``name`` is not ``none``)."""
        return self.name != NONE
