"""Reward models: ``ppo.reward: model:DIR`` scores each (prompt, response) with a Hugging
Face sequence-classification checkpoint (``Qwen2ForSequenceClassification`` or
``LlamaForSequenceClassification``, one label), frozen, on the run's backend.

This module is backend-neutral: it checks ``DIR`` when the reward is resolved (before any
model loads: config.json, its architecture and ``num_labels``, tokenizer.json). The model
itself is built at the first call by the ``build_model`` the caller gave
:func:`strop.rewards.resolve` (PPO's and ``strop eval``'s:
:func:`strop.scoring.build_reward_model`, the run's backend's, a
:class:`~strop.backends.base.RewardModel`), so a config mistake still
stops a run before anything loads, and the rewards never import a backend.

The text and the pooled column both backends' reward models read:
:mod:`strop.batch.reward_rows`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
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


class ModelReward:
    """The reward function of ``model:DIR``: the model ``build_model(DIR)`` returns, built
    at the first call (``build_model``: what :func:`strop.rewards.resolve` was given)."""

    def __init__(
        self,
        directory: Path,
        ref: str,
        setting: str,
        build_model: Callable[[Path], Any] | None = None,
    ):
        self.directory, self.ref, self.setting = directory, ref, setting
        self.build_model = build_model
        self._model = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"ModelReward({str(self.directory)!r})"

    @property
    def model(self):
        """The :class:`~strop.backends.base.RewardModel` (built once)."""
        with self._lock:
            if self._model is None:
                from strop.rewards.base import RewardError

                if self.build_model is None:
                    raise RewardError(
                        f"{self.setting}={self.ref!r}: a reward model needs the run's backend "
                        "(strop.rewards.resolve(..., build_model=...))"
                    )
                self._model = self.build_model(self.directory)
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
