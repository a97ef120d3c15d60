"""Tiny byte-level BPE tokenizers built with ``tokenizers`` for tests (nothing downloaded).

``save_tiny_tokenizer(dir, ...)`` writes ``tokenizer.json`` + ``tokenizer_config.json`` (and
optionally ``chat_template.jinja``) the way a Hugging Face checkpoint carries them, so both
``strop.data.Tokenizer`` and ``transformers.AutoTokenizer`` can load the directory.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

from strop.io.tiny import train_bpe_tokenizer

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>", "<|eot_id|>"]

# Qwen2-Instruct's ChatML template (default system prompt when none is given).
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Multi-line, so trim_blocks / lstrip_blocks matter; uses bos_token, namespace,
# raise_exception, tojson, loop controls and strftime_now.
FANCY_TEMPLATE = """{{ bos_token }}
{%- set ns = namespace(turns=0) %}
{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('unknown role ' + message['role']) }}
    {% endif %}
    {% if message['content'] == 'SKIP' %}{% continue %}{% endif %}
    {% set ns.turns = ns.turns + 1 %}
<|im_start|>{{ message['role'] }} {{ ns.turns }}
{{ message['content'] | trim }}<|eot_id|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant {{ {"year": strftime_now("%Y")[:2], "n": messages | length} | tojson }}
{% endif %}"""

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Question: Natalia sold clips to 48 of her friends in April.",
    "Answer: She sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72",
    "How many hours does it take? It takes 2 + 3 = 5 hours.",
    "You are a helpful assistant. Hello! How can I help you today?",
    "system user assistant Janet’s ducks lay 16 eggs per day.",
]


@cache
def _tokenizer_json(vocab_size: int) -> str:
    return train_bpe_tokenizer(CORPUS * 4, vocab_size, SPECIAL_TOKENS).to_str()


def save_tiny_tokenizer(
    directory: str | Path,
    *,
    chat_template: str | None = CHATML_TEMPLATE,
    template_file: bool = False,
    bos_prefix: bool = False,
    eos_token: str | None = "<|im_end|>",
    pad_token: str | None = "<|endoftext|>",
    vocab_size: int = 400,
) -> Path:
    """Write a tiny tokenizer checkpoint into ``directory``; return the directory.

    ``template_file`` puts the chat template in ``chat_template.jinja`` instead of the config;
    ``bos_prefix`` adds a post-processor that puts ``<s>`` before every sequence (Llama-style).
    """
    from tokenizers import Tokenizer, processors

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_str(_tokenizer_json(vocab_size))
    if bos_prefix:
        bos = tok.token_to_id("<s>")
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
        )
    tok.save(str(directory / "tokenizer.json"))
    config: dict = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>"}
    if eos_token is not None:
        config["eos_token"] = {"__type": "AddedToken", "content": eos_token, "special": True}
    if pad_token is not None:
        config["pad_token"] = pad_token
    if chat_template is not None:
        if template_file:
            (directory / "chat_template.jinja").write_text(chat_template, encoding="utf-8")
        else:
            config["chat_template"] = chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return directory
