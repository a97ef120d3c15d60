"""Reward models: ``ppo.reward: model:DIR`` scores each (prompt, response) with a Hugging
Face sequence-classification checkpoint (``Qwen2ForSequenceClassification`` or
``LlamaForSequenceClassification``, one label), frozen, on the run's backend.

This module is backend-neutral: it checks ``DIR`` when the reward is resolved (before any
model loads: config.json, its architecture and ``num_labels``, tokenizer.json), turns
(prompt, response) pairs into the reward model's token ids, and says which token's hidden
state is scored. The model itself is built by the backend
(``get_backend(config.backend).build_reward_model(config, DIR)``, a
:class:`~strop.backends.base.RewardModel`) at the first call, so a config mistake still
stops a run before anything loads.

Text: the reward model's own tokenizer; with a chat template, the conversation
``[user: prompt, assistant: response]`` rendered by it; without one, prompt + response
(with the tokenizer's special prefix, e.g. BOS, as ``transformers`` would add).

Score: the score head on the hidden state of the last token that is not
``pad_token_id`` (of the model's config.json), as ``transformers``'
``...ForSequenceClassification`` pools; with no ``pad_token_id``, the last token.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from strop.errors import StropError
from strop.io.untrusted import read_json

PREFIX = "model:"
ARCHITECTURES = ("Qwen2ForSequenceClassification", "LlamaForSequenceClassification")
NAME = "reward_model"  # its metric: reward/reward_model (a term's name: can rename it)


def is_model_reference(ref: str) -> bool:
    """``model:DIR``: a reward model, not a function."""
    return ref.startswith(PREFIX)


def num_labels(config: dict[str, Any]) -> int:
    """``num_labels`` as transformers reads it (``id2label``'s length; 2 by default)."""
    if isinstance(config.get("id2label"), dict):
        return len(config["id2label"])
    value = config.get("num_labels", 2)
    return value if isinstance(value, int) else -1


def check_directory(directory: str, ref: str, setting: str) -> Path:
    """``DIR`` holds a supported one-label sequence-classification checkpoint and a fast
    tokenizer; else :class:`~strop.rewards.base.RewardError` (one line)."""
    from strop.io.model_spec import read_model_spec
    from strop.rewards.base import RewardError

    def refuse(what: str) -> RewardError:
        return RewardError(f"{setting}={ref!r}: {what}")

    if not directory:
        raise refuse("give the reward model's checkpoint directory: model:path/to/dir")
    path = Path(directory).expanduser()
    if not path.is_dir():
        raise refuse(f"{path} is not a directory (a HF sequence-classification checkpoint)")
    if not (path / "config.json").is_file():
        raise refuse(f"{path} has no config.json; a reward model is a HF checkpoint directory")
    try:
        config = read_json(path / "config.json", StropError)
    except StropError as err:
        raise refuse(str(err)) from None
    if not isinstance(config, dict):
        raise refuse(f"{path / 'config.json'} is not a JSON object")
    architectures = config.get("architectures") or []
    if not any(a in ARCHITECTURES for a in architectures):
        raise refuse(
            f"{path} is a {'/'.join(map(str, architectures)) or 'model of no architecture'}; "
            f"a reward model is a {' or '.join(ARCHITECTURES)}"
        )
    labels = num_labels(config)
    if labels != 1:
        raise refuse(f"{path} has num_labels={labels}; a reward model has one label (a score)")
    if not (path / "tokenizer.json").is_file():
        raise refuse(f"{path} has no tokenizer.json; a reward model brings its own tokenizer")
    try:
        read_model_spec(path)
    except StropError as err:
        raise refuse(str(err)) from None
    return path


def encode_pairs(tokenizer, prompts: Sequence[str], completions: Sequence[str]) -> list[list[int]]:
    """The reward model's token ids of each (prompt, completion): through its chat template
    when it has one, else the plain concatenation after its special prefix."""
    if tokenizer.chat_template is not None:
        texts = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": p}, {"role": "assistant", "content": c}]
            )
            for p, c in zip(prompts, completions, strict=True)
        ]
        return tokenizer.encode_batch(texts)
    prefix = tokenizer.special_prefix_ids
    texts = [p + c for p, c in zip(prompts, completions, strict=True)]
    return [prefix + ids for ids in tokenizer.encode_batch(texts)]


def pooled_index(ids: Sequence[int], pad_id: int | None) -> int:
    """The column whose hidden state is scored: the last token that is not ``pad_id``
    (0 if every token is), as transformers pools; the last token without a ``pad_id``."""
    if pad_id is None:
        return len(ids) - 1
    real = np.flatnonzero(np.asarray(ids) != pad_id)
    return int(real[-1]) if len(real) else 0


def right_padded(
    rows: Sequence[Sequence[int]], width: int, count: int, fill: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, mask)`` ``[count, width]`` int32: ``rows`` right-padded, then empty rows."""
    ids = np.full((count, width), fill, np.int32)
    mask = np.zeros((count, width), np.int32)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = row
        mask[i, : len(row)] = 1
    return ids, mask


class ModelReward:
    """The reward function of ``model:DIR``: the backend's reward model, built at the first
    call for the run's config (given by :meth:`bind`, which :func:`strop.rewards.resolve`
    does when it gets ``config=``)."""

    def __init__(self, directory: Path, ref: str, setting: str, config: Any = None):
        self.directory, self.ref, self.setting = directory, ref, setting
        self.config = config
        self._model = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"ModelReward({str(self.directory)!r})"

    def bind(self, config: Any) -> None:
        """The run's config: its backend, dtype, mesh and micro-batch size."""
        self.config = config

    @property
    def model(self):
        """The backend's :class:`~strop.backends.base.RewardModel` (built once)."""
        with self._lock:
            if self._model is None:
                from strop.backends import get_backend
                from strop.rewards.base import RewardError

                if self.config is None:
                    raise RewardError(
                        f"{self.setting}={self.ref!r}: a reward model needs the run's config "
                        "(strop.rewards.resolve(..., config=config))"
                    )
                backend = get_backend(self.config.backend)
                self._model = backend.build_reward_model(self.config, self.directory)
            return self._model

    def __call__(
        self, prompts: list[str], completions: list[str], **columns: list[Any]
    ) -> list[float]:
        model = self.model
        try:
            scores = model.score(list(prompts), list(completions))
        except StropError:
            raise
        except Exception as exc:  # a model failure is not one item's: not contained
            raise StropError(
                f"reward model {self.directory} failed: {type(exc).__name__}: {exc}"
            ) from exc
        return [float(s) for s in np.asarray(scores, dtype=np.float64)]
