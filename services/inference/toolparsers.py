"""Tool-call parsers: how one model family writes a tool call, read back into OpenAI `tool_calls`.

Each parser knows three things about its format: how to find calls in a finished reply
(`parse`), what to prefill so the model must call a tool (`forced_prefix`, for tool_choice
"required" or a named function), and how to write a call back into an assistant message when
the chat template cannot (`render_calls`, used by the tools-in-the-system-prompt fallback,
prompt.py). Known formats, `PARSERS`:

- hermes: `<tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call>`, one block per call
  (Hermes 2/3, Qwen2.5, Qwen3, squall's tiny model). A block holding a JSON *list* of calls is
  read too, which is what SmolLM2 writes.
- smollm2: `<tool_call>[{"name": N, "arguments": {...}}, ...]</tool_call>`: one block holding a
  list (SmolLM2-Instruct, trained on APIGen-style data). Same reading as hermes; its prefill and
  rendering use the list form. The fallback's system prompt asks for this form.
- llama3_json: the whole reply is `{"name": N, "parameters": {...}}` (several joined by `;`),
  optionally after `<|python_tag|>` (Llama 3.1/3.2/3.3 with JSON tool calling).
- json: the whole reply is a JSON object `{"name": N, "arguments"|"parameters": {...}}` or a list
  of them, optionally in a ```json fence (small models asked for plain JSON).

A reply that *looks like* a call in the format (the tag is there, or it opens with `{`/`[`) but
yields none stays content, and `parse` reports it as a failed attempt; the server counts those
(`squall_inference_tool_parse_failures_total`). Arguments are re-serialised with `json.dumps`
defaults, which is how templates render them back.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

TAGGED = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)
PYTHON_TAG = "<|python_tag|>"
FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.S)


@dataclass(frozen=True)
class Parsed:
    """What one reply held: its content (None when empty), its calls, and whether text that
    looked like a call in this format failed to parse (it then stays in the content)."""

    content: str | None
    calls: list[dict[str, Any]]
    failed: bool = False


def openai_call(data: Any, argument_keys: tuple[str, ...] = ("arguments", "parameters")) -> dict | None:
    """An OpenAI tool call from `{"name": ..., "arguments": {...}}`, or None when it is not one."""
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
        return None
    arguments: Any = {}
    for key in argument_keys:
        if key in data:
            arguments = data[key]
            break
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": data["name"], "arguments": json.dumps(arguments)},
    }


def calls_in(data: Any, argument_keys: tuple[str, ...] = ("arguments", "parameters")) -> list[dict] | None:
    """Calls of one JSON value (an object or a list of objects); None when any item is not a call."""
    items = data if isinstance(data, list) else [data]
    calls = [openai_call(item, argument_keys) for item in items]
    if not calls or any(call is None for call in calls):
        return None
    return calls  # type: ignore[return-value]


def _call_json(call: dict[str, Any]) -> dict[str, Any]:
    """{"name", "arguments"} of an OpenAI tool call (arguments parsed when they are JSON text)."""
    function = call.get("function") or call
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    return {"name": function.get("name"), "arguments": arguments}


class Hermes:
    name = "hermes"
    marker = "<tool_call>"

    def parse(self, text: str) -> Parsed:
        calls: list[dict[str, Any]] = []
        kept: list[str] = []
        position, failed = 0, False
        for match in TAGGED.finditer(text):
            try:
                found = calls_in(json.loads(match.group(1)))
            except ValueError:
                found = None
            if not found:
                failed = True
                continue
            kept.append(text[position : match.start()])
            position = match.end()
            calls += found
        kept.append(text[position:])
        content = "".join(kept).strip() if calls else text
        return Parsed(content or None, calls, failed and not calls)

    def forced_prefix(self, choice: str | None) -> str:
        if choice in (None, "auto"):
            return ""
        if choice == "required":
            return "<tool_call>\n"
        # Cut right after the name: BPE pre-tokenizers split there too, so the prompt's tokens
        # are the ones the model would have written itself.
        return '<tool_call>\n{"name": "' + choice

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        return "\n".join(f"<tool_call>\n{json.dumps(_call_json(c))}\n</tool_call>" for c in calls)


class SmolLM2(Hermes):
    name = "smollm2"

    def forced_prefix(self, choice: str | None) -> str:
        if choice in (None, "auto"):
            return ""
        if choice == "required":
            return "<tool_call>["
        return '<tool_call>[{"name": "' + choice

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        return "<tool_call>" + json.dumps([_call_json(c) for c in calls]) + "</tool_call>"


class Llama3Json:
    name = "llama3_json"
    marker = PYTHON_TAG

    def parse(self, text: str) -> Parsed:
        body = text.strip()
        tagged = body.startswith(PYTHON_TAG)
        body = body.removeprefix(PYTHON_TAG).strip()
        if not body.startswith("{"):
            return Parsed(text or None, [], tagged)
        calls: list[dict[str, Any]] = []
        for part in _json_values(body, separator=";"):
            found = calls_in(part, ("parameters", "arguments"))
            if not found:
                return Parsed(text or None, [], True)
            calls += found
        return Parsed(None, calls, not calls)

    def forced_prefix(self, choice: str | None) -> str:
        if choice in (None, "auto"):
            return ""
        return '{"name": "' + ("" if choice == "required" else choice)

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        items = [{"name": c["name"], "parameters": c["arguments"]} for c in map(_call_json, calls)]
        return "; ".join(json.dumps(item) for item in items)


class PlainJson:
    name = "json"
    marker = ""

    def parse(self, text: str) -> Parsed:
        body = text.strip()
        fenced = FENCE.match(body)
        body = fenced.group(1) if fenced else body
        if not body.startswith(("{", "[")):
            return Parsed(text or None, [])
        try:
            found = calls_in(json.loads(body))
        except ValueError:
            found = None
        if not found:
            return Parsed(text or None, [], True)
        return Parsed(None, found)

    def forced_prefix(self, choice: str | None) -> str:
        if choice in (None, "auto"):
            return ""
        return '{"name": "' + ("" if choice == "required" else choice)

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        items = [_call_json(c) for c in calls]
        return json.dumps(items[0] if len(items) == 1 else items)


def _json_values(text: str, separator: str) -> list[Any]:
    """The JSON values of `text`, one after another, optionally separated by `separator`;
    raises nothing: a tail that is not JSON ends the list with a non-call marker (None)."""
    decoder, values, position = json.JSONDecoder(), [], 0
    while position < len(text):
        try:
            value, position = decoder.raw_decode(text, position)
        except ValueError:
            return [*values, None]
        values.append(value)
        rest = text[position:].lstrip()
        if rest.startswith(separator):
            rest = rest[len(separator) :].lstrip()
        position = len(text) - len(rest)
    return values


PARSERS: dict[str, Any] = {p.name: p for p in (Hermes(), SmolLM2(), Llama3Json(), PlainJson())}


def get_parser(name: str) -> Any:
    """The parser called `name`; an unknown name raises ValueError listing the known ones."""
    try:
        return PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool parser {name!r}; known parsers: {', '.join(PARSERS)}") from None


def parser_for_template(template: str, native_tools: bool) -> Any:
    """The format a chat template teaches: `<tool_call>` in it -> hermes; `<|python_tag|>` or a
    `parameters` key -> llama3_json; a template without tool support -> smollm2 (the format the
    fallback's system prompt asks for); a tool-aware template of no known shape -> json."""
    if not native_tools:
        return PARSERS["smollm2"]
    if "<tool_call>" in template:
        return PARSERS["hermes"]
    if PYTHON_TAG in template or '"parameters"' in template:
        return PARSERS["llama3_json"]
    return PARSERS["json"]
