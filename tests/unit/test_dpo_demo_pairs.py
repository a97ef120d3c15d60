"""`strop demo dpo`'s preference pairs from scored samples (:func:`strop.commands.demo_dpo.build_pairs`):
a right response chosen, a wrong one rejected, none where all are right or all wrong, the
draw a pure function of the seed; and what the command refuses before anything loads."""

from __future__ import annotations

import re

import pytest

from strop.commands.demo_dpo import build_pairs, run_dpo_demo
from strop.data.synthetic import write_splits
from strop.errors import ConfigError, DataError

PROMPTS = {
    0: "Question: one?\nAnswer:",
    1: "Question: two?\nAnswer:",
    2: "Question: three?\nAnswer:",
}


def record(index: int, flags: list[bool]) -> dict:
    """``strop eval``'s record of problem ``index``: response ``i`` is ``"right i"`` or
    ``"wrong i"`` as ``flags`` say."""
    texts = [f"{'right' if ok else 'wrong'} {i}" for i, ok in enumerate(flags)]
    return {"index": index, "responses": texts, "correct": flags}


def test_a_right_response_is_chosen_and_a_wrong_one_rejected():
    results = [record(0, [False, True, False, True]), record(2, [True, False, False, False])]
    pairs = build_pairs(results, PROMPTS, seed=0)
    assert [pair["prompt"] for pair in pairs] == [PROMPTS[0], PROMPTS[2]]
    for pair in pairs:
        assert pair["chosen"].startswith("right") and pair["rejected"].startswith("wrong")
    assert pairs[1] == {"prompt": PROMPTS[2], "chosen": "right 0", "rejected": pairs[1]["rejected"]}


def test_no_pair_where_every_response_is_right_or_every_one_wrong():
    results = [record(0, [True, True, True]), record(1, [False, False]), record(2, [True])]
    assert build_pairs(results, PROMPTS, seed=0) == []


def test_the_draw_is_a_function_of_the_seed():
    results = [record(i % 3, [i % 2 == 0, True, False, i % 3 == 0, False, True, False, True])
               for i in range(3)]  # fmt: skip
    first = build_pairs(results, PROMPTS, seed=0)
    assert build_pairs(results, PROMPTS, seed=0) == first
    draws = {tuple((p["chosen"], p["rejected"]) for p in build_pairs(results, PROMPTS, seed=s))
             for s in range(8)}  # fmt: skip
    assert len(draws) > 1  # other seeds draw other responses


def test_mismatched_responses_and_flags_are_refused():
    with pytest.raises(DataError, match="problem 1: 2 responses but 1 correctness flags"):
        build_pairs([{"index": 1, "responses": ["a", "b"], "correct": [True]}], PROMPTS, seed=0)


@pytest.mark.parametrize("key", ["data.train_path", "data.eval_path", "eval.path", "eval.adapter"])
def test_inputs_the_demo_writes_itself_are_refused(key, tmp_path):
    with pytest.raises(ConfigError, match=f"leave {re.escape(key)} unset"):
        run_dpo_demo([f"{key}=x.jsonl", f"run_dir={tmp_path}"])


def test_greedy_sampling_for_the_pairs_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"eval\.temperature=0\.0: strop demo dpo samples"):
        run_dpo_demo(["eval.temperature=0", "eval.num_samples=1", f"run_dir={tmp_path}"])


def test_a_pairs_file_without_pairs_is_refused_before_any_model_loads(tmp_path, monkeypatch):
    """Every sampled problem all right or all wrong leaves an empty pairs file: one line
    saying how to sample more, not a DPO run on nothing (a rerun reuses the file)."""
    write_splits(tmp_path / "data", 0, 4, 4)
    (tmp_path / "data" / "pairs.jsonl").write_text("")
    with pytest.raises(DataError, match=r"no preference pairs: .* delete the file"):
        run_dpo_demo(["backend=torch", f"run_dir={tmp_path}"])


def test_the_word_dpo_picks_the_dpo_demo_wherever_it_stands(capsys):
    """`strop demo backend=torch dpo ...` is `strop demo dpo backend=torch ...`, not a bad
    override of the PPO demo."""
    from strop.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "backend=torch", "dpo", "eval.adapter=somewhere"])
    assert exit_info.value.code == 2
    assert "strop demo dpo writes its own problems" in capsys.readouterr().err
