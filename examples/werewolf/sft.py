"""Warm-start the Werewolf policy: a tiny model that knows how to vote but ignores its clue.

The committed `examples/werewolf/policy/` was made by one command (CPU, one thread, seed 0):

    python -m examples.werewolf.sft --out examples/werewolf/policy

and `python -m examples.werewolf.sft --out DIR --evaluate-only --eval 300` re-measures a policy.

1. Start from the calculator demo's policy (`examples/calc/policy`: 1.1 M parameters, its
   tokenizer and chat template), which already copies digits from a prompt into its reply.
   `--init ''` builds a fresh tiny model instead (`squall.inference.tiny.build_tiny_model`,
   tokenizer trained on the game's transcripts); see "Result" for why that is not the default.
2. Supervised pass on fresh games, one transcript per seat: exactly the messages the agent
   sends (`game.messages`) and a reply that is one seat number. Loss on the reply tokens only
   (the digit and `<|im_end|>`). For the first `--read-steps` (30) steps every villager votes
   the seat its clue names (the model learns where the clue is); after that a villager votes
   its clue with probability `--p-follow` (0.2) and otherwise any other seat at random, and a
   wolf votes a random villager. So the policy can read its clue but trusts it no more than
   chance: RL has to discover that following it wins.
3. Check on held-out games: the probability the policy puts on each villager's clue seat,
   how often a reply is a valid vote, and the villagers' win rate when both sides are played
   by this policy (votes sampled at temperature 1 from the raw logits, like the server's
   behaviour policy; the vote is the first reply token); written to `sft_report.json`.

Every prompt is `encode(render(messages) + generation prompt)` and every reply
`encode(reply text)`, exactly as the inference server tokenises them.

Result
------
Measured on this machine (2 shared CPU cores, load 3-5), seed 0: 150 steps x 8 games (48
transcripts), 119 s; loss 0.82. Committed policy on 300 held-out games: probability on the
clue seat 0.31 (0.2 + 0.8 x 1/5 = 0.36 is what the data asks for), valid votes 0.93, villager
win rate 0.35 with both sides played by it. During the first 30 steps the loss falls to 0.32
in 20 steps: the calculator policy learns to read the clue at once. A fresh 150 k-parameter
model (hidden 64, 2 layers) did not: after 300 steps (150 of them always following the clue,
lr up to 1e-2) its loss stayed at 0.90, uniform over the six seats, clue probability 1/6.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from examples.werewolf import game as rules


# ---------------------------------------------------------------- transcripts
def sft_vote(game: dict, seat: int, rng: random.Random, p_follow: float) -> int:
    """The warm-start's vote: mostly random, a villager's clue with probability p_follow."""
    if rules.role(game, seat) == "wolf":
        return rng.choice([s for s in rules.SEATS if s not in game["wolves"]])
    if rng.random() < p_follow:
        return game["clues"][str(seat)]
    return rng.choice([s for s in rules.SEATS if s != seat])


def render(tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def tokenize(tokenizer: Any, game: dict, seat: int, vote: int) -> tuple[list[int], list[int]]:
    """(ids, loss_mask) of one seat's transcript: the prompt as the server encodes it, then the reply."""
    prompt = render(tokenizer, rules.messages(game, seat), True)
    full = render(
        tokenizer, [*rules.messages(game, seat), {"role": "assistant", "content": str(vote)}], False
    )
    assert full.startswith(prompt) and full.endswith("\n")
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    reply_ids = tokenizer.encode(full[len(prompt) : -1], add_special_tokens=False)  # "5<|im_end|>"
    return prompt_ids + reply_ids, [0] * len(prompt_ids) + [1] * len(reply_ids)


# ---------------------------------------------------------------- model
def build_policy(out: Path, args: argparse.Namespace) -> Path:
    from squall.inference.tiny import build_tiny_model, build_tokenizer

    renderer = build_tokenizer(["x"], vocab_size=300)  # the template renders the same for any tokenizer
    rng = random.Random(f"corpus:{args.seed}")
    corpus = []
    for game in rules.generate("corpus", 300, args.seed):
        for seat in rules.SEATS:
            reply = {"role": "assistant", "content": str(sft_vote(game, seat, rng, 0.5))}
            corpus.append(render(renderer, [*rules.messages(game, seat), reply], False))
    return build_tiny_model(
        out,
        corpus=corpus,
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=args.heads,
        max_position_embeddings=128,
        seed=args.seed,
    )


def make_batch(tokenizer: Any, games: list[dict], rng: random.Random, p_follow: float):
    import torch

    pairs = [tokenize(tokenizer, g, s, sft_vote(g, s, rng, p_follow)) for g in games for s in rules.SEATS]
    width = max(len(ids) for ids, _ in pairs)
    ids = torch.full((len(pairs), width), tokenizer.pad_token_id, dtype=torch.long)  # (B, T)
    mask = torch.zeros((len(pairs), width))  # (B, T) 1 on trained tokens
    attention = torch.zeros((len(pairs), width), dtype=torch.long)  # (B, T)
    for i, (seq, m) in enumerate(pairs):
        ids[i, : len(seq)] = torch.tensor(seq)
        mask[i, : len(m)] = torch.tensor(m, dtype=torch.float32)
        attention[i, : len(seq)] = 1
    return ids, mask, attention


