"""A Hugging Face tokenizer without transformers: ``tokenizers`` for the text <-> ids mapping
and a sandboxed jinja2 environment for chat templates, set up as ``transformers`` sets it up
so that rendered chats are character-for-character the same.

Read from a checkpoint directory: ``tokenizer.json`` (required), ``tokenizer_config.json``
(special tokens, ``chat_template``), ``special_tokens_map.json`` (legacy, fills gaps) and
``chat_template.jinja`` (takes precedence over the config's template, as in transformers).
A run's ``data.chat_template`` replaces the checkpoint's template and its
``data.chat_template_kwargs`` reach every render (:func:`policy_tokenizer`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HfTokenizer

from strop.data.chat_templates import read_chat_template
from strop.errors import DataError, ModelError

if TYPE_CHECKING:
    from strop.config import Config

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
# The named special tokens transformers passes to every chat template (when set).
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)

Message = Mapping[str, Any]


class Tokenizer:
    """Text <-> token ids and chat templates of one checkpoint's tokenizer.

    ``encode`` never adds special tokens; ``special_prefix_ids`` are the ids the tokenizer's
    post-processor would put in front of a single sequence (e.g. Llama's BOS), which the SFT
    tokenization adds to plain-text examples, as ``transformers``' ``encode`` would.
    """

    def __init__(
        self,
        backend: _HfTokenizer,
        special_tokens: Mapping[str, str] | None = None,
        chat_template: str | None = None,
        name: str = "<tokenizer>",
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self._tok = backend
        self.special_tokens: dict[str, str] = dict(special_tokens or {})
        self.chat_template = chat_template
        self.name = name
        self.template_kwargs: dict[str, Any] = dict(template_kwargs or {})

    @classmethod
    def from_pretrained(
        cls,
        directory: str | Path,
        *,
        chat_template: str | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> Tokenizer:
        """Load the tokenizer files of a Hugging Face checkpoint directory; ``chat_template``
        (a jinja file's path or a built-in template's name, :mod:`strop.data.chat_templates`)
        replaces the checkpoint's template, and ``template_kwargs`` reach every render."""
        path = Path(directory)
        if not path.is_dir():
            raise ModelError(f"tokenizer directory {path} does not exist or is not a directory")
        file = path / TOKENIZER_FILE
        if not file.is_file():
            raise ModelError(
                f"{file} not found: strop reads fast tokenizers only; save one with "
                "transformers' tokenizer.save_pretrained(...) into the checkpoint directory"
            )
        try:
            backend = _HfTokenizer.from_file(str(file))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise ModelError(f"cannot read {file}: {e}") from None
        config = _read_json(path / TOKENIZER_CONFIG_FILE)
        legacy = _read_json(path / SPECIAL_TOKENS_MAP_FILE)
        special = {}
        for key in SPECIAL_TOKEN_NAMES:
            value = _token_text(config.get(key))
            value = value if value is not None else _token_text(legacy.get(key))
            if value is not None:
                special[key] = value
        template_file = path / CHAT_TEMPLATE_FILE
        if template_file.is_file():
            template: str | None = template_file.read_text(encoding="utf-8")
        else:
            template = _pick_template(config.get("chat_template"), path / TOKENIZER_CONFIG_FILE)
        if chat_template is not None:
            template = read_chat_template(chat_template)
        return cls(backend, special, template, name=str(path), template_kwargs=template_kwargs)

    def vocabulary(self) -> dict[str, int]:
        """Every token's id, the added (special) tokens included."""
        return self._tok.get_vocab(with_added_tokens=True)

    # -- text <-> ids ------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, no special tokens added (special-token text still maps to
        its id, as in transformers)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_plain(self, text: str) -> list[int]:
        """Token ids of ``text`` with every special token's text (``<|im_end|>``) split as
        ordinary text: text from outside the model (tool output, web pages, a user) can
        never become a control token this way. Non-special added tokens still match."""
        return self._plain_backend.encode(text, add_special_tokens=False).ids

    @cached_property
    def _plain_backend(self) -> _HfTokenizer:
        plain = _HfTokenizer.from_str(self._tok.to_str())
        plain.encode_special_tokens = True
        return plain

    @cached_property
    def special_token_ids(self) -> dict[str, int]:
        """The special (control) tokens' texts and ids: the added tokens marked special,
        which :meth:`encode` matches in text and :meth:`encode_plain` does not."""
        added = self._tok.get_added_tokens_decoder()
        return {token.content: i for i, token in sorted(added.items()) if token.special}

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """``[encode(t) for t in texts]``, computed in parallel by the Rust tokenizer."""
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of token ids."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    @cached_property
    def special_prefix_ids(self) -> list[int]:
        """Ids the post-processor puts before a single sequence (e.g. ``[bos]``), else ``[]``."""
        encoding = self._tok.encode("a", add_special_tokens=True)
        prefix = []
        for token_id, special in zip(encoding.ids, encoding.special_tokens_mask, strict=True):
            if not special:
                break
            prefix.append(token_id)
        return prefix

    # -- special tokens ----------------------------------------------------------------------

    def token_id(self, name: str) -> int | None:
        """Id of the named special token (``"eos_token"``, ...), None if it is not set."""
        text = self.special_tokens.get(name)
        if text is None:
            return None
        token_id = self._tok.token_to_id(text)
        if token_id is None:
            raise ModelError(
                f"{self.name}: {name} {text!r} from tokenizer_config.json is not in the vocabulary"
            )
        return token_id

    @property
    def eos_token_id(self) -> int:
        """Id of the end-of-sequence token; ModelError when the tokenizer defines none."""
        token_id = self.token_id("eos_token")
        if token_id is None:
            raise ModelError(
                f"{self.name}: tokenizer_config.json sets no eos_token; add one "
                '(e.g. "eos_token": "<|endoftext|>") so sequences can end'
            )
        return token_id

    @property
    def pad_token_id(self) -> int:
        """Id used for padding: the pad token, or the EOS token when there is none."""
        token_id = self.token_id("pad_token")
        return self.eos_token_id if token_id is None else token_id

    @property
    def bos_token_id(self) -> int | None:
        """Id of the beginning-of-sequence token, None if the tokenizer has none."""
        return self.token_id("bos_token")

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added (special) tokens included (transformers' ``len(tok)``)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    # -- chat templates ----------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """The chat rendered as text by the tokenizer's chat template (like transformers'
        ``apply_chat_template(..., tokenize=False)``); ``tools`` are JSON-schema dicts
        (``{"type": "function", "function": {...}}``) for templates that render them;
        :attr:`template_kwargs` (``data.chat_template_kwargs``), then ``kwargs``, reach the
        template (as transformers passes its ``**kwargs``: ``enable_thinking=False``)."""
        if self.chat_template is None:
            raise ModelError(
                f"{self.name} has no chat template (no chat_template in tokenizer_config.json "
                "and no chat_template.jinja): chat data needs one; use prompt/completion data "
                "or a tokenizer with a chat template"
            )
        if not messages:
            raise DataError("cannot apply a chat template to an empty conversation")
        # transformers drops None-valued keys (content=None etc.) before rendering.
        chat = [{k: v for k, v in dict(m).items() if v is not None} for m in messages]
        try:
            template = _compile(self.chat_template)
        except jinja2.TemplateSyntaxError as e:
            raise ModelError(f"the chat template of {self.name} does not compile: {e}") from None
        try:
            return template.render(
                messages=chat,
                tools=None if tools is None else [dict(t) for t in tools],
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **{**self.special_tokens, **self.template_kwargs, **kwargs},
            )
        except jinja2.TemplateError as e:
            raise DataError(f"the chat template of {self.name} failed: {e}") from None


def policy_tokenizer(config: Config) -> Tokenizer:
    """The policy's tokenizer: ``model.path``'s, with ``data.chat_template`` in place of its
    template and ``data.chat_template_kwargs`` passed to every render (SFT data, prompts,
    DPO pairs, episodes)."""
    return Tokenizer.from_pretrained(
        config.model.path,
        chat_template=config.data.chat_template,
        template_kwargs=config.data.chat_template_kwargs,
    )


# -- helpers -------------------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ModelError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _token_text(value: Any) -> str | None:
    """A special token from a config: a string, or an AddedToken dict with ``content``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _pick_template(value: Any, source: Path) -> str | None:
    """The default template from a config's ``chat_template``: a string, or a list of
    ``{"name", "template"}`` entries (older multi-template format)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
    raise ModelError(f"{source}: chat_template must be a string or a list with a 'default' entry")


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (assistant-mask markers): renders the body."""

    tags = {"generation"}  # noqa: RUF012 (jinja's API)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


class _TemplateDict:
    """``dict(...)`` inside templates, without exposing the type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace(...)`` that refuses underscore-prefixed attribute names."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # same signature trick as jinja's
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Unlike jinja's own tojson, no HTML escaping (transformers does the same).
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


_TEMPLATES: dict[str, jinja2.Template] = {}


def _compile(source: str) -> jinja2.Template:
    """Compile a chat template in the environment transformers uses (cached per source)."""
    if source not in _TEMPLATES:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[_GenerationTag, jinja2.ext.loopcontrols],
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        env.globals["dict"] = _TemplateDict()
        env.globals["namespace"] = _TemplateNamespace
        _TEMPLATES[source] = env.from_string(source)
    return _TEMPLATES[source]
