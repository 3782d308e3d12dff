"""The rules of a one-day Werewolf vote and a seeded generator of games.

Six seats (1-6): two wolves, who know each other, and four villagers, who do not know who
anyone is except one wolf each: every villager has a private clue, "seat N is a wolf", naming
one of the two wolves (drawn independently per villager, so the clues of a team may differ).
Every seat votes once, privately and at the same time, by replying with a seat number. The
seat with the most votes is out (a tie is broken by the game's own seeded coin); the
villagers win when it is a wolf. A reply that is not another seat's number is an abstention.

What the villagers can learn: vote for the seat your clue names. A team that always does
wins ~97 % of games against wolves that vote at random, ~22 % when it votes at random
itself (`python -m examples.werewolf.game --simulate` measures both with these rules).

Each row is {"id", "seed", "wolves": [a, b], "clues": {"seat": wolf, ...}}; the same seed
always gives the same rows, and the splits draw from independent streams of it:

    python -m examples.werewolf.game --out runs/werewolf-data --train 4000 --val 200 --seed 0
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from collections import Counter
from pathlib import Path

SEATS = (1, 2, 3, 4, 5, 6)
WOLVES = 2
SYSTEM_PROMPT = "Werewolf vote. Reply with a seat number, 1 to 6."
_FIRST_INT = re.compile(r"\d+")


def make_game(rng: random.Random, game_id: str) -> dict:
    """One game drawn from `rng`: who the wolves are, which wolf each villager knows."""
    wolves = sorted(rng.sample(SEATS, WOLVES))
    clues = {str(seat): rng.choice(wolves) for seat in SEATS if seat not in wolves}
    return {"id": game_id, "seed": rng.randrange(2**31), "wolves": wolves, "clues": clues}


def generate(split: str, n: int, seed: int) -> list[dict]:
    """`n` games of `split` ("train" or "val"); each split has its own stream of the seed."""
    rng = random.Random(f"werewolf:{split}:{seed}")
    return [make_game(rng, f"{split}-{i:05d}") for i in range(n)]


def check_game(game: dict) -> None:
    """Raise ValueError naming what is wrong with a game row (the agent checks every task)."""
    wolves = game.get("wolves")
    if not isinstance(wolves, list) or len(set(wolves)) != WOLVES or not set(wolves) <= set(SEATS):
        raise ValueError(
            f"game {game.get('id')!r}: 'wolves' must be {WOLVES} distinct seats of {SEATS}, got {wolves!r}"
        )
    clues = game.get("clues")
    villagers = {str(seat) for seat in SEATS if seat not in wolves}
    if not isinstance(clues, dict) or set(clues) != villagers or not set(clues.values()) <= set(wolves):
        raise ValueError(
            f"game {game.get('id')!r}: 'clues' must map every villager seat {sorted(villagers)} to a wolf "
            f"of {wolves}, got {clues!r}; write games with python -m examples.werewolf.game"
        )


def role(game: dict, seat: int) -> str:
    return "wolf" if seat in game["wolves"] else "villager"


def prompt(game: dict, seat: int) -> str:
    """What `seat` is told privately: its role and what it knows."""
    if role(game, seat) == "wolf":
        partner = next(w for w in game["wolves"] if w != seat)
        return f"You are seat {seat}, a wolf. Seat {partner} is the other wolf. Your vote?"
    return f"You are seat {seat}, a villager. Seat {game['clues'][str(seat)]} is a wolf. Your vote?"


def messages(game: dict, seat: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": prompt(game, seat)}]


def parse_vote(text: str | None, seat: int) -> int | None:
    """The seat voted for: the first number of the reply if it is another seat, else None."""
    found = _FIRST_INT.search(text or "")
    if not found:
        return None
    vote = int(found.group())
    return vote if vote in SEATS and vote != seat else None


def eliminated(game: dict, votes: dict[int, int | None]) -> int | None:
    """The seat voted out: most votes, a tie broken by the game's seed; None if nobody voted."""
    counts = Counter(v for v in votes.values() if v is not None)
    if not counts:
        return None
    top = max(counts.values())
    tied = sorted(seat for seat, c in counts.items() if c == top)
    return random.Random(game["seed"]).choice(tied)


def villagers_win(game: dict, votes: dict[int, int | None]) -> bool:
    out = eliminated(game, votes)
    return out is not None and out in game["wolves"]


# ---------------------------------------------------------------- measuring the rules
def simulate(games: list[dict], p_follow: float, seed: int = 0) -> float:
    """Villager win rate when each villager votes its clue with probability `p_follow` (else a
    random other seat) and each wolf votes a random villager."""
    rng = random.Random(seed)
    wins = 0
    for game in games:
        votes: dict[int, int | None] = {}
        for seat in SEATS:
            if role(game, seat) == "wolf":
                votes[seat] = rng.choice([s for s in SEATS if s not in game["wolves"]])
            elif rng.random() < p_follow:
                votes[seat] = game["clues"][str(seat)]
            else:
                votes[seat] = rng.choice([s for s in SEATS if s != seat])
        wins += villagers_win(game, votes)
    return wins / len(games)


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write one-day Werewolf games as train/val JSONL.")
    parser.add_argument("--out", help="output folder")
    parser.add_argument("--train", type=int, default=4000, help="number of training games")
    parser.add_argument("--val", type=int, default=200, help="number of held-out validation games")
    parser.add_argument("--seed", type=int, default=0, help="generator seed")
    parser.add_argument("--simulate", action="store_true", help="print scripted win rates instead")
    args = parser.parse_args(argv)
    if args.simulate:
        games = generate("simulate", 20000, args.seed)
        for p in (0.0, 0.2, 0.5, 0.8, 1.0):
            print(f"villagers follow their clue with p={p:.1f}: win rate {simulate(games, p, args.seed):.3f}")
        return 0
    if not args.out:
        parser.error("--out is required (or --simulate)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(out / "train.jsonl", generate("train", args.train, args.seed))
    write_jsonl(out / "val.jsonl", generate("val", args.val, args.seed))
    print(f"wrote {args.train} train and {args.val} val games to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