def train(model: Any, tokenizer: Any, args: argparse.Namespace) -> list[float]:
    import torch

    torch.manual_seed(args.seed)
    rng = random.Random(f"sft:{args.seed}")
    games = rules.generate("sft", args.steps * args.batch, args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.98))
    warmup = max(1, args.steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, args.steps - warmup)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    model.train()
    losses: list[float] = []
    start = time.monotonic()
    for step in range(args.steps):
        p_follow = 1.0 if step < args.read_steps else args.p_follow
        ids, mask, attention = make_batch(
            tokenizer, games[step * args.batch : (step + 1) * args.batch], rng, p_follow
        )
        logits = model(input_ids=ids, attention_mask=attention).logits  # (B, T, V)
        logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)  # (B, T-1, V) predicts ids[:, 1:]
        token_logp = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)  # (B, T-1)
        loss = -(token_logp * mask[:, 1:]).sum() / mask[:, 1:].sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        if step % args.log_every == 0 or step == args.steps - 1:
            recent = losses[-args.log_every :]
            print(
                f"step {step:5d} loss {sum(recent) / len(recent):.4f} {time.monotonic() - start:6.1f}s",
                flush=True,
            )
    model.eval()
    return losses


# ---------------------------------------------------------------- evaluation
def first_token_probs(model: Any, tokenizer: Any, game: dict) -> Any:
    """(6, V) next-token probabilities at the end of each seat's prompt (raw logits, temperature 1)."""
    import torch

    prompts = [tokenizer.encode(render(tokenizer, rules.messages(game, s), True)) for s in rules.SEATS]
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), tokenizer.pad_token_id, dtype=torch.long)  # (6, T) left-padded
    attention = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        attention[i, width - len(p) :] = 1
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention, position_ids=position_ids).logits
    return torch.softmax(logits[:, -1].float(), dim=-1)  # (6, V)


def evaluate(model: Any, tokenizer: Any, games: list[dict], seed: int) -> dict[str, float]:
    """Clue probability, valid-vote rate and self-play win rate on `games` (the vote is the first token)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    digit = {s: tokenizer.convert_tokens_to_ids(str(s)) for s in rules.SEATS}
    p_clue, valid, wins = [], [], 0
    for game in games:
        probs = first_token_probs(model, tokenizer, game)
        votes: dict[int, int | None] = {}
        for i, seat in enumerate(rules.SEATS):
            token = int(torch.multinomial(probs[i], 1, generator=gen))
            votes[seat] = rules.parse_vote(tokenizer.decode([token]), seat)
            valid.append(votes[seat] is not None)
            if rules.role(game, seat) == "villager":
                p_clue.append(float(probs[i, digit[game["clues"][str(seat)]]]))
        wins += rules.villagers_win(game, votes)
    return {
        "games": len(games),
        "villager_p_clue": round(sum(p_clue) / len(p_clue), 4),
        "valid_vote_rate": round(sum(valid) / len(valid), 4),
        "villager_win_rate": round(wins / len(games), 4),
    }


# ---------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build and warm-start the Werewolf policy.")
    parser.add_argument("--out", default="examples/werewolf/policy", help="output model directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=400)
    parser.add_argument("--steps", type=int, default=150, help="optimiser steps")
    parser.add_argument("--batch", type=int, default=8, help="games per step (6 transcripts each)")
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (AdamW, cosine)")
    parser.add_argument("--p-follow", type=float, default=0.2, help="share of villager votes for the clue")
    parser.add_argument(
        "--read-steps", type=int, default=30, help="first steps in which every villager follows its clue"
    )
    parser.add_argument("--eval", type=int, default=300, help="held-out games to evaluate (0: skip)")
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument(
        "--init", metavar="DIR", default="examples/calc/policy", help="start from this model ('': build one)"
    )
    parser.add_argument("--evaluate-only", action="store_true", help="only evaluate the model in --out")
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    out = Path(args.out)
    val = rules.generate("val", args.eval, args.seed)
    if args.evaluate_only:
        tokenizer = AutoTokenizer.from_pretrained(out)
        model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        print(json.dumps(evaluate(model, tokenizer, val, args.seed), indent=2))
        return 0
    if args.init:
        shutil.copytree(args.init, out, dirs_exist_ok=True, ignore=shutil.ignore_patterns("sft_report.json"))
    else:
        build_policy(out, args)
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
        report["val"] = evaluate(model, tokenizer, val, args.seed)
    (out / "sft_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
