"""The offline tiny model: loads with Auto classes, agreed chat template, exact round-trips."""

from __future__ import annotations

import hashlib
import json
import runpy
import sys

import pytest
import torch

from squall.inference.chat_format import CHAT_TEMPLATE, SPECIAL_TOKENS
from squall.inference.tiny import build_tiny_model, build_tokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate arithmetic.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    torch.set_num_threads(1)
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="module")
def tok(tiny_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dir)


def _conversation(arguments):
    return [
        {"role": "system", "content": "Solve it."},
        {"role": "user", "content": "Tom has 37 apples and buys 58 more."},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "95"},
    ]


def test_directory_loads_offline_with_auto_classes(tiny_dir, tok):
    from transformers import AutoModelForCausalLM

    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in tiny_dir.iterdir()}
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, local_files_only=True)
    assert model.config.vocab_size == len(tok) == 512
    assert [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert model.config.eos_token_id == tok.eos_token_id == 2
    assert model.generation_config.eos_token_id == 2
    assert tok.chat_template == CHAT_TEMPLATE
    for special in SPECIAL_TOKENS:  # one id each, also when embedded in text
        assert tok.encode(f"a{special}b", add_special_tokens=False)[1] == tok.convert_tokens_to_ids(special)


def test_template_renders_tools_tool_calls_and_tool_results(tok):
    text = tok.apply_chat_template(
        _conversation({"expression": "37 + 58"}), tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    schema = json.dumps(TOOLS[0]["function"])
    assert text == (
        f"<|im_start|>system\nSolve it.\n\n<tools>\n{schema}\n</tools><|im_end|>\n"
        "<|im_start|>user\nTom has 37 apples and buys 58 more.<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "37 + 58"}}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n95\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    as_string = tok.apply_chat_template(
        _conversation(json.dumps({"expression": "37 + 58"})),
        tools=TOOLS,
        tokenize=False,
        add_generation_prompt=True,
    )
    assert as_string == text


def test_template_plain_chat_and_content_with_tool_call(tok):
    plain = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}], tokenize=False
    )
    assert plain == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n"
    no_system = tok.apply_chat_template([{"role": "user", "content": "hi"}], tools=TOOLS, tokenize=False)
    assert no_system.startswith("<|im_start|>system\n<tools>\n{")
    both = tok.apply_chat_template(
        [
            {
                "role": "assistant",
                "content": "Let me compute.",
                "tool_calls": [
                    {"function": {"name": "calculator", "arguments": {"expression": "1+2"}}},
                    {"function": {"name": "calculator", "arguments": {"expression": "3*4"}}},
                ],
            }
        ],
        tokenize=False,
    )
    assert both == (
        "<|im_start|>assistant\nLet me compute.\n"
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+2"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3*4"}}\n</tool_call><|im_end|>\n'
    )


@pytest.mark.parametrize(
    "text",
    [
        "  hello\n\n  world \t x  ",
        "".join(chr(i) for i in range(32, 127)) + "\n\t\r",
        "Tom has 37 apples and buys 58 more. 37 * 58 = 2146\n",
        '{"name": "calculator", "arguments": {"expression": "(12 - 7) * 3"}}',
        "caf\u00e9 \u4f60\u597d",
    ],
)
def test_decode_encode_round_trips_exactly(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.unk_token_id is None or tok.unk_token_id not in ids or "<|endoftext|>" in text
    assert tok.decode(ids) == text


def test_rendered_chat_round_trips_and_matches_the_raw_tokenizer(tiny_dir, tok):
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    built = build_tokenizer(["Tom has 37 apples"], vocab_size=300)  # other merges, same pipeline type
    text = tok.apply_chat_template(
        _conversation({"expression": "37 + 58"}), tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert raw.encode(text).ids == ids
    assert built.decode(built.encode(text, add_special_tokens=False)) == text
    digits = tok.convert_ids_to_tokens(tok.encode("2146", add_special_tokens=False))
    assert digits == ["2", "1", "4", "6"]


def test_forward_pass_and_generation(tiny_dir, tok):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    ids = torch.tensor([ids if isinstance(ids, list) else ids["input_ids"]])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], 512) and torch.isfinite(logits).all()
    out = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert out.shape[1] <= ids.shape[1] + 5


def test_same_seed_same_files_and_small_vocab_rejected(tmp_path):
    def digest(path):
        return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()

    corpus = ["one two three 123", "four five six 456"]
    a = build_tiny_model(tmp_path / "a", corpus=corpus, vocab_size=300, seed=3)
    b = build_tiny_model(tmp_path / "b", corpus=corpus, vocab_size=300, seed=3)
    c = build_tiny_model(tmp_path / "c", corpus=corpus, vocab_size=300, seed=4)
    assert digest(a) == digest(b) != digest(c)
    assert (a / "tokenizer.json").read_text() == (b / "tokenizer.json").read_text()
    with pytest.raises(ValueError, match="vocab_size"):
        build_tokenizer(corpus, vocab_size=100)


def test_build_script(tmp_path, monkeypatch):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("alpha beta 12\ngamma delta 34\n")
    out = tmp_path / "m"
    argv = ["build_tiny_model.py", "--out", str(out), "--seed", "1", "--corpus", str(corpus)]
    argv += ["--vocab", "300", "--hidden", "32", "--layers", "1"]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path("scripts/build_tiny_model.py", run_name="__main__")
    assert exit_.value.code == 0
    config = json.loads((out / "config.json").read_text())
    assert (
        config["hidden_size"] == 32 and config["num_hidden_layers"] == 1 and 263 < config["vocab_size"] <= 300
    )
