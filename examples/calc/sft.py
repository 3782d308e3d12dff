"""Warm-start the demo policy: a tiny model that knows the tool format but uses the tool unreliably.

The committed `examples/calc/policy/` was made by two commands (CPU, one thread, seed 0;
bit-for-bit reproducible on the same torch build):

    python -m examples.calc.sft --out runs/sft-stage1                       # build + 2000 steps
    python -m examples.calc.sft --init runs/sft-stage1 --out examples/calc/policy --steps 1000 --lr 1e-3

and `python -m examples.calc.sft --out DIR --evaluate-only --eval 200` re-measures a policy.

1. Build a tiny Qwen2 model from scratch (`squall.inference.tiny.build_tiny_model`: hidden 128,
   4 layers, 4 heads, vocab 512, 1.1 M parameters, 4.5 MB of float32) whose BPE tokenizer is trained on
   the task generator's questions and on chat transcripts rendered with the tokenizer's own chat
   template (the one the inference server uses).
2. Supervised pass (CPU, one thread, seeded) on fresh transcripts of the exact conversation the
   agent (`examples/calc/agent.py`) has with the server, loss on assistant tokens only
   (each assistant turn's tokens through its `<|im_end|>`):
   - with probability `--p-tool` (0.3) the assistant calls `calculator` with the right
     expression, gets the `<tool_response>` with the result and replies with that number;
   - otherwise it replies at once with a guess: right with probability `--p-guess-right`, else
     off by a random amount;
   - in addition a share `--p-copy` (0.8) of the transcripts are tool transcripts whose first
     assistant token is left out of the loss: they teach copying digits into the expression and
     the result into the answer (the slow part to learn) without moving P(tool).
   So the format is learnt but the decision at the first assistant token (`<tool_call>` or a
   digit) is a coin with P(tool) ~ p_tool: the initial reward is about p_tool times the tool
   path's success, and RL mostly has to learn to always call the tool.
   The shared system+tools prefix (~60 tokens) is run once per batch (`forward_shared_prefix`).
3. Check by sampling at temperature 1 (raw logits, like the server's behaviour policy) on
   validation problems with the agent's exact messages, and write the numbers to
   `sft_report.json` in the output folder.

Tokenisation matches inference exactly: every prompt is `encode(render(messages so far) +
generation prompt)` and every reply is `encode(reply text)`, and the script checks that the
training sequence of a transcript is the concatenation of those pieces.

Result
------
Measured on this machine (2 shared CPU cores), seed 0:
- stage 1: 2000 steps x 32 transcripts, 1160 s; loss 0.069. Stage 2: 1000 steps at lr 1e-3,
  770 s; loss 0.060.
- committed policy, 300 validation problems (`--evaluate-only --eval 300`), temperature 1:
  tool-call rate 0.28, reward when it calls the tool 0.92 (expression right 0.94), reward
  without the tool 0.00, overall reward 0.26; ~12 reply tokens per episode.
- with `<tool_call>` prefilled (200 problems): expression right 95.5 %, result copied into the
  answer right 97.4 %, so a policy that always calls the tool scores ~0.93: the RL ceiling.
- smaller models copied digits unreliably: hidden 64/2 layers (800 steps) 0 %, hidden 128/2
  layers (2000 steps) 57 %, hidden 128/4 layers stage 1 only 77 %.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from examples.calc import agent as calc_agent
from examples.calc import tasks
from squall.shared.transformers_compat import cache_arg, returned_cache

TOOL_CALL_RE = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.DOTALL)


# ---------------------------------------------------------------- transcripts
def first_messages(question: str) -> list[dict[str, Any]]:
    """The messages the agent sends on its first call."""
    return [
        {"role": "system", "content": calc_agent.SYSTEM_PROMPT},
        {"role": "user", "content": question},
    ]


def tool_call_message(expression: str, call_id: str = "call_0") -> dict[str, Any]:
    """The assistant message as the agent appends it (OpenAI shape, arguments as a JSON string)."""
    arguments = json.dumps({"expression": expression})
    return {
        "role": "assistant",
        "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": "calculator", "arguments": arguments}}
        ],
    }


def guess(rng: random.Random, answer: int, p_right: float) -> int:
    """A direct answer without the tool: usually wrong by a plausible amount."""
    if rng.random() < p_right:
        return answer
    offset = rng.randint(1, max(9, abs(answer) // 5))
    return answer + offset if rng.random() < 0.5 or answer - offset < 0 else answer - offset


def transcript(row: dict, rng: random.Random, p_tool: float, p_guess_right: float) -> list[dict[str, Any]]:
    messages = first_messages(row["question"])
    if rng.random() < p_tool:
        messages.append(tool_call_message(row["expression"]))
        messages.append({"role": "tool", "tool_call_id": "call_0", "content": str(row["answer"])})
        messages.append({"role": "assistant", "content": str(row["answer"])})
    else:
        messages.append({"role": "assistant", "content": str(guess(rng, row["answer"], p_guess_right))})
    return messages


def render(tokenizer: Any, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(
        messages, tools=calc_agent.TOOLS, tokenize=False, add_generation_prompt=generation_prompt
    )


def tokenize_transcript(
    tokenizer: Any, messages: list[dict[str, Any]], train_decision: bool = True
) -> tuple[list[int], list[int]]:
    """(ids, loss_mask): prompts as the server encodes them, assistant replies (to <|im_end|>) masked in.

    `train_decision=False` leaves the first assistant token (tool call or not) out of the loss.
    """
    ids: list[int] = []
    mask: list[int] = []
    done = ""
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = render(tokenizer, messages[:k], generation_prompt=True)
        full = render(tokenizer, messages[: k + 1], generation_prompt=False)
        assert prompt.startswith(done) and full.startswith(prompt) and full.endswith("\n")
        reply = full[len(prompt) : -1]  # the sampled text ends at <|im_end|>; "\n" opens the next prompt
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
        assert prompt_ids[: len(ids)] == ids, "a later prompt must extend the earlier turns token for token"
        new_prompt = prompt_ids[len(ids) :]
        reply_ids = tokenizer.encode(reply, add_special_tokens=False)
        ids += new_prompt + reply_ids
        reply_mask = [1] * len(reply_ids)
        if not train_decision and not done:
            reply_mask[0] = 0
        mask += [0] * len(new_prompt) + reply_mask
        done = prompt + reply
    return ids, mask


# ---------------------------------------------------------------- model
def build_policy(out: Path, seed: int, hidden: int, layers: int, heads: int, vocab: int) -> Path:
    # The template's output is the same for any tokenizer, so a throwaway one renders the corpus.
    from squall.inference.tiny import build_tiny_model, build_tokenizer, default_corpus

    renderer = build_tokenizer(["x"], vocab_size=300)
    rng = random.Random(f"corpus:{seed}")
    rows = tasks.generate("corpus", 1500, seed)
    corpus = default_corpus(seed, n_problems=50)
    corpus += [row["question"] for row in rows]
    corpus += [render(renderer, transcript(row, rng, 0.5, 0.1), False) for row in rows]
    return build_tiny_model(
        out,
        corpus=corpus,
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        max_position_embeddings=512,
        seed=seed,
    )


def make_batch(tokenizer: Any, rows: list[dict], rng: random.Random, args: argparse.Namespace):
    import torch

    pairs = []
    for row in rows:
        if rng.random() < args.p_copy:  # extra tool transcript teaching the copying, not the decision
            pairs.append(tokenize_transcript(tokenizer, transcript(row, rng, 1.0, 0.0), train_decision=False))
        else:
            pairs.append(
                tokenize_transcript(tokenizer, transcript(row, rng, args.p_tool, args.p_guess_right))
            )
    width = max(len(ids) for ids, _ in pairs)
    pad = tokenizer.pad_token_id
    ids = torch.full((len(pairs), width), pad, dtype=torch.long)  # (B, T)
    mask = torch.zeros((len(pairs), width), dtype=torch.float32)  # (B, T) 1 on trained tokens
    attention = torch.zeros((len(pairs), width), dtype=torch.long)  # (B, T)
    for i, (seq, m) in enumerate(pairs):
        ids[i, : len(seq)] = torch.tensor(seq)
        mask[i, : len(m)] = torch.tensor(m, dtype=torch.float32)
        attention[i, : len(seq)] = 1
    return ids, mask, attention


def forward_shared_prefix(model: Any, ids: Any, attention: Any) -> Any:
    """Logits (B, T, V) for right-padded `ids` (B, T), running the prefix all rows share only once.

    Every transcript opens with the same system message and tool list (~60 tokens, ~40% of the
    tokens), so its keys/values are computed for one row and repeated (the gradient flows
    through the repeat); the rest is run on top of that cache.
    """
    import torch

    same = (ids == ids[:1]).all(dim=0)  # (T,)
    prefix = int(same.long().cumprod(0).sum().item())
    prefix = min(prefix, ids.shape[1] - 1)
    if prefix == 0:
        return model(input_ids=ids, attention_mask=attention).logits
    head = model(input_ids=ids[:1, :prefix], use_cache=True)
    cache = returned_cache(head)
    cache.batch_repeat_interleave(ids.shape[0])
    tail = model(
        input_ids=ids[:, prefix:], attention_mask=attention, use_cache=True, **cache_arg(model, cache)
    )
    return torch.cat([head.logits.expand(ids.shape[0], -1, -1), tail.logits], dim=1)


def train(model: Any, tokenizer: Any, args: argparse.Namespace) -> list[float]:
    import torch

    torch.manual_seed(args.seed)
    rng = random.Random(f"sft:{args.seed}")
    split = "sft-continue" if args.init else "sft"  # a continued pass sees fresh problems
    rows = tasks.generate(split, args.steps * args.batch, args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.98))
    warmup = max(1, args.steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, args.steps - warmup)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    model.train()
    losses = []
    start = time.monotonic()
    for step in range(args.steps):
        batch_rows = rows[step * args.batch : (step + 1) * args.batch]
        ids, mask, attention = make_batch(tokenizer, batch_rows, rng, args)
        logits = forward_shared_prefix(model, ids, attention)  # (B, T, V)
        logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)  # (B, T-1, V) predicts ids[:, 1:]
        token_logp = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)  # (B, T-1)
        target_mask = mask[:, 1:]
        loss = -(token_logp * target_mask).sum() / target_mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        if step % args.log_every == 0 or step == args.steps - 1:
            recent = sum(losses[-args.log_every :]) / len(losses[-args.log_every :])
            print(f"step {step:5d} loss {recent:.4f} {time.monotonic() - start:6.1f}s", flush=True)
    model.eval()
    return losses


# ---------------------------------------------------------------- evaluation
def sample_reply(model: Any, tokenizer: Any, prompt_ids: list[int], gen: Any, max_tokens: int) -> list[int]:
    """Sample at temperature 1 from the raw logits (no top-k/top-p), stopping at eos."""
    import torch

    eos = tokenizer.eos_token_id
    out: list[int] = []
    with torch.no_grad():
        result = model(input_ids=torch.tensor([prompt_ids]), use_cache=True)
        for _ in range(max_tokens):
            probs = torch.softmax(result.logits[0, -1].float(), dim=-1)
            token = int(torch.multinomial(probs, 1, generator=gen))
            out.append(token)
            if token == eos:
                break
            cache = cache_arg(model, returned_cache(result))
            result = model(input_ids=torch.tensor([[token]]), use_cache=True, **cache)
    return out


def parse_reply(text: str) -> dict[str, Any]:
    """Turn sampled text into the assistant message a Hermes-style server would return."""
    text = text.removesuffix(tokenizer_eos())
    calls = []
    for i, raw in enumerate(TOOL_CALL_RE.findall(text)):
        try:
            call = json.loads(raw)
            calls.append(
                {
                    "id": f"call_{i}",
                    "type": "function",
                    "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])},
                }
            )
        except (ValueError, KeyError, TypeError):
            return {"role": "assistant", "content": text}
    if calls:
        content = TOOL_CALL_RE.sub("", text).strip()
        message: dict[str, Any] = {"role": "assistant", "tool_calls": calls}
        if content:
            message["content"] = content
        return message
    return {"role": "assistant", "content": text}


def tokenizer_eos() -> str:
    from squall.inference.chat_format import EOS_TOKEN

    return EOS_TOKEN


def run_episode(model: Any, tokenizer: Any, row: dict, gen: Any) -> dict[str, Any]:
    """The agent's loop with local sampling; returns reward, whether it called the tool, tokens."""
    messages = first_messages(row["question"])
    final, used_tool, tool_ok, tokens = None, False, False, 0
    for _ in range(calc_agent.MAX_TURNS):
        prompt_ids = tokenizer.encode(render(tokenizer, messages, True), add_special_tokens=False)
        reply_ids = sample_reply(model, tokenizer, prompt_ids, gen, calc_agent.MAX_TOKENS)
        tokens += len(reply_ids)
        message = parse_reply(tokenizer.decode(reply_ids))
        if not message.get("tool_calls"):
            final = message.get("content")
            break
        used_tool = True
        messages.append(message)
        for call in message["tool_calls"]:
            result = calc_agent.run_tool(call["function"]["name"], call["function"]["arguments"])
            tool_ok = tool_ok or result == str(row["answer"])
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    return {
        "reward": calc_agent.score(final, row["answer"]),
        "used_tool": used_tool,
        "tool_result_right": tool_ok,
        "tokens": tokens,
    }


