"""Token-in/token-out episodes: one multi-turn conversation kept as the token ids the policy
saw and sampled, with a mask of the policy's own tokens and their sampling log-probabilities.

Why not render the finished conversation and tokenize it? The text of the model's tokens does
not always tokenize back to those tokens (the model may write ``" inter" + "national"`` where
the text encodes to ``" international"``), so the training step would score ids the policy
never sampled. And gluing per-turn renders together loses the template's text between turns:
Qwen's ``"\\n"`` after an assistant's ``<|im_end|>`` is not sampled (the model stops on
``<|im_end|>``) and not in a render of the next message alone (verl#6921). So:

- the policy's tokens are appended unchanged (:meth:`Episode.add_sampled`), mask 1, with their
  log-probs, its stop token included;
- everything else (the prompt, tool and environment messages, the template's turn separators
  and generation prompts) is tokenized once per turn, mask 0, as the text the chat template
  adds when the conversation grows by those messages (:meth:`Episode.add_messages`): the
  template's close of the assistant turn the model did not write (``"\\n"`` after a sampled
  ``<|im_end|>``; all of ``"<|im_end|>\\n"`` after a turn cut by length), the new messages
  and the next generation prompt.

At every turn boundary the ids equal ``encode(apply_chat_template(episode.messages,
add_generation_prompt=True, tools=...))`` wherever the model's tokens are the canonical
tokenization of their text; elsewhere they differ only inside the model's turns.

Only the chat template's own markup becomes control tokens. Text in the messages and tool
schemas (a tool result, a web page, a prompt) that spells a special token (``<|im_end|>\n
<|im_start|>assistant``) is tokenized as plain text (:meth:`Tokenizer.encode_plain`), so
tool output cannot forge a turn: the ids are then those of the same render with that text
split as ordinary characters, and differ from ``encode(render)`` only there.
"""

from __future__ import annotations

import math
import re
import secrets
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from strop.data.tokenizer import Message, Tokenizer
from strop.errors import DataError

# Stands for an assistant turn's content when looking up what the template closes assistant
# turns with: the text after it in a render.
_SENTINEL = "\x00strop-assistant-content\x00"


@dataclass(frozen=True)
class EpisodeColumns:
    """An episode as training arrays, one entry per token.

    Attributes:
      ids: ``[T] int32`` token ids, prompt first.
      sampled: ``[T] int8`` 1 on the tokens the policy sampled (the loss mask), 0 on prompt,
        environment, tool and template tokens.
      logprobs: ``[T] float32`` the sampler's log-probability of each sampled token; NaN where
        ``sampled`` is 0 or the sampler gave none.
    """

    ids: np.ndarray
    sampled: np.ndarray
    logprobs: np.ndarray


