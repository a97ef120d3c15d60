"""Reading a HF checkpoint's ``config.json`` into a :class:`~strop.models.ModelSpec`
(its family parses it: :mod:`strop.models`), and the checks made from it before any weight
is read: the model directory itself, the context length, the ids that end a response.

Backend-neutral. A missing or unreadable file, or a field that is missing or absurd, is a
one-line :class:`~strop.errors.ModelError` naming the file.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from strop.errors import ConfigError, ModelError
from strop.io.untrusted import read_json
from strop.models import ModelSpec, parse_config

CONFIG_FILE = "config.json"


def read_model_spec(path: str | os.PathLike) -> ModelSpec:
    """Read ``config.json`` from a checkpoint directory into a :class:`ModelSpec`."""
    directory = Path(path)
    if not directory.is_dir():
        raise ModelError(f"model path {str(directory)!r} is not a directory")
    config_path = directory / CONFIG_FILE
    if not config_path.is_file():
        raise ModelError(f"{config_path}: not found; a HF checkpoint directory needs config.json")
    cfg = read_json(config_path, ModelError)
    if not isinstance(cfg, dict):
        raise ModelError(f"{config_path}: expected a JSON object")
    return parse_config(cfg, source=str(config_path))


def response_end_ids(spec: ModelSpec, tokenizer_eos_id: int) -> list[int]:
    """The ids that end a response of ``spec``'s model: its tokenizer's EOS
    (``tokenizer_eos_id``) and every EOS id of its config (``generation_config`` may list
    several)."""
    return sorted({tokenizer_eos_id, *spec.eos_token_ids})


def check_context_length(
    spec: ModelSpec,
    model_path: str,
    *,
    samples: bool,
    max_length: int,
    max_new_tokens: int,
    longest_prompt: int | None = None,
    max_episode_tokens: int | None = None,
    prompts_cut_at_max_length: bool = False,
) -> None:
    """Refuse (:class:`ConfigError`) sequences longer than ``spec``'s positions
    (``max_position_embeddings`` of ``model_path``'s config.json), which would otherwise
    sample garbage without a word (or fail in vLLM after its load). A run that does not
    sample trains on ``data.max_length`` (``max_length``) tokens. A run that ``samples``
    needs room for ``max_new_tokens`` (``generation.max_new_tokens``; at preflight,
    ``longest_prompt=None``) and then the longest prompt read plus ``max_new_tokens``
    (checked again once the prompts are read, before the weights load); where
    ``prompts_cut_at_max_length`` (a training run drops prompts longer than
    ``data.max_length``), the message offers that fix too. A run that plays episodes
    (``max_episode_tokens``: ``env.max_episode_tokens``, prompt and every turn included)
    checks that instead: a turn samples no further than its episode's budget."""
    positions = spec.max_position_embeddings
    limit = f"the model's max_position_embeddings={positions} ({model_path}/{CONFIG_FILE})"
    if not samples:
        if max_length > positions:
            raise ConfigError(
                f"data.max_length={max_length} is more than {limit}: "
                f"lower data.max_length to at most {positions}"
            )
        return
    if max_episode_tokens is not None:
        if max_episode_tokens > positions:
            raise ConfigError(
                f"env.max_episode_tokens={max_episode_tokens} is more than {limit}: lower "
                f"env.max_episode_tokens to at most {positions}"
            )
        return
    new = max_new_tokens
    if new + (longest_prompt or 1) <= positions:
        return
    if longest_prompt is None:
        raise ConfigError(
            f"generation.max_new_tokens={new} leaves no room for a prompt within {limit}: "
            f"lower generation.max_new_tokens to at most {positions - 1}"
        )
    fix = f"lower generation.max_new_tokens to at most {max(positions - longest_prompt, 1)}"
    if prompts_cut_at_max_length and positions - new >= 1:
        fix += f", or data.max_length to {positions - new} to drop the longer prompts"
    raise ConfigError(
        f"the longest prompt ({longest_prompt} tokens) + generation.max_new_tokens={new} "
        f"is more than {limit}: {fix}"
    )


_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # owner/name, as on the Hugging Face Hub


def require_model_directory(path: str | None, setting: str) -> None:
    """Refuse (:class:`ConfigError`) a model ``path`` (``setting``'s) that is no directory;
    for one shaped like a Hugging Face Hub name (``Qwen/Qwen2.5-0.5B``), say how to download
    it (strop downloads nothing). None passes: who needs the path says so."""
    if path is None or Path(path).is_dir():
        return
    if _HUB_NAME.fullmatch(path):
        local = f"models/{path.split('/')[1]}"
        raise ConfigError(
            f"{setting}={path}: no such directory; strop loads only local directories: "
            f"download it first with `huggingface-cli download {path} --local-dir {local}` "
            f"and set {setting}={local}"
        )
    raise ConfigError(
        f"{setting}={path}: no such directory; give a Hugging Face checkpoint directory "
        "(config.json, *.safetensors, tokenizer.json)"
    )
