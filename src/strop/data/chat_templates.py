"""Chat templates that replace a checkpoint's own (``data.chat_template``): a jinja file, or
one of the training copies strop ships for templates that cannot render episodes as they
are (docs/agents.md, "Chat templates").

An episode grows token by token, so the chat template must render a conversation as a
prefix of the render of any longer one. Some families' templates do not: Qwen3's rewrites
earlier assistant turns (drops their ``<think>`` blocks, adds an empty one to the last
turn only); Phi-4-mini's ends a finished conversation with ``eos_token``. A training copy
renders the same markup with every assistant turn kept as sampled:

- ``qwen3-training``: Qwen3's template (hybrid thinking, hermes tool calls) with each
  assistant turn rendered as the generation prompt followed by its content as written;
  ``enable_thinking: false`` (``data.chat_template_kwargs``) opens every assistant turn
  with the empty ``<think>`` block Qwen3 writes for a non-thinking turn.
- ``phi4-mini-training``: Phi-4-mini's template without the trailing ``eos_token`` (an
  assistant turn ends with ``<|end|>``, where the model stops).
"""

from __future__ import annotations

from pathlib import Path

from strop.errors import ConfigError

_SHIPPED = Path(__file__).resolve().parent.parent / "assets" / "chat_templates"
BUILTIN_TEMPLATES = ("qwen3-training", "phi4-mini-training")


def read_chat_template(value: str, setting: str = "data.chat_template") -> str:
    """The template text ``value`` names: a built-in training copy (``BUILTIN_TEMPLATES``)
    or a jinja file's path. ConfigError, naming ``setting``, when it is neither."""
    if value in BUILTIN_TEMPLATES:
        path = _SHIPPED / f"{value}.jinja"
        if not path.is_file():
            raise ConfigError(
                f"{setting}={value}: the built-in template {path} is missing; reinstall strop"
            )
    else:
        path = Path(value).expanduser()
        if not path.is_file():
            raise ConfigError(
                f"{setting}={value!r} is neither a jinja file nor a built-in template "
                f"({', '.join(BUILTIN_TEMPLATES)})"
            )
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{setting}={value!r}: cannot read {path} ({e})") from None