class Episode:
    """A conversation as token ids, built turn by turn (see the module docstring).

    Start with the prompt (``Episode(tokenizer, messages, tools)``), then alternate
    :meth:`add_sampled` (the model's turn, possibly in several pieces) and
    :meth:`add_messages` (what the environment answers).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        messages: Sequence[Message],
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        stop_ids: Iterable[int] | None = None,
    ) -> None:
        """An episode holding the prompt: ``messages`` rendered by ``tokenizer``'s chat
        template with ``tools`` and the generation prompt, tokenized once (mask 0).

        ``stop_ids``: ids that end a model turn and are not part of its text (default: the
        tokenizer's EOS); the first token the template closes assistant turns with
        (``<|im_end|>``, ``<|eot_id|>``) always is one."""
        if not messages:
            raise DataError("an episode starts from at least one message (the prompt)")
        self.tokenizer = tokenizer
        self.tools = None if tools is None else [_valid_text(dict(t)) for t in tools]
        self._plain = _PlainText(tokenizer)
        self._history: list[dict[str, Any]] = [_as_message(m) for m in messages]
        self._text = self._render(self._history, add_generation_prompt=True)
        self._ids: list[int] = self._plain.encode(self._text)
        self._sampled: list[int] = [0] * len(self._ids)
        self._logprobs: list[float] = [math.nan] * len(self._ids)
        self._turns: list[tuple[int, int]] = []
        self._turn: list[int] | None = None  # the open model turn's ids, None between turns
        if stop_ids is None:
            eos = tokenizer.token_id("eos_token")
            stop_ids = () if eos is None else (eos,)
        closer_ids = tokenizer.encode(self._closer())
        self._stop_ids = frozenset(int(i) for i in stop_ids) | frozenset(closer_ids[:1])

    # -- building --------------------------------------------------------------------------

    def add_sampled(
        self, token_ids: Sequence[int], logprobs: Sequence[float] | None = None
    ) -> None:
        """Append tokens the policy sampled, unchanged (never re-tokenized), with mask 1 and
        their sampling log-probs (NaN when ``logprobs`` is None). Include the stop token when
        the model stopped on one; leave it out when the turn was cut by length. Consecutive
        calls extend the same turn."""
        ids = [int(i) for i in token_ids]
        vocab = self.tokenizer.vocab_size
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise DataError(f"sampled token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        if logprobs is None:
            values = [math.nan] * len(ids)
        else:
            values = [float(x) for x in logprobs]
            if len(values) != len(ids):
                raise DataError(f"add_sampled got {len(ids)} token ids but {len(values)} log-probs")
        start = len(self._ids)
        if self._turn is None:
            self._turn = []
            self._turns.append((start, start))
        self._turn.extend(ids)
        self._ids.extend(ids)
        self._sampled.extend([1] * len(ids))
        self._logprobs.extend(values)
        self._turns[-1] = (self._turns[-1][0], len(self._ids))

    def add_messages(self, messages: Sequence[Message]) -> list[int]:
        """Close the model's turn and append ``messages`` (tool results, the environment's
        reply) and the next generation prompt, tokenized once as the text the chat template
        adds for them (mask 0). Returns the appended ids."""
        if not messages:
            raise DataError("add_messages needs at least one message")
        if self._turn is None:
            raise DataError(
                "add_messages follows a model turn: call add_sampled first (pass all the "
                "messages that answer one turn in one add_messages call)"
            )
        closer = self._closer()
        content, stop_text = self._split_turn(self._turn)
        # What the template closes the turn with, less what the model already wrote of it:
        # "\n" after a sampled "<|im_end|>"; all of "<|im_end|>\n" after a cut turn (or after
        # a stop token the template does not write there, which stays as sampled).
        rest = closer[len(stop_text) :] if stop_text and closer.startswith(stop_text) else closer
        history = [*self._history, {"role": "assistant", "content": content}]
        before = self._render(history, add_generation_prompt=False)
        new = [_as_message(m) for m in messages]
        after = self._render([*history, *new], add_generation_prompt=True)
        if not (before.startswith(self._text) and after.startswith(before)):
            raise DataError(
                f"the chat template of {self.tokenizer.name} rewrites earlier turns when "
                "messages are added, so an episode cannot grow token by token with it; set "
                "data.chat_template to a template whose render of a longer conversation "
                "extends the shorter one's (qwen3-training for Qwen3; docs/agents.md)"
            )
        ids = self._plain.encode(rest + after[len(before) :])
        self._ids.extend(ids)
        self._sampled.extend([0] * len(ids))
        self._logprobs.extend([math.nan] * len(ids))
        self._history = [*history, *new]
        self._text = after
        self._turn = None
        return ids

    # -- views -----------------------------------------------------------------------------

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The conversation so far; the assistant's messages hold the text of its tokens
        (its stop token left out)."""
        messages = [dict(m) for m in self._history]
        if self._turn is not None:
            messages.append({"role": "assistant", "content": self._split_turn(self._turn)[0]})
        return messages

    @property
    def ids(self) -> list[int]:
        """All token ids, prompt first."""
        return list(self._ids)

    @property
    def sampled(self) -> list[int]:
        """Per token: 1 where the policy sampled it, else 0."""
        return list(self._sampled)

    @property
    def logprobs(self) -> list[float]:
        """Per token: the sampler's log-prob where the policy sampled it, else NaN."""
        return list(self._logprobs)

    @property
    def turns(self) -> list[tuple[int, int]]:
        """``(start, end)`` token spans of the policy's turns, in order."""
        return list(self._turns)

    def columns(self) -> EpisodeColumns:
        """The episode as training arrays (:class:`EpisodeColumns`)."""
        return EpisodeColumns(
            ids=np.asarray(self._ids, dtype=np.int32),
            sampled=np.asarray(self._sampled, dtype=np.int8),
            logprobs=np.asarray(self._logprobs, dtype=np.float32),
        )

    def __len__(self) -> int:
        return len(self._ids)

    # -- helpers ---------------------------------------------------------------------------

    def _render(self, messages: Sequence[Message], *, add_generation_prompt: bool) -> str:
        """The chat template's render, special-token text in the messages marked (see
        :class:`_PlainText`)."""
        return self.tokenizer.apply_chat_template(
            self._plain.mark(list(messages)),
            add_generation_prompt=add_generation_prompt,
            tools=self._plain.mark(self.tools),
        )

    def _closer(self) -> str:
        """The text the template closes an assistant turn with, after the conversation so
        far: what follows the content in a render (``"<|im_end|>\\n"`` for Qwen2.5)."""
        probe = [*self._history, {"role": "assistant", "content": _SENTINEL}]
        rendered = self._render(probe, add_generation_prompt=False)
        head, found, closer = rendered[len(self._text) :].partition(_SENTINEL)
        if not rendered.startswith(self._text) or not found or head:
            raise DataError(
                f"the chat template of {self.tokenizer.name} does not render an assistant "
                "turn as its generation prompt followed by the assistant's text, so the "
                "model's tokens cannot be kept as sampled; set data.chat_template to a "
                "template that does (qwen3-training for Qwen3; docs/agents.md)"
            )
        return closer

    def _split_turn(self, ids: list[int]) -> tuple[str, str]:
        """A model turn's text and the text of the stop token that ended it ("" if none)."""
        if ids and ids[-1] in self._stop_ids:
            return self.tokenizer.decode(ids[:-1]), self.tokenizer.decode(ids[-1:])
        return self.tokenizer.decode(ids), ""


