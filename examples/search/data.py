"""A generated world for the retrieval example (Search-R1-like): a corpus of short documents
about invented countries, cities and people, and two-hop questions over it.

Every country has a capital; every city was founded by a person in a year; every person was
born in a town. A question chains two facts ("Who founded the capital of Varnia?" needs the
capital first, then its founder), so one search is rarely enough. Names are built from
syllables by a seeded generator: no fact can come from a model's pre-training.

    python -m examples.search.data --out runs/search-data --train 1000 --val 100 --seed 0

writes corpus.jsonl ({id, title, text}), train.jsonl and val.jsonl ({id, question, answer, hops}).
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

from examples.calc.tasks import write_jsonl

SYLLABLES = ("var", "nia", "os", "kelm", "qui", "lon", "bra", "ndt", "ed", "da", "mor", "tav", "sel",
             "rin", "dov", "ka", "lum", "per", "gal", "tes", "ur", "fen", "ba", "zo", "ril", "mek")  # fmt: skip
FIRST_NAMES = ("Edda", "Joren", "Mila", "Tarek", "Ines", "Bram", "Odile", "Kasim", "Lene", "Pavo")


def _name(rng: random.Random, used: set[str], parts: int = 2) -> str:
    while True:
        name = "".join(rng.choice(SYLLABLES) for _ in range(parts)).capitalize()
        if name not in used and len(name) > 3:
            used.add(name)
            return name


def world(seed: int, countries: int = 60) -> dict[str, list[dict]]:
    """The same seed gives the same world: countries, cities (capitals), people, towns."""
    rng = random.Random(f"search:world:{seed}")
    used: set[str] = set()
    facts = []
    for _ in range(countries):
        country, capital, town = _name(rng, used, 3), _name(rng, used), _name(rng, used)
        founder = f"{rng.choice(FIRST_NAMES)} {_name(rng, used)}"
        year = rng.randint(900, 1900)
        facts.append({"country": country, "capital": capital, "founder": founder, "year": year, "town": town})
    return {"facts": facts}


def corpus(facts: list[dict]) -> list[dict]:
    docs = []
    for i, f in enumerate(facts):
        docs.append(
            {
                "id": f"c{i}",
                "title": f["country"],
                "text": f"{f['country']} is a country. The capital of {f['country']} is {f['capital']}.",
            }
        )
        docs.append(
            {
                "id": f"k{i}",
                "title": f["capital"],
                "text": f"{f['capital']} is a city. {f['capital']} was founded by {f['founder']} in {f['year']}.",
            }
        )
        docs.append(
            {
                "id": f"p{i}",
                "title": f["founder"],
                "text": f"{f['founder']} was an explorer, born in the town of {f['town']}.",
            }
        )
    return docs


QUESTIONS = (
    ("Who founded the capital of {country}?", "founder"),
    ("In which year was the capital of {country} founded?", "year"),
    ("In which town was the founder of {capital} born?", "town"),
)


def questions(facts: list[dict], split: str, n: int, seed: int) -> list[dict]:
    rng = random.Random(f"search:{split}:{seed}")
    rows = []
    for i in range(n):
        f = rng.choice(facts)
        template, field = rng.choice(QUESTIONS)
        rows.append(
            {
                "id": f"search-{split}-{i:05d}",
                "question": template.format(**f),
                "answer": str(f[field]),
                "hops": 2,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write the retrieval example's corpus and questions.")
    parser.add_argument("--out", required=True)
    parser.add_argument("--train", type=int, default=1000)
    parser.add_argument("--val", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    facts = world(args.seed)["facts"]
    write_jsonl(out / "corpus.jsonl", corpus(facts))
    write_jsonl(out / "train.jsonl", questions(facts, "train", args.train, args.seed))
    write_jsonl(out / "val.jsonl", questions(facts, "val", args.val, args.seed))
    print(f"wrote {3 * len(facts)} documents, {args.train} train and {args.val} val questions to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
