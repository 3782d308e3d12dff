"""The calculator demo task: seeded problems, the safe calculator tool, answer parsing, SFT data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from examples.calc import agent, sft, tasks

ROOT = Path(__file__).resolve().parents[1]


def test_generator_is_deterministic_by_seed_and_split():
    assert tasks.generate("train", 50, 7) == tasks.generate("train", 50, 7)
    assert tasks.generate("train", 50, 7) != tasks.generate("train", 50, 8)
    assert tasks.generate("val", 20, 7)[:5] == tasks.generate("val", 5, 7)
    train_questions = {row["question"] for row in tasks.generate("train", 200, 7)}
    val_questions = {row["question"] for row in tasks.generate("val", 200, 7)}
    assert len(train_questions & val_questions) <= 1  # independent streams


def test_problems_are_well_formed_and_answers_match():
    rows = tasks.generate("train", 300, 0)
    assert len({row["id"] for row in rows}) == 300
    assert {row["expression"][len(row["expression"].rstrip("0123456789")) - 1] for row in rows} == {
        "+",
        "-",
        "*",
    }
    for row in rows:
        assert set(row) == {"id", "question", "answer", "expression"}
        assert agent.calculate(row["expression"]) == row["answer"] >= 0
        for operand in row["expression"].replace("+", " ").replace("-", " ").replace("*", " ").split():
            assert 10 <= int(operand) <= 999 and operand in row["question"]


def test_cli_writes_train_and_val_jsonl(tmp_path):
    assert tasks.main(["--out", str(tmp_path), "--train", "12", "--val", "4", "--seed", "3"]) == 0
    train = tasks.read_jsonl(tmp_path / "train.jsonl")
    val = tasks.read_jsonl(tmp_path / "val.jsonl")
    assert train == tasks.generate("train", 12, 3) and val == tasks.generate("val", 4, 3)


@pytest.mark.parametrize(
    ("expression", "value"),
    [("37+58", 95), ("839 - 180", 659), ("(12 - 7) * 3", 15), ("-4 * 2.5", -10.0), ("7 // 2 + 7 % 2", 4)],
)
def test_calculator_evaluates_arithmetic(expression, value):
    assert agent.calculate(expression) == value


@pytest.mark.parametrize(
    "expression",
    [
        "__import__('os').system('true')",
        "x + 1",
        "abs(-3)",
        "(1).__class__",
        "2 ** 100000",
        "'a' * 3",
        "[1, 2]",
        "lambda: 1",
        "1; 2",
        "1 +",
        "1" * 300,
    ],
)
def test_calculator_rejects_anything_but_arithmetic(expression):
    with pytest.raises(agent.CalculatorError):
        agent.calculate(expression)


def test_run_tool_returns_errors_as_text():
    assert agent.run_tool("calculator", json.dumps({"expression": "6*7"})) == "42"
    assert agent.run_tool("calculator", json.dumps({"expression": "9/3"})) == "3"
    assert agent.run_tool("calculator", json.dumps({"expression": "1/0"})).startswith("error:")
    assert agent.run_tool("calculator", "{not json").startswith("error:")
    assert agent.run_tool("calculator", json.dumps({"expr": "1"})).startswith("error:")
    assert agent.run_tool("calculator", json.dumps({"expression": "open('x')"})).startswith("error:")
    assert agent.run_tool("search", "{}").startswith("error: unknown tool")


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("810", 810),
        ("The answer is 1,310.", 1310),
        ("first 12 then 34", 34),
        ("-5", -5),
        ("no number", None),
        ("", None),
        (None, None),
    ],
)
def test_answer_parsing(text, value):
    assert agent.parse_answer(text) == value
    assert agent.score(text, 810) == (1.0 if value == 810 else 0.0)


def test_sft_transcripts_tokenize_like_the_server_prompts():
    from squall.inference.tiny import build_tokenizer

    tok = build_tokenizer(["Tom has 37 apples"], vocab_size=300)
    row = tasks.generate("train", 1, 0)[0]
    messages = sft.transcript(row, __import__("random").Random(0), p_tool=1.0, p_guess_right=0.0)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant"]
    ids, mask = sft.tokenize_transcript(tok, messages)
    assert ids == tok.encode(sft.render(tok, messages, False), add_special_tokens=False)[:-1]  # no final "\n"
    replies = [i for i, m in zip(ids, mask, strict=True) if m]
    text = tok.decode(replies)
    assert text == (
        f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{row["expression"]}"}}}}\n'
        f"</tool_call><|im_end|>{row['answer']}<|im_end|>"
    )
    _, masked = sft.tokenize_transcript(tok, messages, train_decision=False)
    assert sum(mask) - sum(masked) == 1 and masked[mask.index(1)] == 0
    parsed = sft.parse_reply(tok.decode(replies[: replies.index(tok.eos_token_id) + 1]))
    assert parsed["tool_calls"][0]["function"]["arguments"] == json.dumps({"expression": row["expression"]})


def test_shared_prefix_forward_matches_the_plain_forward(tmp_path):
    import random

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from squall.inference.tiny import build_tiny_model

    torch.set_num_threads(1)
    path = build_tiny_model(
        tmp_path / "m", corpus=["Tom has 37 apples"], vocab_size=300, hidden_size=32, seed=0
    )
    tok, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)
    args = __import__("argparse").Namespace(p_copy=0.5, p_tool=0.3, p_guess_right=0.1)
    ids, mask, attention = sft.make_batch(tok, tasks.generate("train", 6, 0), random.Random(0), args)
    assert ids.shape[0] == 6 and mask.sum() > 0 and (attention.sum(1) < ids.shape[1]).any()  # padded rows
    plain = model(input_ids=ids, attention_mask=attention).logits
    shared = sft.forward_shared_prefix(model, ids, attention)
    real = attention.bool()
    assert torch.allclose(plain[real], shared[real], atol=1e-4)


def test_committed_policy_loads_with_the_agreed_template_and_starts_with_a_decision():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from squall.inference.chat_format import CHAT_TEMPLATE

    torch.set_num_threads(1)
    path = ROOT / "examples" / "calc" / "policy"
    tok, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)
    assert tok.chat_template == CHAT_TEMPLATE and tok.eos_token_id == model.config.eos_token_id
    assert (path / "model.safetensors").stat().st_size < 8_000_000
    row = tasks.generate("val", 1, 0)[0]
    prompt = tok.encode(sft.render(tok, sft.first_messages(row["question"]), True), add_special_tokens=False)
    with torch.no_grad():
        probs = torch.softmax(model(torch.tensor([prompt])).logits[0, -1], dim=-1)
    p_tool = probs[tok.convert_tokens_to_ids("<tool_call>")].item()
    p_digit = sum(probs[tok.convert_tokens_to_ids(str(d))].item() for d in range(10))
    assert 0.1 < p_tool < 0.6 and p_tool + p_digit > 0.95  # unreliable tool use, nothing else
