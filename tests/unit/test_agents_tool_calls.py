"""Reading tool calls from generated text (strop.agents.tool_calls): Qwen2.5's hermes tags
and Llama 3.1's JSON message, several calls, text around them, every malformed call as a
parse error in its place, and a round trip through a chat template rendered by
strop.data.tokenizer."""

from __future__ import annotations

import json

import pytest

from strop.agents.tool_calls import (
    ParsedMessage,
    ToolCall,
    ToolCallError,
    detect_format,
    format_name,
    parse_tool_calls,
)
from strop.data.tokenizer import Tokenizer
from strop.errors import ConfigError
from tests.tiny_tokenizer import save_tiny_tokenizer

# The assistant turns of Qwen2.5-Instruct's and Llama 3.1-Instruct's chat templates, written
# here in short: they render a tool call character for character as the models' templates do.
QWEN_TOOL_TURNS = (
    "{% for message in messages %}"
    "{% if message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant' }}{% if message.content %}{{- '\\n' + message.content }}"
    "{% endif %}{% for tool_call in message.tool_calls %}"
    "{% if tool_call.function is defined %}{% set tool_call = tool_call.function %}{% endif %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' }}{{- tool_call.name }}{{- \'", "arguments": \' }}'
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{% endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{% else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{% endif %}"
)
LLAMA_TOOL_TURNS = (
    "{% for message in messages %}"
    "{% if 'tool_calls' in message %}{% set tool_call = message.tool_calls[0].function %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}"
    "{{- '{\"name\": \"' + tool_call.name + '\", ' }}{{- '\"parameters\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}' }}{{- '<|eot_id|>' }}"
    "{% else %}{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' }}"
    "{{- message.content | trim + '<|eot_id|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

QWEN_TWO = (
    "I will compute both.\n<tool_call>\n"
    '{"name": "calculate", "arguments": {"expression": "2+2"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "search", "arguments": {"query": "π", "limit": 3}}\n</tool_call>'
)


def test_hermes_several_calls_and_text_around_them():
    parsed = parse_tool_calls(QWEN_TWO + "\nthen more", "qwen")
    assert parsed.content == "I will compute both.\nthen more"
    assert parsed.tool_calls == [
        ToolCall("calculate", {"expression": "2+2"}),
        ToolCall("search", {"query": "π", "limit": 3}),
    ]
    assert parsed.errors == []
    assert parsed.as_message()["tool_calls"][1] == {
        "type": "function",
        "function": {"name": "search", "arguments": {"query": "π", "limit": 3}},
    }


def test_hermes_without_calls_and_with_an_unclosed_last_call():
    assert parse_tool_calls("  The answer is 4.  ") == ParsedMessage("The answer is 4.")
    assert parse_tool_calls("x" * 3, "hermes").as_message() == {
        "role": "assistant",
        "content": "xxx",
    }
    cut = parse_tool_calls('<tool_call>\n{"name": "f", "arguments": {}}')
    assert cut.tool_calls == [ToolCall("f", {})]


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ('{"name": "f", "arguments": {"x": 1}', "not valid JSON"),
        ("", "not valid JSON"),
        ('{"arguments": {"x": 1}}', 'no "name"'),
        ('{"name": "", "arguments": {}}', 'no "name"'),
        ('{"name": "f", "arguments": [1, 2]}', '"arguments" of the call to f must be a JSON obj'),
        ('{"name": "f", "arguments": "oops"}', '"arguments" of the call to f must be a JSON obj'),
        ("[1, 2]", "must be a JSON object with a name, got list"),
    ],
)
def test_hermes_malformed_calls_are_reported_in_place(body, says):
    text = (
        f'<tool_call>\n{{"name": "a", "arguments": {{}}}}\n</tool_call>'
        f"<tool_call>\n{body}\n</tool_call>"
        f'<tool_call>{{"name": "b", "arguments": "{{\\"y\\": 2}}"}}</tool_call>'
    )
    calls = parse_tool_calls(text).calls
    assert calls[0] == ToolCall("a", {})
    assert isinstance(calls[1], ToolCallError) and says in calls[1].message
    assert calls[2] == ToolCall("b", {"y": 2})  # stringified arguments are read too


def test_llama3_json_message_with_and_without_python_tag():
    plain = parse_tool_calls(
        '{"name": "calculate", "parameters": {"expression": "1+1"}}', "llama3_json"
    )
    assert plain == ParsedMessage("", [ToolCall("calculate", {"expression": "1+1"})])
    tagged = parse_tool_calls(
        'Let me check.<|python_tag|>{"name": "f", "arguments": {"a": 1}}; {"name": "g", '
        '"parameters": {}}',
        "llama3_json",
    )
    assert tagged.content == "Let me check."
    assert tagged.tool_calls == [ToolCall("f", {"a": 1}), ToolCall("g", {})]
    prose = parse_tool_calls("The answer is {x}.", "llama3_json")
    assert prose == ParsedMessage("The answer is {x}.")
    after = parse_tool_calls('{"name": "f", "parameters": {}} and some words', "llama3_json")
    assert after.tool_calls == [ToolCall("f", {})] and after.content == "and some words"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ('{"name": "f", "parameters": {"a": 1}', "not valid JSON"),
        ('<|python_tag|>{"name": "f", ', "not valid JSON"),
        ('{"parameters": {"a": 1}}', 'no "name"'),
        ('{"name": "f", "parameters": 3}', '"parameters" of the call to f must be a JSON object'),
    ],
)
def test_llama3_json_malformed_calls(text, says):
    parsed = parse_tool_calls(text, "llama3_json")
    assert parsed.tool_calls == [] and len(parsed.errors) == 1
    assert says in parsed.errors[0].message


