"""The shipped tiny-calc model (src/strop/assets/tiny-calc): its tokenizer and chat template
render the calculator's tool conversations in the hermes format, an episode continued token
by token equals a fresh render, and SFT on a demonstration trains on the call and the answer.
No weights are run."""

from __future__ import annotations

import json

import numpy as np

from strop.agents.calculator import calculator_environment
from strop.agents.calculator_tasks import demonstration, make_calc_problems
from strop.agents.episode import Episode
from strop.agents.tool_calls import ToolCall, detect_format, parse_tool_calls
from strop.assets import tiny_calc_path
from strop.data import Example, Tokenizer, tokenize_examples

ALWAYS = {"careful": 1.0, "casual": 1.0}


def _setup():
    path = tiny_calc_path()
    tok = Tokenizer.from_pretrained(path)
    problem = make_calc_problems(1, 0)[0]
    record = demonstration(problem, np.random.default_rng(0), ALWAYS)
    return path, tok, problem, record


def test_the_asset_loads_and_its_template_renders_hermes_tool_calls() -> None:
    path, tok, problem, record = _setup()
    config = json.loads((path / "config.json").read_text())
    assert config["vocab_size"] == tok.vocab_size and config["eos_token_id"] == tok.eos_token_id
    assert (path / "model.safetensors").stat().st_size < 5e6 and (path / "README.md").is_file()
    assert detect_format(tok.chat_template) == "hermes"
    text = tok.apply_chat_template(record["messages"], tools=record["tools"])
    assert "calculate(expression): Evaluate an arithmetic expression." in text
    turn = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    assert parse_tool_calls(turn, "hermes").calls == [
        ToolCall("calculate", {"expression": problem.expression})
    ]
    assert f"<|im_start|>tool\n{problem.value}<|im_end|>" in text
    for whole in ("<tool_call>", "</tool_call>"):
        assert len(tok.encode(whole)) == 1  # one token each, as in Qwen2.5


def test_an_episode_equals_a_fresh_render_and_sft_trains_on_call_and_answer() -> None:
    _, tok, problem, record = _setup()
    env = calculator_environment()
    episode = Episode(tok, env.reset(problem.to_record()), env.tool_schemas)
    call = record["messages"][2]["tool_calls"][0]["function"]
    call_text = f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
    sampled = [*tok.encode(call_text), tok.eos_token_id]
    episode.add_sampled(sampled, [-0.5] * len(sampled))
    episode.add_messages([{"role": "tool", "name": "calculate", "content": str(problem.value)}])
    fresh = tok.apply_chat_template(episode.messages, True, env.tool_schemas)
    assert episode.ids == tok.encode(fresh)
    chat = Example("sft.jsonl", 1, messages=tuple(record["messages"]), tools=tuple(record["tools"]))
    [example], _ = tokenize_examples([chat], tok, max_length=256)
    mask = np.concatenate([[0], example.loss_mask, [0]]).astype(int)
    starts, ends = np.flatnonzero(np.diff(mask) == 1), np.flatnonzero(np.diff(mask) == -1)
    runs = [tok.decode(example.input_ids[s:e]) for s, e in zip(starts, ends, strict=True)]
    assert runs == [call_text + "<|im_end|>\n", f"#### {problem.value}<|im_end|>\n"]
