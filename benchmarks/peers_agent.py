"""``benchmarks/peers.py --agent``: the multi-turn job, strop's GRPO on calculator episodes
against TRL 1.16's ``GRPOTrainer`` with ``tools=`` (its own tool-calling loop).

The job is `strop demo`'s GRPO shape (16 prompts x 4 episodes per iteration, two
mini-batches of 32, one epoch, LoRA r8/a16 on q,k,v,o,gate,up,down, AdamW lr 1e-3, no
KL) on the built-in ``calculator`` environment with the shipped tiny tool-calling model
(``strop.assets.tiny_calc_path()``): the problems of ``strop.agents.calculator_tasks``
(one train file both systems read), at most :data:`MAX_TURNS` model turns of at most
``generation.max_new_tokens`` tokens each, an episode within :data:`MAX_EPISODE_TOKENS`
tokens (the model's ``max_position_embeddings``), reward 1 for the right ``#### N``
(the environment's ``correct``). The settings are strop's resolved config; the peer
script (``benchmarks/peers/trl_grpo_agent.py``) gets them as ``--job`` JSON, and the
list of differences below is drawn from them.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

PEER = "trl-grpo-agent"
SCRIPT = "trl_grpo_agent.py"
MAX_TURNS = 4  # the calculator environment's own default
MAX_EPISODE_TOKENS = 512  # tiny-calc's max_position_embeddings
OVERRIDES = [
    "ppo.advantage_estimator=grpo",
    "env.name=calculator",
    "ppo.reward=none",
    f"env.max_turns={MAX_TURNS}",
    f"env.max_episode_tokens={MAX_EPISODE_TOKENS}",
]


def tiny_calc() -> Path:
    from strop.assets import tiny_calc_path

    return Path(tiny_calc_path())


def write_data(out: Path, seed: int, n_train: int, n_validation: int) -> int:
    """The calculator problems both systems train on (``train.jsonl``, ``validation.jsonl``
    in ``out``); returns the longest opening (system prompt, tool, question) in tokens."""
    from strop.agents.calculator import calculator_environment
    from strop.agents.calculator_tasks import write_calc_splits
    from strop.data import Tokenizer

    paths = write_calc_splits(out, seed, n_train, n_validation)
    tokenizer, env = Tokenizer.from_pretrained(tiny_calc()), calculator_environment()
    lines = paths["train"].read_text(encoding="utf-8").splitlines()
    return max(
        len(tokenizer.encode(tokenizer.apply_chat_template(env.reset(json.loads(line)), True, env.tool_schemas)))
        for line in lines
    )  # fmt: skip


def job_settings(base: dict, config, opening_tokens: int) -> dict:
    """The demo job's settings (``base``, :func:`peers.job_settings`) plus the episode's:
    the most model turns and, for TRL (whose budget counts from the end of the prompt),
    the episode budget less the longest opening."""
    return {
        **base,
        "max_turns": config.env.max_turns,
        "max_completion_tokens": config.env.max_episode_tokens - opening_tokens,
    }


def describe(config) -> str:
    """The episodes of strop's side in one line (its GRPO settings are the --grpo ones)."""
    env, gen = config.env, config.generation
    return (
        f"env {env.name} (tool calculate; reward: correct), <= {env.max_turns} model turns of "
        f"<= {gen.max_new_tokens} new tokens, <= {env.max_episode_tokens} tokens an episode "
        f"(opening included); model {tiny_calc().name}"
    )


def differences(config) -> list[str]:
    """How TRL's multi-turn GRPO job differs from strop's (``config``: the agent job's)."""
    ppo, gen, env = config.ppo, config.generation, config.env
    rollouts = ppo.prompts_per_step * ppo.num_generations_per_prompt
    out = [
        f"old log-probs: TRL recomputes them with a forward of the policy over the {rollouts} "
        f"episodes before the first of the {rollouts // ppo.mini_batch_size} optimizer steps; "
        f"strop takes the sampler's own (ppo.old_logprobs={ppo.old_logprobs}), no forward"
        if ppo.old_logprobs == "sampler"
        else "old log-probs: both recompute them with a forward of the policy",
    ]
    if ppo.dual_clip:
        out.append(f"no dual clip (strop: dual_clip {ppo.dual_clip:g})")
    out += [
        "turns: each is a transformers generate() (dynamic KV cache) over the episodes still "
        "calling tools, left-padded to the longest, the episode so far re-prefilled (strop's "
        "torch sampler re-prefills every turn too); TRL caps a turn at "
        f"{gen.max_new_tokens} new tokens through generation_kwargs (as strop's "
        "generation.max_new_tokens)",
        f"episode budget: TRL counts max_completion_length from the end of the prompt, so it is "
        f"set to {env.max_episode_tokens} less the longest opening (and TRL also stops at the "
        f"model's {MAX_EPISODE_TOKENS} positions); strop's env.max_episode_tokens="
        f"{env.max_episode_tokens} counts the opening too: the same for the longest prompt, "
        "a few tokens more for shorter ones on TRL's side",
        f"max turns: max_tool_calling_iterations={env.max_turns - 1} (turns after the first); "
        "as in strop, the calls of the last turn are not run and the episode is scored as it is",
        "tool calls are parsed by TRL's Qwen response_template (set on the tokenizer by hand: "
        "TRL knows templates by their exact text, and tiny-calc's is its own short Qwen2.5-style "
        "one); a malformed call falls back to plain text, so the episode ends there and is "
        "scored; strop answers it with a parse-error observation and the episode goes on",
        "the tool: the same function (strop.agents.calculator.calculate), called by TRL with the "
        "parsed arguments in the trainer's thread; an exception becomes the observation "
        "\"{'error': '...'}\". strop validates the arguments (pydantic), runs the call in a "
        'worker thread with a 10 s timeout and answers "error: ..."',
        "the reward: the same function (the calculator environment's correct) on the prompt "
        "plus TRL's parsed completion messages; the last assistant message's content is TRL's "
        "parsed content (tool calls removed), strop's the turn's decoded text",
        "prompt order: TRL's RepeatSampler shuffles the train file with its seed, strop draws "
        "its own order: the problems differ, iteration by iteration (same distribution)",
    ]
    return out


def episode_lines(results: dict[str, list[dict]]) -> list[str]:
    """Per system, the mean model turns and tool calls per episode over its runs."""
    lines = []
    for system, runs in results.items():
        good = [r for r in runs if "error" not in r]
        turns = [x for r in good for x in r.get("turns", [])]
        calls = [x for r in good for x in r.get("tool_calls", [])]
        if turns:
            calls_text = f", {statistics.mean(calls):.2f} tool calls" if calls else ""
            lines.append(
                f"  {system}: {statistics.mean(turns):.2f} model turns{calls_text} per episode "
                f"(mean over {len(turns)} iterations)"
            )
    return lines
