"""Real chat templates (the ``chat_template`` strings of the checkpoints' tokenizer_config.json,
one template line per Python line, escaped as in the JSON) and a tiny tokenizer that knows
their special tokens, for tests that must not download anything.

- ``QWEN25_INSTRUCT``: Qwen/Qwen2.5-0.5B-Instruct (the whole Qwen2.5-Instruct family's).
- ``LLAMA31_INSTRUCT``: meta-llama/Llama-3.1-8B-Instruct.
- ``QWEN3``: Qwen/Qwen3-8B (the hybrid-thinking Qwen3 family's, 0.6B to 235B-A22B; the
  Qwen3-*-Thinking-2507 checkpoints differ only in a generation prompt that opens
  ``<think>\\n``).
- ``GEMMA3_IT``: google/gemma-3-1b-it (the Gemma 3 instruction-tuned family's).
- ``MISTRAL_V03_INSTRUCT``: mistralai/Mistral-7B-Instruct-v0.3 (``[TOOL_CALLS]`` calls).
- ``PHI4_MINI_INSTRUCT``: microsoft/Phi-4-mini-instruct.
- ``SMOLLM3``: HuggingFaceTB/SmolLM3-3B (its ``chat_template.jinja``; tools come as the
  ``xml_tools`` / ``python_tools`` template variables, not ``tools=``).
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

QWEN25_INSTRUCT = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n"
    "    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n"
    "    {%- endif %}\n"
    '    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}\n'
    "    {%- for tool in tools %}\n"
    '        {{- "\\n" }}\n'
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    '    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}\n'
    "{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    '    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}\n'
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    '    {%- elif message.role == "assistant" %}\n'
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n"
    "            {{- '\\n' + message.content }}\n"
    "        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n"
    "            {%- endif %}\n"
    '            {{- \'\\n<tool_call>\\n{"name": "\' }}\n'
    "            {{- tool_call.name }}\n"
    '            {{- \'", "arguments": \' }}\n'
    "            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    '    {%- elif message.role == "tool" %}\n'
    '        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}\n'
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    '        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}\n'
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

LLAMA31_INSTRUCT = (
    "{{- bos_token }}\n"
    "{%- if custom_tools is defined %}\n"
    "    {%- set tools = custom_tools %}\n"
    "{%- endif %}\n"
    "{%- if not tools_in_user_message is defined %}\n"
    "    {%- set tools_in_user_message = true %}\n"
    "{%- endif %}\n"
    "{%- if not date_string is defined %}\n"
    '    {%- set date_string = "26 Jul 2024" %}\n'
    "{%- endif %}\n"
    "{%- if not tools is defined %}\n"
    "    {%- set tools = none %}\n"
    "{%- endif %}\n"
    "\n"
    "{#- This block extracts the system message, so we can slot it into the right place. #}\n"
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- set system_message = messages[0]['content']|trim %}\n"
    "    {%- set messages = messages[1:] %}\n"
    "{%- else %}\n"
    '    {%- set system_message = "" %}\n'
    "{%- endif %}\n"
    "\n"
    "{#- System message + builtin tools #}\n"
    '{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}\n'
    "{%- if builtin_tools is defined or tools is not none %}\n"
    '    {{- "Environment: ipython\\n" }}\n'
    "{%- endif %}\n"
    "{%- if builtin_tools is defined %}\n"
    '    {{- "Tools: " + builtin_tools | reject(\'equalto\', \'code_interpreter\') | join(", ") + "\\n\\n"}}\n'
    "{%- endif %}\n"
    '{{- "Cutting Knowledge Date: December 2023\\n" }}\n'
    '{{- "Today Date: " + date_string + "\\n\\n" }}\n'
    "{%- if tools is not none and not tools_in_user_message %}\n"
    '    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}\n'
    '    {{- \'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.\' }}\n'
    '    {{- "Do not use variables.\\n\\n" }}\n'
    "    {%- for t in tools %}\n"
    "        {{- t | tojson(indent=4) }}\n"
    '        {{- "\\n\\n" }}\n'
    "    {%- endfor %}\n"
    "{%- endif %}\n"
    "{{- system_message }}\n"
    '{{- "<|eot_id|>" }}\n'
    "\n"
    "{#- Custom tools are passed in a user message with some extra guidance #}\n"
    "{%- if tools_in_user_message and not tools is none %}\n"
    "    {#- Extract the first user message so we can plug it in here #}\n"
    "    {%- if messages | length != 0 %}\n"
    "        {%- set first_user_message = messages[0]['content']|trim %}\n"
    "        {%- set messages = messages[1:] %}\n"
    "    {%- else %}\n"
    '        {{- raise_exception("Cannot put tools in the first user message when there\'s no first user message!") }}\n'
    "{%- endif %}\n"
    "    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}\n"
    '    {{- "Given the following functions, please respond with a JSON for a function call " }}\n'
    '    {{- "with its proper arguments that best answers the given prompt.\\n\\n" }}\n'
    '    {{- \'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.\' }}\n'
    '    {{- "Do not use variables.\\n\\n" }}\n'
    "    {%- for t in tools %}\n"
    "        {{- t | tojson(indent=4) }}\n"
    '        {{- "\\n\\n" }}\n'
    "    {%- endfor %}\n"
    '    {{- first_user_message + "<|eot_id|>"}}\n'
    "{%- endif %}\n"
    "\n"
    "{%- for message in messages %}\n"
    "    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}\n"
    "        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}\n"
    "    {%- elif 'tool_calls' in message %}\n"
    "        {%- if not message.tool_calls|length == 1 %}\n"
    '            {{- raise_exception("This model only supports single tool-calls at once!") }}\n'
    "        {%- endif %}\n"
    "        {%- set tool_call = message.tool_calls[0].function %}\n"
    "        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}\n"
    "            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}\n"
    '            {{- "<|python_tag|>" + tool_call.name + ".call(" }}\n'
    "            {%- for arg_name, arg_val in tool_call.arguments | items %}\n"
    "                {{- arg_name + '=\"' + arg_val + '\"' }}\n"
    "                {%- if not loop.last %}\n"
    '                    {{- ", " }}\n'
    "                {%- endif %}\n"
    "                {%- endfor %}\n"
    '            {{- ")" }}\n'
    "        {%- else  %}\n"
    "            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}\n"
    "            {{- '{\"name\": \"' + tool_call.name + '\", ' }}\n"
    "            {{- '\"parameters\": ' }}\n"
    "            {{- tool_call.arguments | tojson }}\n"
    '            {{- "}" }}\n'
    "        {%- endif %}\n"
    "        {%- if builtin_tools is defined %}\n"
    "            {#- This means we're in ipython mode #}\n"
    '            {{- "<|eom_id|>" }}\n'
    "        {%- else %}\n"
    '            {{- "<|eot_id|>" }}\n'
    "        {%- endif %}\n"
    '    {%- elif message.role == "tool" or message.role == "ipython" %}\n'
    '        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}\n'
    "        {%- if message.content is mapping or message.content is iterable %}\n"
    "            {{- message.content | tojson }}\n"
    "        {%- else %}\n"
    "            {{- message.content }}\n"
    "        {%- endif %}\n"
    '        {{- "<|eot_id|>" }}\n'
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)

QWEN3 = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0].role == 'system' %}\n"
    "        {{- messages[0].content + '\\n\\n' }}\n"
    "    {%- endif %}\n"
    '    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}\n'
    "    {%- for tool in tools %}\n"
    '        {{- "\\n" }}\n'
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    '    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}\n'
    "{%- else %}\n"
    "    {%- if messages[0].role == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}\n"
    "{%- for message in messages[::-1] %}\n"
    "    {%- set index = (messages|length - 1) - loop.index0 %}\n"
    "    {%- if ns.multi_step_tool and message.role == \"user\" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}\n"
    "        {%- set ns.multi_step_tool = false %}\n"
    "        {%- set ns.last_query_index = index %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- for message in messages %}\n"
    "    {%- if message.content is string %}\n"
    "        {%- set content = message.content %}\n"
    "    {%- else %}\n"
    "        {%- set content = '' %}\n"
    "    {%- endif %}\n"
    '    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}\n'
    "        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}\n"
    '    {%- elif message.role == "assistant" %}\n'
    "        {%- set reasoning_content = '' %}\n"
    "        {%- if message.reasoning_content is string %}\n"
    "            {%- set reasoning_content = message.reasoning_content %}\n"
    "        {%- else %}\n"
    "            {%- if '</think>' in content %}\n"
    "                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}\n"
    "                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}\n"
    "            {%- endif %}\n"
    "        {%- endif %}\n"
    "        {%- if loop.index0 > ns.last_query_index %}\n"
    "            {%- if loop.last or (not loop.last and reasoning_content) %}\n"
    "                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}\n"
    "            {%- else %}\n"
    "                {{- '<|im_start|>' + message.role + '\\n' + content }}\n"
    "            {%- endif %}\n"
    "        {%- else %}\n"
    "            {{- '<|im_start|>' + message.role + '\\n' + content }}\n"
    "        {%- endif %}\n"
    "        {%- if message.tool_calls %}\n"
    "            {%- for tool_call in message.tool_calls %}\n"
    "                {%- if (loop.first and content) or (not loop.first) %}\n"
    "                    {{- '\\n' }}\n"
    "                {%- endif %}\n"
    "                {%- if tool_call.function %}\n"
    "                    {%- set tool_call = tool_call.function %}\n"
    "                {%- endif %}\n"
    '                {{- \'<tool_call>\\n{"name": "\' }}\n'
    "                {{- tool_call.name }}\n"
    '                {{- \'", "arguments": \' }}\n'
    "                {%- if tool_call.arguments is string %}\n"
    "                    {{- tool_call.arguments }}\n"
    "                {%- else %}\n"
    "                    {{- tool_call.arguments | tojson }}\n"
    "                {%- endif %}\n"
    "                {{- '}\\n</tool_call>' }}\n"
    "            {%- endfor %}\n"
    "        {%- endif %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    '    {%- elif message.role == "tool" %}\n'
    '        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}\n'
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    '        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}\n'
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "    {%- if enable_thinking is defined and enable_thinking is false %}\n"
    "        {{- '<think>\\n\\n</think>\\n\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}"
)

GEMMA3_IT = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    '    {%- set first_user_prefix = "" -%}\n'
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    '        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}\n'
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    '        {%- set role = "model" -%}\n'
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    '        {{ raise_exception("Invalid content type") }}\n'
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\\n'}}\n"
    "{%- endif -%}\n"
)

MISTRAL_V03_INSTRUCT = (
    '{%- if messages[0]["role"] == "system" %}\n'
    '    {%- set system_message = messages[0]["content"] %}\n'
    "    {%- set loop_messages = messages[1:] %}\n"
    "{%- else %}\n"
    "    {%- set loop_messages = messages %}\n"
    "{%- endif %}\n"
    "{%- if not tools is defined %}\n"
    "    {%- set tools = none %}\n"
    "{%- endif %}\n"
    '{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}\n'
    "\n"
    "{#- This block checks for alternating user/assistant messages, skipping tool calling messages #}\n"
    "{%- set ns = namespace() %}\n"
    "{%- set ns.index = 0 %}\n"
    "{%- for message in loop_messages %}\n"
    '    {%- if not (message.role == "tool" or message.role == "tool_results" or (message.tool_calls is defined and message.tool_calls is not none)) %}\n'
    '        {%- if (message["role"] == "user") != (ns.index % 2 == 0) %}\n'
    '            {{- raise_exception("After the optional system message, conversation roles must alternate user/assistant/user/assistant/...") }}\n'
    "        {%- endif %}\n"
    "        {%- set ns.index = ns.index + 1 %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "\n"
    "{{- bos_token }}\n"
    "{%- for message in loop_messages %}\n"
    '    {%- if message["role"] == "user" %}\n'
    "        {%- if tools is not none and (message == user_messages[-1]) %}\n"
    '            {{- "[AVAILABLE_TOOLS] [" }}\n'
    "            {%- for tool in tools %}\n"
    "                {%- set tool = tool.function %}\n"
    '                {{- \'{"type": "function", "function": {\' }}\n'
    '                {%- for key, val in tool.items() if key != "return" %}\n'
    "                    {%- if val is string %}\n"
    "                        {{- '\"' + key + '\": \"' + val + '\"' }}\n"
    "                    {%- else %}\n"
    "                        {{- '\"' + key + '\": ' + val|tojson }}\n"
    "                    {%- endif %}\n"
    "                    {%- if not loop.last %}\n"
    '                        {{- ", " }}\n'
    "                    {%- endif %}\n"
    "                {%- endfor %}\n"
    '                {{- "}}" }}\n'
    "                {%- if not loop.last %}\n"
    '                    {{- ", " }}\n'
    "                {%- else %}\n"
    '                    {{- "]" }}\n'
    "                {%- endif %}\n"
    "            {%- endfor %}\n"
    '            {{- "[/AVAILABLE_TOOLS]" }}\n'
    "            {%- endif %}\n"
    "        {%- if loop.last and system_message is defined %}\n"
    '            {{- "[INST] " + system_message + "\\n\\n" + message["content"] + "[/INST]" }}\n'
    "        {%- else %}\n"
    '            {{- "[INST] " + message["content"] + "[/INST]" }}\n'
    "        {%- endif %}\n"
    "    {%- elif message.tool_calls is defined and message.tool_calls is not none %}\n"
    '        {{- "[TOOL_CALLS] [" }}\n'
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- set out = tool_call.function|tojson %}\n"
    "            {{- out[:-1] }}\n"
    "            {%- if not tool_call.id is defined or tool_call.id|length != 9 %}\n"
    '                {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}\n'
    "            {%- endif %}\n"
    "            {{- ', \"id\": \"' + tool_call.id + '\"}' }}\n"
    "            {%- if not loop.last %}\n"
    '                {{- ", " }}\n'
    "            {%- else %}\n"
    '                {{- "]" + eos_token }}\n'
    "            {%- endif %}\n"
    "        {%- endfor %}\n"
    '    {%- elif message["role"] == "assistant" %}\n'
    '        {{- " " + message["content"]|trim + eos_token}}\n'
    '    {%- elif message["role"] == "tool_results" or message["role"] == "tool" %}\n'
    "        {%- if message.content is defined and message.content.content is defined %}\n"
    "            {%- set content = message.content.content %}\n"
    "        {%- else %}\n"
    "            {%- set content = message.content %}\n"
    "        {%- endif %}\n"
    '        {{- \'[TOOL_RESULTS] {"content": \' + content|string + ", " }}\n'
    "        {%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}\n"
    '            {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}\n'
    "        {%- endif %}\n"
    "        {{- '\"call_id\": \"' + message.tool_call_id + '\"}[/TOOL_RESULTS]' }}\n"
    "    {%- else %}\n"
    '        {{- raise_exception("Only user and assistant roles are supported, with the exception of an initial optional system message!") }}\n'
    "    {%- endif %}\n"
    "{%- endfor %}\n"
)

PHI4_MINI_INSTRUCT = "{% for message in messages %}{% if message['role'] == 'system' and 'tools' in message and message['tools'] is not none %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|tool|>' + message['tools'] + '<|/tool|>' + '<|end|>' }}{% else %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% else %}{{ eos_token }}{% endif %}"

SMOLLM3 = (
    "{# ───── defaults ───── #}\n"
    "{%- if enable_thinking is not defined -%}\n"
    "{%- set enable_thinking = true -%}\n"
    "{%- endif -%}\n"
    "\n"
    "{# ───── reasoning mode ───── #}\n"
    "{%- if enable_thinking -%}\n"
    '{%- set reasoning_mode = "/think" -%}\n'
    "{%- else -%}\n"
    '{%- set reasoning_mode = "/no_think" -%}\n'
    "{%- endif -%}\n"
    "\n"
    "{# ───── header (system message) ───── #}\n"
    '{{- "<|im_start|>system\\n" -}}\n'
    "\n"
    '{%- if messages[0].role == "system" -%}\n'
    "{%- set system_message = messages[0].content -%}\n"
    '{%- if "/no_think" in system_message -%}\n'
    '{%- set reasoning_mode = "/no_think" -%}\n'
    '{%- elif "/think" in system_message -%}\n'
    '{%- set reasoning_mode = "/think" -%}\n'
    "{%- endif -%}\n"
    '{%- set custom_instructions = system_message.replace("/no_think", "").replace("/think", "").rstrip() -%}\n'
    "{%- endif -%}\n"
    "\n"
    '{%- if "/system_override" in system_message -%}\n'
    '{{- custom_instructions.replace("/system_override", "").rstrip() -}}\n'
    '{{- "<|im_end|>\\n" -}}\n'
    "{%- else -%}\n"
    '{{- "## Metadata\\n\\n" -}}\n'
    '{{- "Knowledge Cutoff Date: June 2025\\n" -}}\n'
    '{%- set today = strftime_now("%d %B %Y") -%}\n'
    '{{- "Today Date: " ~ today ~ "\\n" -}}\n'
    '{{- "Reasoning Mode: " + reasoning_mode + "\\n\\n" -}}\n'
    "\n"
    '{{- "## Custom Instructions\\n\\n" -}}\n'
    "{%- if custom_instructions -%}\n"
    '{{- custom_instructions + "\\n\\n" -}}\n'
    '{%- elif reasoning_mode == "/think" -%}\n'
    '{{- "You are a helpful AI assistant named SmolLM, trained by Hugging Face. Your role as an assistant involves thoroughly exploring questions through a systematic thinking process before providing the final precise and accurate solutions. This requires engaging in a comprehensive cycle of analysis, summarizing, exploration, reassessment, reflection, backtracking, and iteration to develop well-considered thinking process. Please structure your response into two main sections: Thought and Solution using the specified format: <think> Thought section </think> Solution section. In the Thought section, detail your reasoning process in steps. Each step should include detailed considerations such as analysing questions, summarizing relevant findings, brainstorming new ideas, verifying the accuracy of the current steps, refining any errors, and revisiting previous steps. In the Solution section, based on various attempts, explorations, and reflections from the Thought section, systematically present the final solution that you deem correct. The Solution section should be logical, accurate, and concise and detail necessary steps needed to reach the conclusion.\\n\\n" -}}\n'
    "{%- else -%}\n"
    '{{- "You are a helpful AI assistant named SmolLM, trained by Hugging Face.\\n\\n" -}}\n'
    "{%- endif -%}\n"
    "\n"
    "{%- if xml_tools or python_tools -%}\n"
    '{{- "### Tools\\n\\n" -}}\n'
    "{%- if xml_tools -%}\n"
    '  {%- set ns = namespace(xml_tool_string="You may call one or more functions to assist with the user query.\\nYou are provided with function signatures within <tools></tools> XML tags:\\n\\n<tools>\\n") -%}\n'
    "  {%- for tool in xml_tools[:] -%} {# The slicing makes sure that xml_tools is a list #}\n"
    '    {%- set ns.xml_tool_string = ns.xml_tool_string ~ (tool | string) ~ "\\n" -%}\n'
    "  {%- endfor -%}\n"
    '  {%- set xml_tool_string = ns.xml_tool_string + "</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call>" -%}\n'
    "  {{- xml_tool_string -}}\n"
    "{%- endif -%}\n"
    "{%- if python_tools -%}\n"
    "  {%- set ns = namespace(python_tool_string=\"When you send a message containing Python code between '<code>' and '</code>' tags, it will be executed in a stateful Jupyter notebook environment, and you will then be given the output to continued reasoning in an agentic loop.\\n\\nYou can use the following tools in your python code like regular functions:\\n<tools>\\n\") -%}\n"
    "  {%- for tool in python_tools[:] -%} {# The slicing makes sure that python_tools is a list #}\n"
    '    {%- set ns.python_tool_string = ns.python_tool_string ~ (tool | string) ~ "\\n" -%}\n'
    "  {%- endfor -%}\n"
    '  {%- set python_tool_string = ns.python_tool_string + "</tools>\\n\\nThe state persists between code executions: so variables that you define in one step are still available thereafter." -%}\n'
    "  {{- python_tool_string -}}\n"
    "{%- endif -%}\n"
    '{{- "\\n\\n" -}}\n'
    '{{- "<|im_end|>\\n" -}}\n'
    "{%- endif -%}\n"
    "{%- endif -%}\n"
    "{# ───── main loop ───── #}\n"
    "{%- for message in messages -%}\n"
    '{%- set content = message.content if message.content is string else "" -%}\n'
    '{%- if message.role == "user" -%}\n'
    '    {{ "<|im_start|>" + message.role + "\\n"  + content + "<|im_end|>\\n" }}\n'
    '{%- elif message.role == "assistant" -%}\n'
    "    {% generation %}\n"
    '    {%- if reasoning_mode == "/think" -%}\n'
    '        {{ "<|im_start|>assistant\\n" + content.lstrip("\\n") + "<|im_end|>\\n" }}\n'
    "    {%- else -%}\n"
    '        {{ "<|im_start|>assistant\\n" + "<think>\\n\\n</think>\\n" + content.lstrip("\\n") + "<|im_end|>\\n" }}\n'
    "    {%- endif -%}\n"
    "    {% endgeneration %}\n"
    '{%- elif message.role == "tool" -%}\n'
    '{{ "<|im_start|>" + "user\\n"  + content + "<|im_end|>\\n" }}\n'
    "{%- endif -%}\n"
    "{%- endfor -%}\n"
    "{# ───── generation prompt ───── #}\n"
    "{%- if add_generation_prompt -%}\n"
    '{%- if reasoning_mode == "/think" -%}\n'
    '    {{ "<|im_start|>assistant\\n" }}\n'
    "{%- else -%}\n"
    '    {{ "<|im_start|>assistant\\n" + "<think>\\n\\n</think>\\n"  }}\n'
    "{%- endif -%}\n"
    "{%- endif -%}\n"
)

# Special tokens of the families (added, never split); tool-call and thinking tags are added
# but not special in Qwen2.5 / Qwen3 / SmolLM3 (skip_special_tokens keeps them).
SPECIAL = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
    "<bos>",
    "<eos>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[TOOL_CALLS]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|end|>",
    "<|tool|>",
    "<|/tool|>",
]
NON_SPECIAL = [
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
]

CORPUS = [
    "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
    "# Tools\n\nYou may call one or more functions to assist with the user query.",
    "You are provided with function signatures within XML tags: tools tool_response",
    '{"name": "add", "arguments": {"a": 2, "b": 3}} {"type": "function", "parameters"}',
    "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\nEnvironment: ipython",
    "Given the following functions, please respond with a JSON for a function call.",
    "What is 2 + 3, then times 4? The answer is 20. Let me add the numbers first.",
    "system user assistant description integer object properties required result",
    "<think>\nLet me add 2 and 3 first, then multiply by 4.\n</think>\n\nThe answer is 20.",
    "Knowledge Cutoff Date: June 2025 Reasoning Mode: /think /no_think Custom Instructions",
]

FAMILIES = {
    # name -> (template, bos_token, eos_token)
    "qwen2.5": (QWEN25_INSTRUCT, None, "<|im_end|>"),
    "llama3.1": (LLAMA31_INSTRUCT, "<|begin_of_text|>", "<|eot_id|>"),
    "qwen3": (QWEN3, None, "<|im_end|>"),
    "gemma3": (GEMMA3_IT, "<bos>", "<eos>"),
    "mistral": (MISTRAL_V03_INSTRUCT, "<s>", "</s>"),
    "phi4-mini": (PHI4_MINI_INSTRUCT, "<|endoftext|>", "<|endoftext|>"),
    "smollm3": (SMOLLM3, None, "<|im_end|>"),
}


@cache
def _tokenizer_json(vocab_size: int) -> str:
    from tokenizers import AddedToken

    from strop.io.tiny import train_bpe_tokenizer

    tok = train_bpe_tokenizer(CORPUS * 4, vocab_size, SPECIAL)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in NON_SPECIAL])
    return tok.to_str()


def save_chat_tokenizer(directory: str | Path, family: str, vocab_size: int = 600) -> Path:
    """Write a tiny tokenizer with ``family``'s chat template (``FAMILIES``) into
    ``directory``, loadable by ``strop.data.Tokenizer`` and ``transformers.AutoTokenizer``."""
    template, bos, eos = FAMILIES[family]
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(_tokenizer_json(vocab_size), encoding="utf-8")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": eos,
        "pad_token": "<|endoftext|>",
        "chat_template": template,
    }
    if bos is not None:
        config["bos_token"] = bos
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return directory
