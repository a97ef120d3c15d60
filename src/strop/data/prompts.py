"""Examples -> the prompt a model is asked to continue, and the answer it should reach.

The prompt is tokenized exactly as in training (``data/sft.py``): the tokenizer's prefix
(e.g. BOS) + the prompt text for prompt/completion and GSM8K records; for chats, every
turn before the last assistant turn rendered with the chat template and its generation
prompt. So evaluation and RL see the prompts SFT trained on.

The gold answer is the reward's business: a reward registered with a
:class:`~strop.rewards.Gold` finds it in the record's answer text (the completion, or the
last assistant turn), and :func:`gold_answers` refuses a record where it finds none, by
file and line, before any model loads (with ``data.skip_bad_lines`` it skips and counts
them). A reward nobody can earn would otherwise train on 0.000 without a word.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from strop.data.sources import Example
from strop.data.tokenizer import Tokenizer
from strop.errors import DataError, StropError

if TYPE_CHECKING:
    from strop.config import DataConfig
    from strop.rewards import Reward

logger = logging.getLogger(__name__)
_dropped = logging.getLogger("strop.rl.prompts")  # PPO's line on prompts left out, as before


def prompt_ids(example: Example, tokenizer: Tokenizer) -> list[int]:
    """Token ids of the prompt of ``example`` (what generation continues)."""
    if example.messages is not None:
        turns = list(example.messages)
        if turns and turns[-1]["role"] == "assistant":
            turns = turns[:-1]
        if not turns:
            raise DataError(f"{example.source}:{example.line}: the chat has no prompt turns")
        try:
            text = tokenizer.apply_chat_template(turns, True, example.tools)
        except StropError as e:  # no template (ModelError), a template failure (DataError)
            raise type(e)(f"{example.source}:{example.line}: {e}") from None
        return tokenizer.encode(text)
    assert example.prompt is not None
    return list(tokenizer.special_prefix_ids) + tokenizer.encode(example.prompt)


def gold_answer(example: Example) -> str:
    """The reference the response is scored against: a GSM8K record's final answer, else
    the completion or last assistant turn (a reward extracts what it needs from it)."""
    if example.reference is not None:
        return example.reference
    if example.completion is not None:
        return example.completion
    if example.messages and example.messages[-1]["role"] == "assistant":
        return example.messages[-1]["content"]
    raise DataError(f"{example.source}:{example.line}: no reference answer to score against")


def answer_text(example: Example) -> str | None:
    """The text a record's gold answer is found in: the completion (a gsm8k record's is its
    answer), or a chat's last assistant turn; None for a chat that ends in another turn."""
    if example.completion is not None:
        return example.completion
    if example.messages and example.messages[-1]["role"] == "assistant":
        return example.messages[-1]["content"]
    return None


def gold_answers(
    examples: list[Example], reward: Reward, *, setting: str, skip_bad_lines: bool = False
) -> tuple[list[Example], list[str]]:
    """The examples a reward can score and, aligned, its ``answer`` column for them.

    A reward registered with a :class:`~strop.rewards.Gold` gets the gold its ``extract``
    finds in every record's :func:`answer_text`; the first record with none is refused by
    file and line (``setting``, e.g. ``ppo.reward``, is named in the message), or with
    ``skip_bad_lines`` every such record is dropped and counted in one warning (still an
    error when none is left). Every record is checked, not only those a run will draw. A
    reward without one needs no gold: all examples are kept and get the record's answer as
    is (a gsm8k record's final answer, the completion or last assistant turn, else "").
    """
    rule = reward.gold
    if rule is None:
        return examples, [example.reference or answer_text(example) or "" for example in examples]
    kept, golds, missing = [], [], []
    for example in examples:
        text = answer_text(example)
        gold = rule.extract(text) if text is not None else None
        if gold is None:
            if not skip_bad_lines:
                raise DataError(
                    f"{example.source}:{example.line}: no gold answer for reward "
                    f"'{reward.name}' (it needs {rule.needs}); fix the data, set "
                    f"data.skip_bad_lines=true to skip such records, or choose {setting}=format"
                )
            missing.append(example)
        else:
            kept.append(example)
            golds.append(gold)
    if missing:
        first = missing[0]
        if not kept:
            raise DataError(
                f"{first.source}: none of the {len(missing)} records has a gold answer for "
                f"reward '{reward.name}' (first: {first.source}:{first.line}; it needs "
                f"{rule.needs}); fix the data or choose {setting}=format"
            )
        lines = ", ".join(str(e.line) for e in missing[:10]) + ", ..." * (len(missing) > 10)
        logger.warning(
            "%s: skipped %d of %d records with no gold answer for reward %r (lines %s)",
            first.source, len(missing), len(examples), reward.name, lines,
        )  # fmt: skip
    return kept, golds


# Passed positionally to every reward function; a record column of that name is not passed.
_POSITIONAL = ("prompts", "completions")


def record_columns(examples: Sequence[Example]) -> dict[str, list[Any]]:
    """The columns reward functions get for ``examples``: every key of the records as read
    (None where a record lacks it), aligned with ``examples``. ``answer`` is the record's
    own ``answer`` if it has one, else its answer text (the completion, or a chat's last
    assistant turn; "" if none); a component with a gold rule gets its extracted gold
    there instead. Columns named ``prompts`` or ``completions`` are left out: those
    arguments are the prompt texts and the responses."""
    records = [example.columns or {} for example in examples]
    keys = dict.fromkeys(key for record in records for key in record)
    columns = {k: [r.get(k) for r in records] for k in keys if k not in _POSITIONAL}
    columns["answer"] = [
        r["answer"] if "answer" in r else (answer_text(e) or "")
        for e, r in zip(examples, records, strict=True)
    ]
    return columns


def within_max_length(
    examples: list[Example], ids: list[list[int]], data: DataConfig
) -> tuple[list[Example], list[list[int]]]:
    """Drop (and log) prompts longer than ``data.max_length`` tokens, or with
    ``data.truncation=error`` refuse the first one by file and line. A prompt is never cut:
    half a question has no right answer to reward."""
    kept = [i for i, prompt in enumerate(ids) if len(prompt) <= data.max_length]
    if len(kept) == len(ids):
        return examples, ids
    long = [i for i in range(len(ids)) if len(ids[i]) > data.max_length]
    first = examples[long[0]]
    where = f"{first.source}:{first.line}: the prompt has {len(ids[long[0]])} tokens"
    if data.truncation == "error":
        raise DataError(
            f"{where}, more than data.max_length={data.max_length}; raise data.max_length, or "
            "set data.truncation to right or left to drop such prompts"
        )
    lines = ", ".join(str(examples[i].line) for i in long[:10]) + (", ..." * (len(long) > 10))
    _dropped.warning(
        "%s: dropped %d of %d prompts longer than data.max_length=%d tokens (lines %s)",
        first.source, len(long), len(ids), data.max_length, lines,
    )  # fmt: skip
    return [examples[i] for i in kept], [ids[i] for i in kept]
