"""The teacher of ``strop distill``: what must hold before anything loads, and the frozen
model that scores the student's tokens.

The teacher is built as the backend builds PPO's models, and scored as PPO scores its
reference: a LoRA model over ``distill.teacher`` (quantized by ``distill.teacher_quantization``,
as a QLoRA base) whose frozen reference is the teacher, the base with its adapters off or
with ``distill.teacher_adapter`` on (:func:`teacher_config`). Its log-probabilities are
``ActorCritic.logprobs(batch, reference=True)``: the same packing, widths and temperature
as the student's, of any family and size strop loads. Its own adapter (rank 1, never
trained) is what makes the reference a view of one frozen base rather than a second copy.

Backend-neutral: it reads configs, tokenizers and adapter headers, never weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from strop.config import Config
from strop.data import Tokenizer
from strop.errors import ConfigError
from strop.io.model_spec import read_model_spec, require_model_directory
from strop.io.peft import adapter_lora
from strop.io.run_identity import model_fingerprint

ADAPTER_DIR = "adapter"  # where a strop run directory keeps its exported adapter
_UNUSED_ADAPTER = {"rank": 1, "alpha": 1.0, "target_modules": [".*_proj"], "dropout": 0.0}


def teacher_adapter_dir(config: Config) -> Path | None:
    """``distill.teacher_adapter``: the adapter directory itself, or a strop run
    directory's exported ``adapter/``; None without one."""
    given = config.distill.teacher_adapter
    if given is None:
        return None
    path = Path(given)
    return path / ADAPTER_DIR if (path / ADAPTER_DIR).is_dir() else path


def check_teacher(config: Config) -> None:
    """Refuse, before anything loads (one line, exit 2), a teacher that cannot score the
    student: no ``distill.teacher``, one that is no model directory, a tokenizer other than
    the student's (the teacher scores the student's token ids, so both need one vocabulary
    and the same special tokens), an adapter that does not fit the teacher, or a student
    with a critic (distillation's advantages are the teacher's, per token)."""
    teacher = config.distill.teacher
    if teacher is None:
        raise ConfigError(
            "distill.teacher: set it to the teacher's checkpoint directory (a model whose "
            "tokenizer is model.path's)"
        )
    require_model_directory(teacher, "distill.teacher")
    if config.ppo.has_critic:
        raise ConfigError(
            f"ppo.advantage_estimator={config.ppo.advantage_estimator} trains a critic; strop "
            "distill's advantages are the teacher's per token: use a critic-free estimator "
            "(grpo, rloo, reinforce_pp) for distill.reward_weight's task advantages"
        )
    if config.distill.lmbda < 1 and config.env.enabled:
        raise ConfigError(
            f"distill.lmbda={config.distill.lmbda} trains some iterations on the records' "
            f"completions, and env.name={config.env.name}'s episodes have none: set "
            "distill.lmbda=1"
        )
    refuse_another_vocabulary(config.model_path(), teacher)
    adapter = teacher_adapter_dir(config)
    if adapter is not None:
        adapter_lora(config.lora, adapter, read_model_spec(teacher))  # fits the teacher


def refuse_another_vocabulary(student: str, teacher: str) -> None:
    """A :class:`ConfigError` naming the first difference between the two models'
    vocabularies (tokens and ids, added tokens included) or named special tokens."""
    ours, theirs = Tokenizer.from_pretrained(student), Tokenizer.from_pretrained(teacher)
    mine, other = ours.vocabulary(), theirs.vocabulary()
    fix = "the teacher scores the student's token ids: give a teacher with model.path's tokenizer"
    if mine != other:
        differs = sorted(set(mine.items()) ^ set(other.items()), key=lambda item: item[1])
        token = differs[0][0]
        raise ConfigError(
            f"distill.teacher={teacher}: its vocabulary differs from model.path's "
            f"({len(other)} tokens vs {len(mine)}; first: {token!r} is id "
            f"{other.get(token)} vs {mine.get(token)}); {fix}"
        )
    if ours.special_tokens != theirs.special_tokens:
        name = next(
            key
            for key in sorted(set(ours.special_tokens) | set(theirs.special_tokens))
            if ours.special_tokens.get(key) != theirs.special_tokens.get(key)
        )
        raise ConfigError(
            f"distill.teacher={teacher}: its {name} is {theirs.special_tokens.get(name)!r}, "
            f"model.path's {ours.special_tokens.get(name)!r}; {fix}"
        )


def teacher_config(config: Config) -> Config:
    """The config the teacher is built with (see the module's docstring): ``config`` with
    the teacher's path and quantization, its adapter as the frozen reference, and an
    untrained rank-1 adapter (its own, or the teacher adapter's shape) as the actor."""
    teacher = config.distill.teacher
    assert teacher is not None  # check_teacher refused it before
    adapter = teacher_adapter_dir(config)
    lora = config.lora.model_copy(update={**_UNUSED_ADAPTER, "enabled": True})
    if adapter is not None:
        lora = adapter_lora(lora, adapter, read_model_spec(teacher))
    lora = lora.model_copy(
        update={"base_quantization": config.distill.teacher_quantization, "restore_path": None}
    )
    ppo = config.ppo.model_copy(
        update={"reference_adapter": None if adapter is None else str(adapter)}
    )
    model = config.model.model_copy(update={"path": teacher})
    return config.model_copy(update={"model": model, "lora": lora, "ppo": ppo})


def teacher_identity(config: Config) -> dict[str, Any]:
    """What a distillation's checkpoints record of its teacher (a resume with another
    teacher is refused): its model's and its adapter's fingerprints."""
    teacher = config.distill.teacher
    if teacher is None:
        return {}
    identity = {
        **model_fingerprint(teacher, what="teacher"),
        "quantization": config.distill.teacher_quantization,
    }
    adapter = teacher_adapter_dir(config)
    if adapter is not None:  # an adapter directory has no config.json
        fingerprint = model_fingerprint(adapter, config=None, what="teacher adapter")
        identity["adapter"] = fingerprint["weights_fingerprint"]
    return {"teacher": identity}
