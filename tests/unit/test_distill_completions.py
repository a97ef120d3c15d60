"""GKD's off-policy iterations (``distill.lmbda`` < 1): which iterations take the records'
completions, and the completions as a rollout engine answers with them."""

from __future__ import annotations

import numpy as np
import pytest

from strop.assets import tiny_math_path
from strop.config import load_config
from strop.data import Tokenizer
from strop.data.prompts import prompt_ids
from strop.data.sft import completion_ids
from strop.data.sources import Example
from strop.distill.completions import RecordCompletions, use_records
from strop.errors import ConfigError, DataError
from strop.generation import SamplingParams
from strop.rl.prompts import PromptSet


def test_the_records_take_a_seeded_share_of_one_minus_lmbda_of_the_iterations():
    draws = [use_records(3, step, 0.25) for step in range(2000)]
    assert abs(np.mean(draws) - 0.75) < 0.03
    assert draws == [use_records(3, step, 0.25) for step in range(2000)]  # a resume's too
    assert not any(use_records(3, step, 1.0) for step in range(100))


def test_a_records_completion_answers_its_prompt_as_sft_tokenizes_it():
    tokenizer = Tokenizer.from_pretrained(tiny_math_path())
    solved = Example(
        "t.jsonl", 1, prompt="Question: 2 + 3?\nAnswer:", completion=" 2 + 3 = 5\n#### 5"
    )
    bare = Example("t.jsonl", 2, prompt="Question: 1 + 1?\nAnswer:")  # no completion
    prompts = PromptSet(
        ids=[prompt_ids(e, tokenizer) for e in (solved, bare)], golds=["5", "2"],
        texts=["", ""], examples=[solved, bare],
    )  # fmt: skip
    want = [*tokenizer.encode(solved.completion), tokenizer.eos_token_id]
    assert completion_ids(solved, tokenizer, prompts.ids[0]) == want
    assert completion_ids(bare, tokenizer, prompts.ids[1]) is None
    engine = RecordCompletions.of(prompts, tokenizer, "t.jsonl")
    params = SamplingParams(max_new_tokens=4, temperature=1.0)
    out = engine.generate(prompts.ids, params, seed=0, eos_ids=[tokenizer.eos_token_id], pad_id=0)
    assert out.tokens[0].tolist() == want[:4] and out.lengths.tolist() == [4, 0]
    assert out.finish_reasons == ["length", "length"] and not out.logprobs.any()
    whole = engine.generate(prompts.ids[:1], SamplingParams(max_new_tokens=64, temperature=1.0),
                            seed=0, eos_ids=[tokenizer.eos_token_id], pad_id=0)  # fmt: skip
    assert whole.tokens[0, : whole.lengths[0]].tolist() == want and whole.finish_reasons == ["stop"]
    with pytest.raises(DataError, match=r"^t\.jsonl: no record has a completion"):
        RecordCompletions.of(
            PromptSet([prompts.ids[1]], ["2"], [""], examples=[bare]), tokenizer, "t.jsonl"
        )


def test_lmbda_is_the_jsds_alone():
    with pytest.raises(ConfigError, match=r"distill\.lmbda=0\.5 trains some iterations"):
        load_config(None, ["distill.lmbda=0.5"])  # reverse_kl
    load_config(None, ["distill.lmbda=0.5", "distill.loss=jsd"])
