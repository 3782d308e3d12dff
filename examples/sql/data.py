"""A generated SQLite database and spider-like questions with gold SQL for the SQL example.

A small shop: customers (id, name, city), products (id, name, category, price) and orders
(id, customer_id, product_id, quantity, day). Questions come from templates over the drawn
rows, each with the gold query whose result defines the right answer (the reward compares
result rows, not SQL text: the pool's `sql` judge).

    python -m examples.sql.data --out runs/sql-data --train 500 --val 50 --seed 0

writes shop.db, train.jsonl and val.jsonl ({id, question, gold_sql, schema}).
"""

from __future__ import annotations

import argparse
import random
import sqlite3
import sys
from pathlib import Path

from examples.calc.tasks import write_jsonl

CITIES = ("Lisbon", "Oslo", "Kyoto", "Quito", "Accra", "Perth")
CATEGORIES = ("books", "games", "tools", "garden")
NAMES = ("Ana", "Ben", "Cleo", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jun", "Kai", "Lea")
SCHEMA = (
    "CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT, city TEXT);\n"
    "CREATE TABLE products (id INTEGER PRIMARY KEY, name TEXT, category TEXT, price REAL);\n"
    "CREATE TABLE orders (id INTEGER PRIMARY KEY, customer_id INTEGER, product_id INTEGER, quantity INTEGER, day INTEGER);"
)

TEMPLATES = (
    ("How many customers live in {city}?", "SELECT count(*) FROM customers WHERE city = '{city}'"),
    ("How many products are in the {category} category?", "SELECT count(*) FROM products WHERE category = '{category}'"),
    ("What is the most expensive product in the {category} category?",
     "SELECT name FROM products WHERE category = '{category}' ORDER BY price DESC LIMIT 1"),
    ("How many orders did {name} place?",
     "SELECT count(*) FROM orders JOIN customers ON orders.customer_id = customers.id WHERE customers.name = '{name}'"),
    ("How many items did customers from {city} order in total?",
     "SELECT sum(quantity) FROM orders JOIN customers ON orders.customer_id = customers.id WHERE customers.city = '{city}'"),
    ("List the names of customers who live in {city}.", "SELECT name FROM customers WHERE city = '{city}'"),
)  # fmt: skip


def build_database(path: str | Path, seed: int) -> None:
    rng = random.Random(f"sql:db:{seed}")
    path = Path(path)
    path.unlink(missing_ok=True)
    conn = sqlite3.connect(path)
    conn.executescript(SCHEMA)
    customers = [(i + 1, f"{name}{i + 1}" if i >= len(NAMES) else name, rng.choice(CITIES))
                 for i, name in enumerate(NAMES * 2)]  # fmt: skip
    products = [(i + 1, f"{rng.choice(('red', 'big', 'old', 'new'))} {c[:-1]} {i + 1}", c, round(rng.uniform(2, 90), 2))
                for i, c in enumerate(rng.choice(CATEGORIES) for _ in range(30))]  # fmt: skip
    orders = [(i + 1, rng.randint(1, len(customers)), rng.randint(1, len(products)), rng.randint(1, 5), rng.randint(1, 365))
              for i in range(300)]  # fmt: skip
    conn.executemany("INSERT INTO customers VALUES (?, ?, ?)", customers)
    conn.executemany("INSERT INTO products VALUES (?, ?, ?, ?)", products)
    conn.executemany("INSERT INTO orders VALUES (?, ?, ?, ?, ?)", orders)
    conn.commit()
    conn.close()


def questions(db: str | Path, split: str, n: int, seed: int) -> list[dict]:
    conn = sqlite3.connect(db)
    names = [row[0] for row in conn.execute("SELECT name FROM customers")]
    conn.close()
    rng = random.Random(f"sql:{split}:{seed}")
    rows = []
    for i in range(n):
        question, sql = rng.choice(TEMPLATES)
        values = {"city": rng.choice(CITIES), "category": rng.choice(CATEGORIES), "name": rng.choice(names)}
        rows.append({"id": f"sql-{split}-{i:05d}", "question": question.format(**values),
                     "gold_sql": sql.format(**values), "schema": SCHEMA})  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write the SQL example's database and questions.")
    parser.add_argument("--out", required=True)
    parser.add_argument("--train", type=int, default=500)
    parser.add_argument("--val", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    build_database(out / "shop.db", args.seed)
    write_jsonl(out / "train.jsonl", questions(out / "shop.db", "train", args.train, args.seed))
    write_jsonl(out / "val.jsonl", questions(out / "shop.db", "val", args.val, args.seed))
    print(f"wrote shop.db, {args.train} train and {args.val} val questions to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
