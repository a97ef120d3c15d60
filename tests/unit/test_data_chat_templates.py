"""Chat templates of the model families (tests/chat_templates.py: Qwen3, Gemma 3, Mistral,
Phi-4-mini, SmolLM3) against transformers' apply_chat_template as the oracle;
``data.chat_template_kwargs`` in every render; ``data.chat_template`` (a file or the built-in
``qwen3-training``); which templates SFT and episodes can use as they are."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from strop.agents.episode import Episode
from strop.config import Config, load_config
from strop.data import Tokenizer, policy_tokenizer
from strop.data.chat_templates import read_chat_template
from strop.data.prompts import prompt_ids
from strop.data.sft import tokenize_examples
from strop.data.sources import Example
from strop.errors import ConfigError, DataError
from strop.rl.run import PpoRun
from strop.run.kinds import run_kind
from strop.run.preflight import preflight
from tests.chat_templates import PHI4_MINI_INSTRUCT, QWEN3, save_chat_tokenizer

transformers = pytest.importorskip("transformers")

SYSTEM = {"role": "system", "content": "Be brief."}
CHAT = [
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "It is 5."},
    {"role": "user", "content": "And times 4?"},
    {"role": "assistant", "content": "The answer is 20."},
]
THOUGHT = "<think>\nLet me add 2 and 3 first, then multiply by 4.\n</think>\n\n"
NO_THOUGHT = "<think>\n\n</think>\n\n"  # Qwen3's empty block of a non-thinking turn
TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
    },
}
NO_THINKING = {"enable_thinking": False}
# (family, template kwargs): the families' modes, as their model cards use them.
MODES = [
    ("qwen2.5", {}),
    ("llama3.1", {}),
    ("qwen3", {}),
    ("qwen3", NO_THINKING),
    ("gemma3", {}),
    ("mistral", {}),
    ("phi4-mini", {}),
    ("smollm3", {}),
    ("smollm3", NO_THINKING),
]


@pytest.fixture(scope="module")
def families(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {name: save_chat_tokenizer(root / name, name) for name in {f for f, _ in MODES}}


def _ids(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text)


@pytest.mark.parametrize(("family", "kwargs"), MODES)
def test_each_family_renders_as_transformers(families, family, kwargs) -> None:
    tok = Tokenizer.from_pretrained(families[family], template_kwargs=kwargs)
    oracle = transformers.AutoTokenizer.from_pretrained(families[family])
    system = [] if family == "gemma3" else [SYSTEM]  # Gemma folds it into the first turn
    for chat in ([*system, *CHAT[:1]], [*system, *CHAT[:2]], [*system, *CHAT], CHAT):
        for generation_prompt in (False, True):
            ours = tok.apply_chat_template(chat, add_generation_prompt=generation_prompt)
            theirs = oracle.apply_chat_template(
                chat, tokenize=False, add_generation_prompt=generation_prompt, **kwargs
            )
            assert ours == theirs, (chat, generation_prompt)


# Which templates render a conversation as a prefix of a longer one's, as they ship: SFT of
# one assistant turn, SFT of several, an episode that grows by a user message.
AS_THEY_ARE = {
    ("qwen2.5", ()): (True, True, True),
    ("llama3.1", ()): (True, True, True),
    ("qwen3", ()): (True, False, False),  # drops earlier turns' <think>, empty one on the last
    ("qwen3", ("enable_thinking",)): (True, False, False),
    ("gemma3", ()): (True, True, True),
    ("mistral", ()): (False, False, False),  # the system message only when a user turn is last
    ("phi4-mini", ()): (True, False, False),  # eos_token after the last message
    ("smollm3", ()): (True, True, True),
    ("smollm3", ("enable_thinking",)): (True, True, True),
}


@pytest.mark.parametrize(("family", "kwargs"), MODES)
def test_which_templates_render_growing_conversations(families, family, kwargs) -> None:
    tok = Tokenizer.from_pretrained(families[family], template_kwargs=kwargs)
    system = [] if family == "gemma3" else [SYSTEM]
    outcomes = []
    for turns in (2, 4):
        example = Example("chat.jsonl", 1, messages=tuple([*system, *CHAT[:turns]]))
        try:
            tokenize_examples([example], tok, 4096)
            outcomes.append(True)
        except DataError as e:
            assert "data.chat_template" in str(e)  # the refusal names the way out
            outcomes.append(False)
    try:
        episode = Episode(tok, [*system, CHAT[0]])
        episode.add_sampled([*_ids(tok, CHAT[1]["content"]), tok.eos_token_id])
        episode.add_messages([CHAT[2]])
        outcomes.append(True)
    except DataError as e:
        assert "data.chat_template" in str(e)
        outcomes.append(False)
    assert tuple(outcomes) == AS_THEY_ARE[family, tuple(kwargs)]


# -- data.chat_template_kwargs ----------------------------------------------------------------


def _config(model: Path, **data) -> Config:
    return Config.model_validate({"model": {"path": str(model)}, "data": data})


def test_chat_template_kwargs_reach_every_render(families) -> None:
    """enable_thinking=false: Qwen3's generation prompt closes an empty <think> block, in the
    prompts, the SFT data and the episodes alike."""
    config = _config(families["qwen3"], chat_template_kwargs=NO_THINKING)
    tok = policy_tokenizer(config)
    oracle = transformers.AutoTokenizer.from_pretrained(families["qwen3"])
    expected = oracle.apply_chat_template(
        CHAT[:1], tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert expected.endswith("<|im_start|>assistant\n" + NO_THOUGHT)
    prompt = Example("p.jsonl", 1, messages=tuple(CHAT[:1]))
    assert prompt_ids(prompt, tok) == _ids(tok, expected)
    [example], _ = tokenize_examples([Example("s.jsonl", 1, messages=tuple(CHAT[:2]))], tok, 512)
    rendered = oracle.apply_chat_template(CHAT[:2], tokenize=False, enable_thinking=False)
    assert example.input_ids.tolist() == _ids(tok, rendered)
    assert NO_THOUGHT in tok.decode(example.input_ids[example.loss_mask == 0])
    assert Episode(tok, CHAT[:1]).ids == _ids(tok, expected)
    # A keyword passed to one render still wins over the config's.
    assert tok.apply_chat_template(CHAT[:1], True, enable_thinking=True).endswith("assistant\n")


@pytest.mark.parametrize("key", ["messages", "add_generation_prompt", "tools"])
def test_chat_template_kwargs_cannot_set_what_strop_passes(key) -> None:
    with pytest.raises(ConfigError, match=rf"data\.chat_template_kwargs.*{key}"):
        load_config(None, [f"data.chat_template_kwargs={{{key}: 1}}"])
    assert load_config(None, ["data.chat_template_kwargs={enable_thinking: false}"]).data


# -- data.chat_template ---------------------------------------------------------------------


def test_chat_template_is_a_file_or_a_built_in(families, tmp_path) -> None:
    file = tmp_path / "mine.jinja"
    file.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}")
    mine = policy_tokenizer(_config(families["qwen3"], chat_template=str(file)))
    assert mine.apply_chat_template(CHAT[:2]) == "[user] What is 2 + 3?\n[assistant] It is 5.\n"
    built_in = policy_tokenizer(_config(families["qwen3"], chat_template="qwen3-training"))
    assert built_in.chat_template == read_chat_template("qwen3-training") != QWEN3
    with pytest.raises(ConfigError, match=r"^data\.chat_template='qwen4-training' is neither"):
        policy_tokenizer(_config(families["qwen3"], chat_template="qwen4-training"))


# -- Qwen3 and its training copy ------------------------------------------------------------


@pytest.mark.parametrize("kwargs", [{}, NO_THINKING], ids=["thinking", "non-thinking"])
def test_qwen3_training_renders_as_qwen3_wherever_qwen3_is_a_prefix(families, kwargs) -> None:
    """Prompts (with and without tools, a system message) and a last assistant turn that
    holds its thinking (none in non-thinking mode), with or without tool calls, render the
    same; only the rewriting of earlier turns is gone."""
    oracle = transformers.AutoTokenizer.from_pretrained(families["qwen3"])
    training = read_chat_template("qwen3-training")
    thought = "" if kwargs else THOUGHT
    answer = {**CHAT[3], "content": thought + "The answer is 20."}
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 2}}}
    calls = [
        {"role": "assistant", "content": thought + text, "tool_calls": [call]}
        for text in ("", "Adding.")
    ]
    for chat in (
        [CHAT[0]],
        [SYSTEM, CHAT[0]],
        [SYSTEM, CHAT[0], answer],
        *([CHAT[0], c] for c in calls),
    ):
        for tools in (None, [TOOL]):
            rendered = [
                oracle.apply_chat_template(
                    chat,
                    tools=tools,
                    chat_template=template,
                    tokenize=False,
                    add_generation_prompt=chat[-1]["role"] == "user",
                    **kwargs,
                )
                for template in (QWEN3, training)
            ]
            assert rendered[0] == rendered[1], (chat, tools)


@pytest.mark.parametrize("kwargs", [{}, NO_THINKING], ids=["thinking", "non-thinking"])
def test_qwen3_episodes_need_the_training_copy_which_keeps_every_turn(families, kwargs) -> None:
    """Qwen3's own template is refused by the episode check; with data.chat_template:
    qwen3-training a tool episode equals a fresh render of its messages at every turn, its
    earlier turns' thinking kept as sampled."""
    qwen3 = Tokenizer.from_pretrained(families["qwen3"], template_kwargs=kwargs)
    with pytest.raises(DataError, match="qwen3-training"):
        episode = Episode(qwen3, CHAT[:1], tools=[TOOL])
        episode.add_sampled([*_ids(qwen3, "It is 5."), qwen3.eos_token_id])
        episode.add_messages([CHAT[2]])
    tok = policy_tokenizer(
        _config(families["qwen3"], chat_template="qwen3-training", chat_template_kwargs=kwargs)
    )
    oracle = transformers.AutoTokenizer.from_pretrained(families["qwen3"])
    thought = "" if kwargs else THOUGHT

    def fresh(messages: list[dict]) -> list[int]:
        return oracle.apply_chat_template(
            messages, tools=[TOOL], chat_template=tok.chat_template, tokenize=True,
            add_generation_prompt=True, return_dict=False, **kwargs,
        )  # fmt: skip

    episode = Episode(tok, CHAT[:1], tools=[TOOL])
    assert episode.ids == fresh(CHAT[:1])
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call>'
    episode.add_sampled([*_ids(tok, thought + call), tok.eos_token_id])
    episode.add_messages([{"role": "tool", "name": "add", "content": "5"}])
    assert episode.ids == fresh(episode.messages)
    episode.add_sampled([*_ids(tok, thought + "It is 5."), tok.eos_token_id])
    episode.add_messages([CHAT[2]])
    assert episode.ids == fresh(episode.messages)
    text = tok.decode(episode.ids)
    turns_and_prompt = 2 if thought else 3  # a non-thinking generation prompt holds one too
    assert text.count(thought or NO_THOUGHT) == turns_and_prompt  # both turns as sampled
    assert text.endswith("<|im_start|>assistant\n" + ("" if thought else NO_THOUGHT))


