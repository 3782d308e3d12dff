"""Tool-call parsers (services/inference/toolparsers.py) on replies of each model family
(tests/fixtures/toolcalls/*.json; each file says where its strings come from), the parser a
chat template selects, and the system-prompt fallback of prompt.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from squall.inference.http.render import Reply, TokenTexts, chat_message
from squall.inference.prompt import ChatFormat, NoChatTemplate, template_variables
from squall.inference.tiny import CHAT_TEMPLATE
from squall.inference.toolparsers import PARSERS, get_parser, parser_for_template

FIXTURES = Path(__file__).parent / "fixtures" / "toolcalls"
CASES = [
    pytest.param(doc["parser"], case, id=f"{path.stem}-{i}")
    for path in sorted(FIXTURES.glob("*.json"))
    for doc in [json.loads(path.read_text())]
    for i, case in enumerate(doc["cases"])
]
SMOL_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CALC = {"type": "function", "function": {"name": "calculator", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}  # fmt: skip


@pytest.mark.parametrize(("parser", "case"), CASES)
def test_parser_reads_its_familys_replies(parser, case):
    parsed = get_parser(parser).parse(case["text"])
    found = [
        {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
        for c in parsed.calls
    ]
    assert found == case["calls"]
    assert parsed.content == case["content"] and parsed.failed == case["failed"]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in parsed.calls)


def test_every_family_has_fixtures_and_unknown_parser_names_the_known_ones():
    assert {json.loads(p.read_text())["parser"] for p in FIXTURES.glob("*.json")} == set(PARSERS)
    with pytest.raises(ValueError, match="known parsers: hermes, smollm2, llama3_json, json"):
        get_parser("mistral")


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_rendered_calls_parse_back(name):
    parser = PARSERS[name]
    calls = [{"function": {"name": "calculator", "arguments": '{"expression": "1 + 2"}'}}]
    (call,) = parser.parse(parser.render_calls(calls)).calls
    assert call["function"] == {"name": "calculator", "arguments": '{"expression": "1 + 2"}'}


def test_template_selects_the_parser():
    assert parser_for_template(CHAT_TEMPLATE, True).name == "hermes"
    assert parser_for_template("{{ '<|python_tag|>' }}{{ tools }}", True).name == "llama3_json"
    assert parser_for_template("{{ tools }}", True).name == "json"
    assert parser_for_template(SMOL_TEMPLATE, False).name == "smollm2"
    assert "tools" in template_variables(CHAT_TEMPLATE) and "tools" not in template_variables(SMOL_TEMPLATE)


class Tok:
    """Just what ChatFormat needs of a tokenizer: a template and transformers' renderer."""

    def __init__(self, template):
        from tokenizers import Tokenizer, models
        from transformers import PreTrainedTokenizerFast

        self.inner = PreTrainedTokenizerFast(
            tokenizer_object=Tokenizer(models.WordLevel({"a": 0}, unk_token="a"))
        )
        self.chat_template = template

    def apply_chat_template(self, messages, **kwargs):
        return self.inner.apply_chat_template(messages, **kwargs)


def test_fallback_puts_tools_in_the_system_prompt_and_keeps_calls_in_the_prompt():
    chat = ChatFormat(Tok(SMOL_TEMPLATE))
    assert not chat.native_tools and chat.parser.name == "smollm2"
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "calculator", "arguments": '{"expression": "9*8"}'},
    }
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "9*8?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "72"},
    ]
    prompt = chat.render(messages, [CALC])
    system = prompt.split("<|im_end|>")[0]
    assert "<tools>" in system and '"calculator"' in system and system.endswith("Be brief.")
    assert '<tool_call>[{"name": "calculator", "arguments": {"expression": "..."}}]</tool_call>' in system
    assert (
        '<|im_start|>assistant\n<tool_call>[{"name": "calculator", "arguments": {"expression": "9*8"}}]</tool_call><|im_end|>'
        in prompt
    )
    assert "<|im_start|>user\n<tool_response>\n72\n</tool_response><|im_end|>" in prompt
    # Without tools nothing is added, and content None still renders.
    plain = chat.render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}], None)
    assert "<tools>" not in plain and "None" not in plain


def test_no_chat_template_is_a_clear_error():
    with pytest.raises(NoChatTemplate, match="inference.chat_template.*/v1/completions"):
        ChatFormat(Tok(None)).render([{"role": "user", "content": "hi"}], None)


def test_a_tool_text_that_does_not_parse_stays_content_and_is_counted():
    failures = []
    reply = Reply(meta={}, node="n", prompt_ids=[], token_texts=TokenTexts(str), logprobs=False,
                  return_token_ids=False, tool_choice="auto", parser=PARSERS["smollm2"],
                  on_parse_failure=lambda: failures.append(1))  # fmt: skip
    broken = '<tool_call>[{"name": "calculator", "arguments": {"expression": "12 + 30}}}]</tool_call>'
    message, finish = chat_message(reply, broken, "stop")
    assert message["content"] == broken and "tool_calls" not in message and finish == "stop"
    assert failures == [1]
    message, finish = chat_message(reply, "The answer is 42.", "stop")
    assert message["content"] == "The answer is 42." and failures == [1]
