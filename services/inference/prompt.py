"""Chat messages to prompt text with the model's own chat template, whatever the template knows.

`ChatFormat` is built once per tokenizer. It inspects the template (jinja's own parse, not a
text search) and decides:

- native tools: the template reads the `tools` variable, so `tools` is passed to it and the
  template writes them (Qwen2.5/3, Llama 3.x, Hermes, the tiny model);
- fallback: the template never reads `tools` (SmolLM2, many small chat models), so the tools
  are written into the system prompt (`FALLBACK_TOOLS_PROMPT`, an existing system message kept
  after it) and the model is asked to answer with `<tool_call>[...]</tool_call>`, the form
  SmolLM2-Instruct was tuned on. It is logged once per server;
- assistant messages with `tool_calls`: a template that never reads `tool_calls` gets the calls
  written into the message's content in the parser's own format, so the call stays in the
  prompt; a `tool` message becomes a user turn `<tool_response>\\n...\\n</tool_response>` for
  such a template; `content: None` becomes "" for a template that would print "None" or fail;
- the tool-call parser: `inference.tool_parser` when set, else the one the template teaches
  (toolparsers.parser_for_template).

A tokenizer without a chat template cannot serve chat: `render` raises NoChatTemplate, whose
message says how to supply one (`inference.chat_template`) or to use /v1/completions.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from squall.inference.toolparsers import get_parser, parser_for_template

log = logging.getLogger("squall.inference.prompt")

# Laid out as the tool-use system prompt SmolLM2-Instruct was tuned on (APIGen-style data: tools
# in <tools>, calls as a JSON list in <tool_call>), with the example call built from the first
# offered tool: a 135M model copies a placeholder example ("func_name1") word for word.
FALLBACK_TOOLS_PROMPT = (
    "You are an expert in composing functions. You are given a question and a set of possible "
    "functions. Based on the question, you will need to make one or more function/tool calls to "
    "achieve the purpose.\n\n"
    "You have access to the following tools:\n"
    "<tools>{tools}</tools>\n\n"
    "To call tools, reply with a JSON list of calls inside <tool_call></tool_call>, for example:\n"
    "{example}\n"
    "A tool's result comes back inside <tool_response></tool_response>; then answer the question."
)


class NoChatTemplate(ValueError):
    """The model folder has no chat template; the message says what to do."""


def template_variables(template: str) -> set[str]:
    """Names the template reads from its context (jinja's undeclared variables)."""
    from jinja2 import Environment, meta

    try:
        return set(meta.find_undeclared_variables(Environment().parse(template)))
    except Exception:  # an unparseable template fails later with the renderer's own error
        return set()


class ChatFormat:
    """How prompts are rendered for one tokenizer (see the module docstring)."""

    def __init__(self, tokenizer: Any, tool_parser: str = "auto", chat_template: str = "") -> None:
        self.tokenizer = tokenizer
        if chat_template:
            path = Path(chat_template)
            if not path.is_file():
                raise NoChatTemplate(f"inference.chat_template names {path}, which is not a file")
            tokenizer.chat_template = path.read_text()
        template = tokenizer.chat_template
        if isinstance(template, dict):  # named templates: the tool-use one when there is one
            template = template.get("tool_use") or template.get("default") or next(iter(template.values()))
        self.template: str = template or ""
        names = template_variables(self.template)
        self.native_tools = "tools" in names or "xml_tools" in names
        self.native_calls = "tool_calls" in self.template
        self.parser = (
            parser_for_template(self.template, self.native_tools)
            if tool_parser == "auto"
            else get_parser(tool_parser)
        )
        self._told = False

    def describe(self) -> str:
        tools = "native" if self.native_tools else "system-prompt fallback"
        return f"tools={tools} tool_calls={'native' if self.native_calls else 'as text'} parser={self.parser.name}"

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
        """The prompt text, ending with the assistant turn's opening (add_generation_prompt)."""
        if not self.template:
            raise NoChatTemplate(
                "this model folder has no chat template (chat_template.jinja or tokenizer_config.json's "
                "chat_template), so chat messages cannot be rendered: set inference.chat_template to a "
                "Jinja template file, or send raw prompts to /v1/completions"
            )
        messages = self.adapt(messages, tools)
        kwargs = {"tools": tools} if tools and self.native_tools else {}
        return self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, chat_template=self.template, **kwargs
        )

    def adapt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict]:
        """Messages as this template can render them (native ones pass unchanged)."""
        out = [self._message(m) for m in messages]
        if tools and not self.native_tools:
            if not self._told:
                log.warning(
                    "chat template has no tool support: tools go into the system prompt and replies "
                    "are parsed as %s (docs/inference.md)",
                    self.parser.name,
                )
                self._told = True
            listing = json.dumps([t.get("function", t) for t in tools])
            text = FALLBACK_TOOLS_PROMPT.format(tools=listing, example=self.example_call(tools[0]))
            if out and out[0]["role"] == "system":
                out[0] = {**out[0], "content": text + "\n\n" + _text(out[0].get("content"))}
            else:
                out.insert(0, {"role": "system", "content": text})
        return out

    def example_call(self, tool: dict[str, Any]) -> str:
        """A call of `tool` in the parser's format, its required arguments as "..." placeholders."""
        function = tool.get("function", tool)
        params = function.get("parameters") or {}
        names = params.get("required") or list(params.get("properties") or {})[:1]
        call = {"function": {"name": function["name"], "arguments": {name: "..." for name in names}}}
        return self.parser.render_calls([call])

    def _message(self, message: dict[str, Any]) -> dict[str, Any]:
        if self.native_calls:
            return message
        role, content = message["role"], _text(message.get("content"))
        if role == "assistant" and message.get("tool_calls"):
            calls = self.parser.render_calls(message["tool_calls"])
            return {"role": "assistant", "content": f"{content}\n{calls}" if content else calls}
        if role == "tool":
            return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
        return {**message, "content": content}


def _text(content: Any) -> str:
    """Message content as text: None -> "", a list of parts -> their text joined."""
    if content is None:
        return ""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return str(content)