def test_qwen3_training_sft_trains_on_every_turn_s_thinking(families) -> None:
    """Multi-turn SFT, refused with Qwen3's own template, trains on each assistant turn as
    written, thinking included, with the training copy."""
    chat = (CHAT[0], {**CHAT[1], "content": THOUGHT + "It is 5."}, CHAT[2], CHAT[3])
    example = Example("s.jsonl", 1, messages=chat)
    with pytest.raises(DataError, match="qwen3-training"):
        tokenize_examples([example], Tokenizer.from_pretrained(families["qwen3"]), 512)
    tok = policy_tokenizer(_config(families["qwen3"], chat_template="qwen3-training"))
    [tokenized], _ = tokenize_examples([example], tok, 512)
    trained = tok.decode(tokenized.input_ids[tokenized.loss_mask == 1])
    assert trained == THOUGHT + "It is 5.<|im_end|>\nThe answer is 20.<|im_end|>\n"


def test_phi4_mini_training_grows_where_phi4_mini_cannot(families) -> None:
    """Phi-4-mini's template ends a finished chat with eos_token; its training copy renders
    prompts as it does, and multi-turn SFT and episodes with it."""
    oracle = transformers.AutoTokenizer.from_pretrained(families["phi4-mini"])
    training = read_chat_template("phi4-mini-training")
    for chat in ([SYSTEM, CHAT[0]], [SYSTEM, *CHAT[:3]]):
        prompts = [
            oracle.apply_chat_template(
                chat, chat_template=template, tokenize=False, add_generation_prompt=True
            )
            for template in (PHI4_MINI_INSTRUCT, training)
        ]
        assert prompts[0] == prompts[1]
    tok = policy_tokenizer(_config(families["phi4-mini"], chat_template="phi4-mini-training"))
    example = Example("s.jsonl", 1, messages=(SYSTEM, *CHAT))
    [tokenized], _ = tokenize_examples([example], tok, 512)
    trained = tok.decode(tokenized.input_ids[tokenized.loss_mask == 1])
    assert trained == "It is 5.<|end|>The answer is 20.<|end|>"
    episode = Episode(tok, [SYSTEM, CHAT[0]])
    episode.add_sampled(_ids(tok, "It is 5.<|end|>"))  # stopped on <|end|>, the closer
    episode.add_messages([CHAT[2]])
    assert episode.ids == _ids(tok, tok.apply_chat_template([SYSTEM, *CHAT[:3]], True))


def test_a_ppo_run_renders_its_prompts_with_the_data_settings(families, tmp_path) -> None:
    """The settings reach a job, not only the tokenizer: PpoRun.read's prompts."""
    model = shutil.copytree(families["qwen3"], tmp_path / "model")
    config = transformers.Qwen3Config(
        vocab_size=1024, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8,
    )  # fmt: skip
    config.save_pretrained(model)
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"prompt": CHAT[:1], "answer": "5"}) + "\n")
    settings = [
        f"model.path={model}", f"data.train_path={data}", "data.prompt_key=prompt",
        "data.answer_key=answer", "data.chat_template=qwen3-training",
        "data.chat_template_kwargs={enable_thinking: false}",
    ]  # fmt: skip
    config = load_config(None, settings)
    run = PpoRun.read(config, None, preflight(config, run_kind("ppo")))
    [prompt] = run.train.ids
    assert run.tokenizer.chat_template == read_chat_template("qwen3-training")
    assert run.tokenizer.decode(prompt).endswith("<|im_start|>assistant\n" + NO_THOUGHT)