def test_format_names_and_detection():
    assert format_name("Qwen") == "hermes" and format_name("llama3_json") == "llama3_json"
    with pytest.raises(ConfigError, match="unknown tool-call format 'xml'"):
        format_name("xml")
    with pytest.raises(ConfigError):
        parse_tool_calls("text", "xml")
    assert detect_format(QWEN_TOOL_TURNS) == "hermes"
    assert detect_format(LLAMA_TOOL_TURNS) == "llama3_json"
    assert detect_format("{{ '<|python_tag|>' }}") == "llama3_json"
    assert detect_format("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    assert detect_format(None) is None


@pytest.mark.parametrize(
    ("template", "fmt", "end", "calls"),
    [
        (
            QWEN_TOOL_TURNS,
            "hermes",
            "<|im_end|>\n",
            [("calculate", {"expression": "(3 + 4) * 12"}), ("search", {"query": "π ü"})],
        ),
        (LLAMA_TOOL_TURNS, "llama3_json", "<|eot_id|>", [("calculate", {"expression": "7//2"})]),
    ],
)
def test_render_then_parse_round_trip(tmp_path, template, fmt, end, calls):
    """What the template renders for an assistant turn with tool calls parses back to the
    same calls (the generated part: after the generation prompt, before the end token)."""
    tokenizer = Tokenizer.from_pretrained(save_tiny_tokenizer(tmp_path, chat_template=template))
    content = "Let me use the tools." if fmt == "hermes" else ""
    assistant = {
        "role": "assistant",
        "content": content,
        "tool_calls": [ToolCall(n, a).as_dict() for n, a in calls],
    }
    user = [{"role": "user", "content": "Compute."}]
    prompt = tokenizer.apply_chat_template(user, add_generation_prompt=True)
    full = tokenizer.apply_chat_template([*user, assistant])
    assert full.startswith(prompt) and full.endswith(end)
    generated = full[len(prompt) : -len(end)]
    parsed = parse_tool_calls(generated, fmt)
    assert parsed.errors == []
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == calls
    assert parsed.content == content


@pytest.mark.parametrize(
    ("text", "fmt"),
    [
        ("<tool_call>" + "[" * 3000 + "</tool_call>", "hermes"),
        ('<tool_call>{"name": "f", "arguments": ' + "[" * 3000 + "</tool_call>", "hermes"),
        ("<|python_tag|>" + "[" * 3000, "llama3_json"),
        ('{"name": "f", "parameters": ' + '{"a": ' * 3000, "llama3_json"),
    ],
    ids=["hermes-list", "hermes-arguments", "llama3-list", "llama3-object"],
)
def test_deeply_nested_json_is_a_parse_error_not_a_recursion_error(text, fmt):
    (error,) = parse_tool_calls(text, fmt).calls
    assert isinstance(error, ToolCallError) and "nested too deeply" in error.message


def test_a_closing_tag_inside_an_argument_string_is_part_of_the_argument():
    code = "print('</tool_call>')"
    call = json.dumps({"name": "python", "arguments": {"code": code}})
    text = f"Let me run it.\n<tool_call>\n{call}\n</tool_call>\n<tool_call>\n{call}\n</tool_call>"
    parsed = parse_tool_calls(text, "hermes")
    assert parsed.content == "Let me run it."
    assert parsed.calls == [ToolCall("python", {"code": code})] * 2
    # Unclosed at the end (generation stopped there), and text after a closed one.
    parsed = parse_tool_calls(f"<tool_call>\n{call}", "hermes")
    assert parsed.calls == [ToolCall("python", {"code": code})]
    # JSON that does not end at a closing tag is read up to the next one, as before.
    plain = '{"name": "f", "arguments": {}}'
    parsed = parse_tool_calls(f"<tool_call>{plain} and more</tool_call>done", "hermes")
    assert isinstance(parsed.calls[0], ToolCallError) and parsed.content == "done"


# -- mistral: [TOOL_CALLS] followed by a JSON list (Mistral 7B v0.3, Ministral, Mistral Small)

MISTRAL_TWO = (
    '[TOOL_CALLS] [{"name": "calculate", "arguments": {"expression": "2+2"}, "id": "a1b2c3d4e"}'
    ', {"name": "search", "arguments": {"query": "π", "limit": 3}, "id": "f5g6h7i8j"}]'
)


def test_mistral_calls_and_the_text_before_them():
    parsed = parse_tool_calls("I will compute both. " + MISTRAL_TWO, "mistral")
    assert parsed.content == "I will compute both."
    assert parsed.tool_calls == [
        ToolCall("calculate", {"expression": "2+2"}),
        ToolCall("search", {"query": "π", "limit": 3}),
    ]
    assert parse_tool_calls("The answer is [4].", "mistral") == ParsedMessage("The answer is [4].")
    # One object instead of a list, stringified arguments, and the newer name[ARGS]{...}
    # form (Mistral Small 3.2, Magistral) are read too.
    single = parse_tool_calls('[TOOL_CALLS]{"name": "f", "arguments": "{\\"x\\": 1}"}', "mistral")
    assert single.tool_calls == [ToolCall("f", {"x": 1})]
    newer = parse_tool_calls('[TOOL_CALLS]f[ARGS]{"x": 1}[TOOL_CALLS]g[ARGS]{}', "mistral")
    assert newer.tool_calls == [ToolCall("f", {"x": 1}), ToolCall("g", {})]


@pytest.mark.parametrize(
    ("text", "says", "good"),
    [
        ('[TOOL_CALLS] [{"name": "f", "arguments": {"x": 1}', "not valid JSON", 0),
        ("[TOOL_CALLS] the weather in Paris", "not valid JSON", 0),
        ('[TOOL_CALLS] [{"arguments": {}}, {"name": "g", "arguments": {}}]', 'no "name"', 1),
        ('[TOOL_CALLS] [{"name": "f", "arguments": [1]}, 7]', "must be a JSON object", 0),
        ("[TOOL_CALLS] [" + "[" * 3000, "nested too deeply", 0),
        ('[TOOL_CALLS]f[ARGS]{"x": ', "not valid JSON", 0),
        ("[TOOL_CALLS][ARGS]{}", 'no "name"', 0),
    ],
    ids=["unclosed", "prose", "no-name", "not-objects", "deep", "args-unclosed", "args-no-name"],
)
def test_mistral_malformed_calls_are_errors_in_their_place(text, says, good):
    parsed = parse_tool_calls(text, "mistral")
    assert parsed.errors and says in parsed.errors[0].message
    assert len(parsed.tool_calls) == good


def test_mistral_format_name_and_detection():
    from tests.chat_templates import MISTRAL_V03_INSTRUCT

    assert format_name("Mistral") == "mistral"
    assert detect_format(MISTRAL_V03_INSTRUCT) == "mistral"


def test_mistral_render_then_parse_round_trip(tmp_path):
    """Mistral v0.3's template renders an assistant turn's calls as the list it parses."""
    from tests.chat_templates import save_chat_tokenizer

    tokenizer = Tokenizer.from_pretrained(save_chat_tokenizer(tmp_path, "mistral"))
    calls = [("calculate", {"expression": "(3 + 4) * 12"}), ("search", {"query": "π ü"})]
    assistant = {
        "role": "assistant",
        "tool_calls": [
            {**ToolCall(n, a).as_dict(), "id": f"call{k:05d}"} for k, (n, a) in enumerate(calls)
        ],
    }
    user = [{"role": "user", "content": "Compute."}]
    prompt = tokenizer.apply_chat_template(user, add_generation_prompt=True)
    full = tokenizer.apply_chat_template([*user, assistant])
    assert full.startswith(prompt) and full.endswith("</s>")
    parsed = parse_tool_calls(full[len(prompt) : -len("</s>")], "mistral")
    assert parsed.errors == [] and parsed.content == ""
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == calls
