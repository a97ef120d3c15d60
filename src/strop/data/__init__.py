"""The SFT data pipeline: JSONL records -> examples -> token ids and loss masks -> fixed-shape
numpy batches. Backend-neutral: numpy, ``tokenizers`` and jinja2 only.

Typical use::

    tokenizer = policy_tokenizer(cfg)  # model.path's, with data.chat_template(_kwargs)
    examples, stats = load_sft_examples(cfg.data.train_path, cfg.data, tokenizer)
    batcher = SftBatcher(examples, cfg.sft.batch_size, seed=cfg.seed, shuffle=cfg.data.shuffle,
                         pad_id=tokenizer.pad_token_id, pad_to_multiple=cfg.data.pad_to_multiple,
                         max_length=cfg.data.max_length)
    batch = batcher.batch(step)   # the same arrays for the same (seed, step), also on resume
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from strop.config import DataConfig
from strop.data.batching import Batch, SftBatcher
from strop.data.sft import TokenizedExample, TokenizeStats, chat_segments, tokenize_examples
from strop.data.sources import (
    Example,
    ReadStats,
    detect_format,
    read_data_file,
    read_examples,
)
from strop.data.tokenizer import Tokenizer, policy_tokenizer
from strop.errors import DataError

logger = logging.getLogger(__name__)

__all__ = [
    "Batch",
    "DataStats",
    "Example",
    "ReadStats",
    "SftBatcher",
    "TokenizeStats",
    "TokenizedExample",
    "Tokenizer",
    "chat_segments",
    "detect_format",
    "load_sft_examples",
    "make_sft_batcher",
    "policy_tokenizer",
    "read_data_file",
    "read_examples",
    "tokenize_examples",
]


@dataclass(frozen=True)
class DataStats:
    """What loading one data file did: records read, bad lines skipped, examples truncated
    and dropped (no loss token left), examples and tokens kept."""

    path: str
    format: str
    num_records: int
    num_skipped_lines: int
    num_truncated: int
    num_dropped: int
    num_examples: int
    num_tokens: int
    num_loss_tokens: int


def load_sft_examples(
    path: str | Path, data_config: DataConfig, tokenizer: Tokenizer
) -> tuple[list[TokenizedExample], DataStats]:
    """Read a JSONL file and tokenize it for SFT under ``data_config`` (format, truncation,
    max_length, skip_bad_lines, prompt_template). DataError if no example is left."""
    examples, read = read_data_file(path, data_config)
    tokenized, tok = tokenize_examples(
        examples, tokenizer, data_config.max_length, data_config.truncation
    )
    if tok.num_dropped:
        lines = ", ".join(map(str, tok.dropped_lines[:5])) + (
            ", ..." if tok.num_dropped > 5 else ""
        )
        logger.warning(
            "dropped %d example(s) of %s with no completion token left after truncation to "
            "%d tokens (lines %s)",
            tok.num_dropped,
            path,
            data_config.max_length,
            lines,
        )
    if not tokenized:
        raise DataError(
            f"no usable example in {path}: all {tok.num_dropped} lose every completion token "
            f"when truncated to data.max_length={data_config.max_length}; raise max_length or "
            "use data.truncation=left"
        )
    stats = DataStats(
        path=str(path),
        format=read.format,
        num_records=read.num_records,
        num_skipped_lines=read.num_skipped,
        num_truncated=tok.num_truncated,
        num_dropped=tok.num_dropped,
        num_examples=tok.num_examples,
        num_tokens=tok.num_tokens,
        num_loss_tokens=tok.num_loss_tokens,
    )
    return tokenized, stats


def make_sft_batcher(
    examples: list[TokenizedExample],
    data_config: DataConfig,
    tokenizer: Tokenizer,
    batch_size: int,
    seed: int,
) -> SftBatcher:
    """An :class:`SftBatcher` with padding, shuffling and lengths from the config."""
    return SftBatcher(
        examples,
        batch_size,
        seed=seed,
        shuffle=data_config.shuffle,
        pad_id=tokenizer.pad_token_id,
        pad_to_multiple=data_config.pad_to_multiple,
        max_length=data_config.max_length,
    )