def evaluate(model: Any, tokenizer: Any, rows: list[dict], seed: int) -> dict[str, float]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    start = time.monotonic()
    episodes = [run_episode(model, tokenizer, row, gen) for row in rows]
    with_tool = [e for e in episodes if e["used_tool"]]
    without = [e for e in episodes if not e["used_tool"]]

    def mean(xs):
        return round(sum(xs) / len(xs), 4) if xs else float("nan")

    return {
        "problems": len(rows),
        "tool_call_rate": mean([e["used_tool"] for e in episodes]),
        "reward": mean([e["reward"] for e in episodes]),
        "reward_with_tool": mean([e["reward"] for e in with_tool]),
        "tool_expression_right": mean([e["tool_result_right"] for e in with_tool]),
        "reward_without_tool": mean([e["reward"] for e in without]),
        "mean_reply_tokens": mean([e["tokens"] for e in episodes]),
        "seconds": round(time.monotonic() - start, 1),
    }


# ---------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build and warm-start the calculator demo policy.")
    parser.add_argument("--out", default="examples/calc/policy", help="output model directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--steps", type=int, default=2000, help="optimiser steps")
    parser.add_argument("--batch", type=int, default=32, help="transcripts per step")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW, cosine)")
    parser.add_argument("--p-tool", type=float, default=0.3, help="share of transcripts that call the tool")
    parser.add_argument(
        "--p-copy",
        type=float,
        default=0.8,
        help="share of extra tool transcripts whose first token (the decision) is not trained",
    )
    parser.add_argument(
        "--p-guess-right", type=float, default=0.1, help="share of direct guesses that are right"
    )
    parser.add_argument("--eval", type=int, default=100, help="validation problems to sample (0: skip)")
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument(
        "--init",
        metavar="DIR",
        default=None,
        help="continue training the policy in DIR instead of building one",
    )
    parser.add_argument(
        "--evaluate-only", action="store_true", help="only sample-evaluate the model already in --out"
    )
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    out = Path(args.out)
    if args.evaluate_only:
        tokenizer = AutoTokenizer.from_pretrained(out)
        model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        rows = tasks.generate("val", args.eval, args.seed)
        print(json.dumps(evaluate(model, tokenizer, rows, args.seed), indent=2))
        return 0
    if args.init:
        shutil.copytree(args.init, out, dirs_exist_ok=True, ignore=shutil.ignore_patterns("sft_report.json"))
    else:
        build_policy(out, args.seed, args.hidden, args.layers, args.heads, args.vocab)
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    started = time.monotonic()
    losses = train(model, tokenizer, args)
    train_seconds = time.monotonic() - started
    model.save_pretrained(out)
    report: dict[str, Any] = {
        "args": vars(args),
        "parameters": sum(p.numel() for p in model.parameters()),
        "train_seconds": round(train_seconds, 1),
        "final_loss": round(sum(losses[-20:]) / len(losses[-20:]), 4),
    }
    if args.eval:
        report["val"] = evaluate(model, tokenizer, tasks.generate("val", args.eval, args.seed), args.seed)
    (out / "sft_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