def _as_message(message: Message) -> dict[str, Any]:
    if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
        raise DataError(f"a message is a dict with a 'role', got {message!r:.80}")
    return _valid_text(dict(message))


def _valid_text(value: Any) -> Any:
    """``value`` with its strings made encodable: a lone surrogate (what a JSON ``"\\ud800"``
    escape the model wrote decodes to; no tokenizer can encode it) becomes U+FFFD, and a
    pair written as two escapes becomes the character it stands for."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return value.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
        return value
    if isinstance(value, Mapping):
        return {key: _valid_text(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_valid_text(item) for item in value]
    return value


class _PlainText:
    """Renders in which only the template's markup is special.

    Before rendering, each special token's text inside a message or tool schema is replaced
    by a marker (``@@<nonce>:<k>@@``: ASCII that ``trim``, ``tojson`` and case filters leave
    alone, with a random nonce text from outside cannot guess). The special tokens left in
    the render are the template's own; :meth:`encode` keeps them as control tokens and
    tokenizes the text between them, markers turned back into the text they stand for,
    with special-token matching off. A render without markers is encoded as it is, so
    benign text gives exactly ``tokenizer.encode(render)``.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._ids = tokenizer.special_token_ids
        self._prefix = f"@@{secrets.randbelow(10**12)}:"
        texts = sorted(self._ids, key=len, reverse=True)  # leftmost-longest, as tokenizers
        self._special = re.compile("|".join(map(re.escape, texts))) if texts else None
        self._marker = {text: f"{self._prefix}{k}@@" for k, text in enumerate(self._ids)}
        self._text_of = {marker: text for text, marker in self._marker.items()}
        self._marked = re.compile(re.escape(self._prefix) + r"\d+@@")

    def mark(self, value: Any) -> Any:
        """``value`` (messages, tools) with special-token text in its strings marked."""
        if self._special is None or value is None:
            return value
        if isinstance(value, str):
            return self._special.sub(lambda m: self._marker[m.group()], value)
        if isinstance(value, Mapping):
            return {key: self.mark(item) for key, item in value.items()}
        if isinstance(value, list | tuple):
            return [self.mark(item) for item in value]
        return value

    def encode(self, rendered: str) -> list[int]:
        """Token ids of a marked render: its special tokens live, marked text plain."""
        if self._special is None or self._prefix not in rendered:
            return self.tokenizer.encode(rendered)
        ids: list[int] = []
        at = 0
        for match in [*self._special.finditer(rendered), None]:
            end = len(rendered) if match is None else match.start()
            if end > at:
                ids += self.tokenizer.encode_plain(self._unmarked(rendered[at:end]))
            if match is not None:
                ids.append(self._ids[match.group()])
                at = match.end()
        return ids

    def _unmarked(self, text: str) -> str:
        return self._marked.sub(lambda m: self._text_of.get(m.group(), m.group()), text)
