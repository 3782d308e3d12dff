"""The three tool-using examples: data generators, reward functions against known-good and
known-bad answers, their tool calls through a real pool, and (slow) each agent end to end
through `squall up` with the tiny policy."""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from examples.code import agent as code_agent
from examples.code import tasks as code_tasks
from examples.search import agent as search_agent
from examples.search import data as search_data
from examples.sql import agent as sql_agent
from examples.sql import data as sql_data
from squall.shared.localredis import free_port
from tests.toolpool_helpers import running_pool

ROOT = Path(__file__).resolve().parents[1]
RUN = f"ex{os.getpid()}"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The search and SQL examples' generated data, small."""
    out = tmp_path_factory.mktemp("examples")
    assert search_data.main(["--out", str(out / "search"), "--train", "20", "--val", "5"]) == 0
    assert sql_data.main(["--out", str(out / "sql"), "--train", "30", "--val", "5"]) == 0
    return out


@pytest.fixture(scope="module")
def pool(redis_url, world, monkeypatch_module):
    settings = {
        "SQUALL_WORKER__QUEUES": '["code", "retrieval", "sql", "judge"]',
        "SQUALL_WORKER__CORPORA": json.dumps({"default": str(world / "search" / "corpus.jsonl")}),
        "SQUALL_WORKER__DATABASES": json.dumps({"default": str(world / "sql" / "shop.db")}),
    }
    with running_pool(redis_url, RUN, settings, world / "worker.log") as p:
        # the examples' agents use the module-level client: point it at this pool
        monkeypatch_module.setenv("SQUALL_RUN__REDIS_URL", redis_url)
        monkeypatch_module.setenv("SQUALL_RUN__NAME", RUN)
        from squall.toolpool import client

        monkeypatch_module.setattr(client, "_default", p["tools"])
        yield p


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


# --- code interpreter ---------------------------------------------------------------------------


def test_code_tasks_are_seeded_and_differ_from_the_calc_demo():
    rows = code_tasks.generate("train", 20, 0)
    assert rows == code_tasks.generate("train", 20, 0) and rows != code_tasks.generate("train", 20, 1)
    assert all(row["id"].startswith("code-train-") for row in rows)


def test_code_reward_known_good_and_bad():
    task = code_tasks.generate("val", 1, 0)[0]
    assert code_agent.score(f"The answer is {task['answer']}.", task["answer"]) == 1.0
    assert code_agent.score(f"{task['answer'] + 1}", task["answer"]) == 0.0
    assert code_agent.score(None, task["answer"]) == 0.0


def test_code_tools_run_in_the_sandbox(pool):
    run = asyncio.run
    assert run(code_agent.run_tool("calculator", json.dumps({"expression": "37*58"}))) == "2146"
    assert run(code_agent.run_tool("python", json.dumps({"code": "x = 12\nprint(x * 7)"}))) == "84"
    assert "ZeroDivisionError" in run(code_agent.run_tool("calculator", json.dumps({"expression": "1/0"})))
    assert run(
        code_agent.run_tool("python", json.dumps({"code": "import os\nprint(os.getcwd())"}))
    ).startswith("/tmp/squall-sandbox-")
    assert run(code_agent.run_tool("shell", "{}")).startswith("error: unknown tool")
    assert run(code_agent.run_tool("python", "{not json")).startswith("error: bad tool arguments")


# --- retrieval ----------------------------------------------------------------------------------


def test_search_data_is_seeded_and_two_hop(world):
    facts = search_data.world(0)["facts"]
    assert facts == search_data.world(0)["facts"] and facts != search_data.world(1)["facts"]
    rows = [json.loads(line) for line in (world / "search" / "train.jsonl").read_text().splitlines()]
    by_country = {f["country"]: f for f in facts}
    for row in rows:
        if row["question"].startswith("Who founded the capital of"):
            country = row["question"].removeprefix("Who founded the capital of ").rstrip("?")
            assert row["answer"] == by_country[country]["founder"]


def test_search_reward_known_good_and_bad():
    assert search_agent.reward("Edda Brandt", "Edda Brandt") == 1.0
    assert search_agent.reward("It was founded by edda brandt.", "Edda Brandt") == 1.0
    assert search_agent.reward("Brandt", "Edda Brandt") == 0.0
    assert search_agent.reward("Joren Brandt", "Edda Brandt") == 0.0
    assert search_agent.reward(None, "1412") == 0.0


def test_search_two_hops_through_the_pool(pool):
    fact = search_data.world(0)["facts"][0]
    first = asyncio.run(
        search_agent.run_tool("search", json.dumps({"query": f"capital of {fact['country']}"}))
    )
    assert fact["capital"] in first.splitlines()[0]
    second = asyncio.run(search_agent.run_tool("search", json.dumps({"query": f"{fact['capital']} founded"})))
    assert fact["founder"] in second
    assert asyncio.run(search_agent.run_tool("calculator", "{}")).startswith("error: unknown tool")


