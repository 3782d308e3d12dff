"""Tool calling: checking OpenAI tool schemas, forcing a call, parsing calls out of text.

Other model families' formats, and how the server picks one, are in toolparsers.py and
prompt.py; the functions here speak the default one.

Format (Hermes/Qwen, the one the tiny model's chat template renders; see docs/inference.md):
tools are listed by the chat template in the system message as
`<tools>\\n{one function schema per line}\\n</tools>`, and the model calls a tool by writing

    <tool_call>
    {"name": "NAME", "arguments": {...}}
    </tool_call>

one block per call. The server parses every block whose JSON has a string `name` into an
OpenAI `tool_calls` entry (`arguments` re-serialised with `json.dumps` defaults, which is how
the template renders them back) and answers with finish_reason "tool_calls"; text outside
the blocks is the message content. A block that is not valid JSON stays in the content.

tool_choice: "none" hides the tools from the prompt; "auto" (default) lets the model decide;
"required" and {"type": "function", "function": {"name": N}} make the model call one by
prefilling `<tool_call>\\n` (plus `{"name": "N` for a named function: cut after the name, where
BPE pre-tokenizers split, so the model continues with its own tokens) at the start of the
assistant turn. Those prefilled tokens belong to the prompt: they appear in
`prompt_token_ids`, not in the response's `token_ids`.
"""

from __future__ import annotations

import json
import re
from typing import Any

from .toolparsers import PARSERS

FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class ToolError(ValueError):
    """A tool schema or tool_choice the server cannot use; the message names the problem."""


def validate_tools(tools: Any) -> list[dict[str, Any]]:
    """Check OpenAI `tools`; returns them unchanged or raises ToolError naming the bad entry."""
    if not isinstance(tools, list):
        raise ToolError("tools must be a list of {'type': 'function', 'function': {...}} objects")
    names: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ToolError(f"{where}: must be an object with type 'function'")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise ToolError(f"{where}.function: must be an object with a name and JSON-schema parameters")
        name = function.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.match(name):
            raise ToolError(f"{where}.function.name: must be 1-64 letters, digits, '_' or '-', got {name!r}")
        if name in names:
            raise ToolError(f"{where}.function.name: {name!r} is defined twice")
        names.add(name)
        if "description" in function and not isinstance(function["description"], str):
            raise ToolError(f"{where}.function.description: must be a string")
        params = function.get("parameters")
        if params is not None:
            if not isinstance(params, dict):
                raise ToolError(f"{where}.function.parameters: must be a JSON schema object")
            if params.get("type", "object") != "object":
                raise ToolError(
                    f"{where}.function.parameters.type: must be 'object', got {params.get('type')!r}"
                )
            if "properties" in params and not isinstance(params["properties"], dict):
                raise ToolError(f"{where}.function.parameters.properties: must be an object")
            required = params.get("required", [])
            if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
                raise ToolError(f"{where}.function.parameters.required: must be a list of property names")
    return tools


def resolve_tool_choice(tool_choice: Any, tools: list[dict[str, Any]] | None) -> str | None:
    """Returns None (tools off), "auto", "required", or the name of the function to call."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise ToolError("tool_choice needs tools: the request has none")
        return None
    if tool_choice in (None, "auto"):
        return "auto"
    if tool_choice == "none":
        return None
    if tool_choice == "required":
        return "required"
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        known = [t["function"]["name"] for t in tools]
        if name not in known:
            raise ToolError(
                f"tool_choice names function {name!r}, which is not in tools ({', '.join(known)})"
            )
        return name
    raise ToolError(
        "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}"
    )


def forced_prefix(choice: str | None) -> str:
    """Assistant text prefilled so the model must call a tool, in the Hermes format (the module
    docstring); other formats prefill their own (toolparsers.py)."""
    return PARSERS["hermes"].forced_prefix(choice)


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Split Hermes-format model output into (content, OpenAI tool_calls); content is None when empty."""
    parsed = PARSERS["hermes"].parse(text)
    return parsed.content, parsed.calls


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool-call arguments strings re-serialised with json.dumps defaults, as the model wrote them."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if not calls:
            out.append(message)
            continue
        fixed = []
        for call in calls:
            function = dict(call.get("function") or {})
            arguments = function.get("arguments")
            if isinstance(arguments, str):
                try:
                    function["arguments"] = json.dumps(json.loads(arguments))
                except ValueError:
                    pass
            fixed.append({**call, "function": function})
        out.append({**message, "tool_calls": fixed})
    return out
