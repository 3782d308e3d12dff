"""The chat format every squall model speaks: its special tokens and its Jinja chat template.

The tiny test models (`tiny.py`), the SFT'd example policies and the inference node's tool-call
parser (`toolcalls.py`) all agree on this one format, so it lives here rather than in any of them.

`CHAT_TEMPLATE`, the Hermes/Qwen format:
- every message is `<|im_start|>{role}\\n{content}<|im_end|>\\n`;
- tools go into the system message (an empty one is made when there is none) as
  `<tools>\\n{one JSON schema per line}\\n</tools>` after the system text and a blank line; an
  OpenAI tool `{"type": "function", "function": {...}}` is listed as its `function` object;
- an assistant tool call is `<tool_call>\\n{"name": NAME, "arguments": ARGS}\\n</tool_call>`, one
  per call, separated by a newline, after the content (if any) and a newline. ARGS is
  `json.dumps(arguments)` (default separators) when arguments is a dict; a string is written
  verbatim, so a string made by `json.dumps` renders the same as its dict (OpenAI clients send
  back the string the server produced; the server re-dumps other strings with
  `squall.inference.toolcalls.normalize_messages`);
- a `tool` message is its own user turn: `<|im_start|>user\\n<tool_response>\\n{content}\\n</tool_response><|im_end|>\\n`;
- `add_generation_prompt` appends `<|im_start|>assistant\\n`.
"""

from __future__ import annotations

# Order fixes the ids: <|endoftext|> = 0 (pad), <|im_start|> = 1, <|im_end|> = 2 (eos), ...
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)
PAD_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"

CHAT_TEMPLATE = (
    "{%- macro render_content(content) -%}"
    "{%- if content is string -%}{{ content }}"
    "{%- elif content is iterable and content is not mapping -%}"
    "{%- for part in content -%}{%- if part.type == 'text' -%}{{ part.text }}{%- endif -%}{%- endfor -%}"
    "{%- elif content is not none -%}{{ content }}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages[0].role == 'system' -%}{{- render_content(messages[0].content) + '\\n\\n' -}}{%- endif -%}"
    "{{- '<tools>' -}}"
    "{%- for tool in tools -%}"
    "{{- '\\n' -}}"
    "{%- if tool.function is defined -%}{{- tool.function | tojson -}}{%- else -%}{{- tool | tojson -}}{%- endif -%}"
    "{%- endfor -%}"
    "{{- '\\n</tools><|im_end|>\\n' -}}"
    "{%- elif messages and messages[0].role == 'system' -%}"
    "{{- '<|im_start|>system\\n' + render_content(messages[0].content) + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'system' and loop.first -%}"
    "{%- elif message.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- set text = render_content(message.content) -%}"
    "{{- text -}}"
    "{%- if message.tool_calls -%}"
    "{%- if text -%}{{- '\\n' -}}{%- endif -%}"
    "{%- for call in message.tool_calls -%}"
    "{%- if call.function is defined -%}{%- set call = call.function -%}{%- endif -%}"
    "{%- if not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tool_call>\\n{\"name\": ' + (call.name | tojson) + ', \"arguments\": ' -}}"
    "{%- if call.arguments is string -%}{{- call.arguments -}}{%- else -%}{{- call.arguments | tojson -}}{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif message.role == 'tool' -%}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + render_content(message.content) + '\\n</tool_response><|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + render_content(message.content) + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