# --- SQL ----------------------------------------------------------------------------------------


def test_sql_gold_queries_run_and_answer(world):
    conn = sqlite3.connect(world / "sql" / "shop.db")
    for line in (world / "sql" / "train.jsonl").read_text().splitlines():
        row = json.loads(line)
        assert conn.execute(row["gold_sql"]).fetchall() is not None
    assert conn.execute("SELECT count(*) FROM orders").fetchone()[0] == 300
    conn.close()


def test_extract_sql():
    assert sql_agent.extract_sql("```sql\nSELECT 1;\n```") == "SELECT 1"
    assert sql_agent.extract_sql("Sure! SELECT name FROM customers;") == "SELECT name FROM customers"
    assert sql_agent.extract_sql(None) == ""


def test_sql_reward_known_good_and_bad(pool):
    task = {"gold_sql": "SELECT name FROM customers WHERE city = 'Oslo'"}
    same = "SELECT c.name FROM customers AS c WHERE c.city IN ('Oslo') ORDER BY c.id DESC"
    assert asyncio.run(sql_agent.reward(task, task["gold_sql"])) == 1.0
    assert asyncio.run(sql_agent.reward(task, same)) == 1.0
    assert asyncio.run(sql_agent.reward(task, "SELECT name FROM customers")) == 0.0
    assert asyncio.run(sql_agent.reward(task, "SELECT nope FROM customers")) == 0.0
    assert asyncio.run(sql_agent.reward(task, "")) == 0.0


# --- end to end through `squall up` (slow) ---------------------------------------------------------

E2E = {
    # example: (config, data command, overrides)
    "code": ("examples/code/cpu.toml", ["-m", "examples.code.tasks", "--train", "64", "--val", "16"],
             {"SQUALL_SCHEDULER__MAX_SAMPLES": "16", "SQUALL_SCHEDULER__VAL_SAMPLES": "8"}),
    "search": ("examples/search/cpu.toml", ["-m", "examples.search.data", "--train", "32", "--val", "8"],
               {"SQUALL_SCHEDULER__MAX_SAMPLES": "8", "SQUALL_SCHEDULER__VAL_SAMPLES": "4"}),
    "sql": ("examples/sql/cpu.toml", ["-m", "examples.sql.data", "--train", "32", "--val", "8"],
            {"SQUALL_SCHEDULER__MAX_SAMPLES": "8", "SQUALL_SCHEDULER__VAL_SAMPLES": "4"}),
}  # fmt: skip


@pytest.mark.timeout(540)  # its own subprocess budget, past the suite-wide 300 s
@pytest.mark.slow
@pytest.mark.parametrize("example", sorted(E2E))
def test_example_end_to_end_through_squall_up(example, tmp_path):
    config, data_cmd, overrides = E2E[example]
    data = tmp_path / "data"
    subprocess.run([sys.executable, *data_cmd, "--out", str(data)], cwd=ROOT, check=True, capture_output=True)
    run_dir = tmp_path / "run"
    env = {**os.environ, **overrides, "SQUALL_RUN__REDIS_URL": f"redis://127.0.0.1:{free_port()}/0",
           "SQUALL_RUN__DIR": str(run_dir), "SQUALL_SCHEDULER__DATASET": str(data / "train.jsonl"),
           "SQUALL_SCHEDULER__VAL_DATASET": str(data / "val.jsonl"), "SQUALL_SCHEDULER__VAL_EVERY": "100"}  # fmt: skip
    if example == "search":
        env["SQUALL_WORKER__CORPORA"] = json.dumps({"default": str(data / "corpus.jsonl")})
    if example == "sql":
        env["SQUALL_WORKER__DATABASES"] = json.dumps({"default": str(data / "shop.db")})
    done = subprocess.run([sys.executable, "-m", "squall.cli", "up", "--config", config, "--minutes", "6"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=480)  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 0 and "scheduler finished the dataset" in out, out[-3000:]
    assert "unclean exits" not in out, out[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["ledger_balanced"], summary["ledger"]
    worker_log = (run_dir / "logs" / "worker.log").read_text()
    assert "Job OK" in worker_log or "Successfully completed" in worker_log, worker_log[-2000:]
    rewards = [p["mean"] for p in summary["train_curve"]] + [p["mean"] for p in summary["val_curve"]]
    assert rewards and all(0.0 <= x <= 1.0 for x in rewards)
    if example == "sql":  # only the write and rewrite nodes train; check is recorded, not trained
        from squall.shared.config import load_config

        assert load_config(ROOT / config, env={}).runner.train_agents == ["write", "rewrite"]
