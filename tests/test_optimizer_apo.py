"""APO (services/optimizer): against a scripted editor (a real HTTP server written here), the
beam keeps the better rewrite and publishes it; a down or garbled editor leaves the prompt as it
was; a kill -9 neither loses nor double-counts a trajectory; an unknown algorithm is refused."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from runner_helpers import SQUALL, Procs, log_of, trajectories, write_jsonl

from squall.optimizer.editor import Editor, EditorUnavailable
from squall.shared import resources, schemas
from squall.shared.heartbeat import read_heartbeats
from squall.shared.keys import Keys
from squall.shared.ledger import Ledger
from squall.shared.localredis import free_port

START_PROMPT = "You are a helpful assistant."
GOOD = "Give the answer in digits only."
BAD = "Be creative and playful."


class ScriptedEditor:
    """An OpenAI-compatible /v1/chat/completions that answers from a script, and logs requests."""

    def __init__(self, mode: str = "scripted") -> None:
        self.mode, self.requests = mode, []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                owner.requests.append(body)
                content = body["messages"][-1]["content"]
                if owner.mode == "garbage":
                    reply = "I would rather not say."  # no <START>…<END>: unusable
                elif "reasons why" in content:
                    reply = "<START>It never asks for the answer in digits.<END>"
                else:
                    reply = f"Here you go:\n<START>{GOOD}<END>\n<START>{BAD}<END>"
                out = json.dumps({"choices": [{"message": {"role": "assistant", "content": reply}}]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def editor():
    server = ScriptedEditor()
    yield server
    server.close()


def _run_file(tmp_path, editor_url: str, **optimizer: object) -> str:
    rows = [{"id": i, "needs": ["answer", "digits"], "sleep": 0.05} for i in range(12)]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    fields = {"algorithm": "apo", "editor_url": editor_url, "editor_model": "editor", "rounds": 1,
              "beam_width": 2, "candidates": 2, "eval_samples": 6, "heldout_samples": 3,
              "editor_deadline_s": 3.0, "eval_timeout_s": 60.0, **optimizer}  # fmt: skip
    lines = [f"{k} = {json.dumps(v)}" for k, v in fields.items()]
    path = tmp_path / "run.toml"
    path.write_text(
        f'[scheduler]\ndataset = "{data}"\nval_fraction = 0.25\n\n'
        f'[resources]\nsystem_prompt = "{START_PROMPT}"\n\n[optimizer]\n' + "\n".join(lines) + "\n"
    )
    return str(path)


def _state(r, run_name) -> dict:
    return json.loads(r.hget(Keys(run_name).optimizer_state, "state"))


@pytest.mark.timeout(120)
def test_the_beam_keeps_the_better_rewrite_and_publishes_it(r, redis_url, run_name, tmp_path, editor):
    keys = Keys(run_name)
    run_file = _run_file(tmp_path, editor.url)
    procs = Procs(redis_url, run_name, tmp_path)
    try:
        procs.start(
            "runner", "--config", run_file, "--agent", "resource_agents:keyword_reward", "--concurrency", "4"
        )
        opt = procs.start("optimize", "--config", run_file)
        assert opt.wait(90) == 0, log_of(opt)[-3000:]
    finally:
        procs.stop_all()
    state = _state(r, run_name)
    # Start prompt v1 scored 0; rewrites v2 (good) and v3 (bad) scored 1 and 0; v2 promoted as v4.
    assert state["beam"] == [{"version": 2, "score": 1.0}, {"version": 1, "score": 0.0}], state
    assert state["scored"] == [{"version": 2, "score": 1.0}, {"version": 3, "score": 0.0}]
    assert state["current"] == {"version": 4, "score": 1.0, "from": 2} and state["promotions"] == 1
    assert resources.current_pins(r, keys)["system_prompt"] == (4, 2)
    assert resources.get(r, keys, "system_prompt", 4).content == GOOD
    assert resources.get(r, keys, "system_prompt", 3).current is False
    # Held out: the start prompt and the promoted one, each on the 3 validation rows.
    assert [(h["version"], h["mean"]) for h in state["heldout"]] == [(1, 0.0), (4, 1.0)]
    points = [schemas.decode(f[schemas.ENTRY_FIELD]) for _, f in r.xrange(keys.rewards)]
    assert [(p.group_id, p.mean, p.count) for p in points] == [
        ("apo:system_prompt@v1", 0.0, 3),
        ("apo:system_prompt@v4", 1.0, 3),
    ]
    # Every editor call is recorded, with what was asked and answered; the examples were real attempts.
    calls = [schemas.decode(f[schemas.ENTRY_FIELD]) for _, f in r.xrange(keys.optimizer_calls)]
    assert (
        [c.fields["purpose"] for c in calls]
        == ["critique", "rewrite"]
        == [
            "critique" if "reasons why" in q["messages"][-1]["content"] else "rewrite"
            for q in editor.requests
        ]
    )
    assert START_PROMPT in calls[0].fields["messages"][0]["content"] and GOOD in calls[1].fields["reply"]
    # Each eval attempt ran with the version it was scoring, and is settled in the ledger.
    done = trajectories(r, run_name)
    assert len(done) == 6 * 3 + 3 * 2 and state["consumed"] == len(done)
    assert {t.resources["system_prompt"] for t in done} == {1, 2, 3, 4}
    assert Ledger(r, keys).counts() == {"dispatched": len(done), "validated": len(done)}
    beats = {name: beat for name, beat, _ in read_heartbeats(r, keys) if name.startswith("optimizer:")}
    (beat,) = beats.values()
    assert beat.stopped and beat.stats["promotions"] == 1.0 and beat.stats["current_version"] == 4.0
    # The editor saw only selection rows, never a held-out one.
    heldout_ids = {t.sample_id for t in done if t.group_id in {"apo00002-0", "apo00002-1", "apo00002-2"}}
    assert heldout_ids and all(
        f'"id": {i}' not in calls[0].fields["messages"][0]["content"] for i in heldout_ids
    )


def test_a_down_editor_is_retried_until_its_deadline_and_recorded(r, run_name):
    keys = Keys(run_name)
    editor = Editor(f"http://127.0.0.1:{free_port()}/v1", "m", r, keys, deadline_s=1.5, timeout_s=1.0)
    began = time.monotonic()
    with pytest.raises(EditorUnavailable, match=r"gave no usable critique within 2s: ConnectError"):
        editor.chat("critique", [{"role": "user", "content": "hi"}], str)
    assert time.monotonic() - began < 1.5 + 1.0  # no retry starts past the deadline
    calls = [schemas.decode(f[schemas.ENTRY_FIELD]) for _, f in r.xrange(keys.optimizer_calls)]
    assert len(calls) == editor.counts["failures"] >= 2 and all(
        "ConnectError" in c.fields["error"] for c in calls
    )


@pytest.mark.timeout(120)
def test_a_garbled_editor_leaves_the_prompt_as_it_was(r, redis_url, run_name, tmp_path):
    server = ScriptedEditor("garbage")
    run_file = _run_file(tmp_path, server.url, rounds=2, editor_deadline_s=1.0)
    procs = Procs(redis_url, run_name, tmp_path)
    try:
        procs.start(
            "runner", "--config", run_file, "--agent", "resource_agents:keyword_reward", "--concurrency", "4"
        )
        opt = procs.start("optimize", "--config", run_file)
        assert opt.wait(90) == 0, log_of(opt)[-3000:]
    finally:
        procs.stop_all()
        server.close()
    state = _state(r, run_name)
    assert state["editor_failures"] == 2 and state["round"] == 2 and state["promotions"] == 0
    assert resources.current_pins(r, Keys(run_name)) == {"system_prompt": (1, 1)}
    assert "editor_unavailable_prompt_kept" in log_of(opt)
    calls = [schemas.decode(f[schemas.ENTRY_FIELD]) for _, f in r.xrange(Keys(run_name).optimizer_calls)]
    assert calls and all("no <START>" in c.fields["error"] for c in calls)


@pytest.mark.timeout(180)
def test_kill_9_neither_loses_nor_double_counts_a_trajectory(r, redis_url, run_name, tmp_path, editor):
    keys = Keys(run_name)
    run_file = _run_file(tmp_path, editor.url, eval_samples=9)
    # Slower attempts, so the kill lands while evaluations are still coming in.
    write_jsonl(
        tmp_path / "d.jsonl", [{"id": i, "needs": ["answer", "digits"], "sleep": 0.4} for i in range(12)]
    )
    procs = Procs(redis_url, run_name, tmp_path)
    try:
        procs.start(
            "runner", "--config", run_file, "--agent", "resource_agents:keyword_reward", "--concurrency", "2"
        )
        for _ in range(2):  # kill -9 twice, mid-evaluation
            opt = procs.start("optimize", "--config", run_file)
            end = time.monotonic() + 60
            start_len = r.xlen(keys.trajectories)
            while r.xlen(keys.trajectories) < start_len + 3 and time.monotonic() < end:
                time.sleep(0.05)
            opt.send_signal(signal.SIGKILL)
            opt.wait(10)
        opt = procs.start("optimize", "--config", run_file)
        assert opt.wait(120) == 0, log_of(opt)[-3000:]
    finally:
        procs.stop_all()
    state = _state(r, run_name)
    done = trajectories(r, run_name)
    assert state["consumed"] == len(done) == 9 * 3 + 3 * 2, (state["consumed"], len(done))
    # A kill between publishing rewrites and saving the state leaves those candidate versions
    # unused (the restart asks the editor again), so version numbers may skip; the outcome does not.
    assert state["promotions"] == 1 and state["beam"][0]["score"] == 1.0 and state["current"]["score"] == 1.0
    assert resources.get(r, keys, "system_prompt", state["current"]["version"]).content == GOOD
    assert Ledger(r, keys).counts() == {"dispatched": len(done), "validated": len(done)}
    assert r.xpending(keys.trajectories, "optimizer")["pending"] == 0


def test_an_unknown_algorithm_is_refused_naming_the_known_ones(redis_url, run_name):
    out = subprocess.run([*SQUALL, "optimize", "--run", run_name, "--redis-url", redis_url, "--algorithm", "opro"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 2 and "optimizer.algorithm 'opro' is not known: use one of ['apo']" in out.stderr
    out = subprocess.run([*SQUALL, "optimize", "--run", run_name, "--redis-url", redis_url],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 2 and "give --algorithm (known: apo)" in out.stderr


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_the_served_policy_as_editor_end_to_end(r, redis_url, run_name, tmp_path, real_model):
    """The editor is the real SmolLM2-135M served by a squall inference node: whatever it
    answers, every call is recorded, and the prompt changes only to a candidate that scored
    higher than the start (or stays, counted as an editor failure when no reply was usable)."""
    import httpx

    port = free_port()
    run_file = _run_file(tmp_path, f"http://127.0.0.1:{port}/v1", editor_model="policy",
                         editor_deadline_s=60.0, editor_max_tokens=96, eval_samples=4)  # fmt: skip
    procs = Procs(redis_url, run_name, tmp_path)
    try:
        procs.start("inference", "--model", str(real_model), "--port", str(port), "--node", "n1")
        end = time.monotonic() + 180
        while time.monotonic() < end:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        procs.start(
            "runner", "--config", run_file, "--agent", "resource_agents:keyword_reward", "--concurrency", "4"
        )
        opt = procs.start("optimize", "--config", run_file)
        assert opt.wait(300) == 0, log_of(opt)[-3000:]
    finally:
        procs.stop_all()
    keys = Keys(run_name)
    state = _state(r, run_name)
    calls = [schemas.decode(f[schemas.ENTRY_FIELD]) for _, f in r.xrange(keys.optimizer_calls)]
    assert calls and all(c.fields["model"] == "policy" for c in calls)
    assert all(c.fields["reply"] or c.fields["error"] for c in calls)  # nothing lost, answered or not
    assert any(c.fields["reply"] for c in calls), [c.fields["error"] for c in calls]  # the node did answer
    start_score = next(h["mean"] for h in state["heldout"] if h["version"] == 1)
    if state["promotions"]:
        promoted = resources.get(r, keys, "system_prompt", state["current"]["version"])
        assert promoted.content == resources.get(r, keys, "system_prompt", state["current"]["from"]).content
        assert state["current"]["score"] > 0.0 and promoted.content != START_PROMPT
    else:
        assert resources.current_pins(r, keys)["system_prompt"] == (1, 1) and start_score == 0.0
        assert state["editor_failures"] == 1 or all(s["score"] <= 0.0 for s in state["scored"])


def test_a_promotion_published_before_a_crash_is_not_published_again(r, run_name, tmp_path):
    """The state still says `scoring` (the crash came between publishing the promotion and
    saving): selecting again finds the promotion instead of making a second one."""
    from squall.optimizer.optimizer import SOURCE, Optimizer, State
    from squall.shared.config import load_config

    config = load_config(_run_file(tmp_path, "http://127.0.0.1:9/v1"), overrides={"run": {"name": run_name}})
    keys = Keys(run_name)
    resources.publish(r, keys, "system_prompt", START_PROMPT)
    resources.publish(r, keys, "system_prompt", GOOD, current=False, source=SOURCE)
    before_crash = resources.promote(r, keys, "system_prompt", 2, source=SOURCE)
    opt = Optimizer(config, r, editor_url="http://127.0.0.1:9/v1")
    opt.state = State(
        phase="scoring",
        current={"version": 1, "score": 0.0},
        beam=[{"version": 1, "score": 0.0}],
        evals={"apo00002": {"version": 2, "kind": "score", "expected": 2, "started": time.time(), "total": 2.0,
                            "done": 2}},
    )  # fmt: skip
    opt._select()
    assert opt.state.current == {"version": before_crash.version, "score": 1.0, "from": 2}
    assert resources.current_pins(r, keys)["system_prompt"] == (3, 2)  # no version 4
    assert r.hget(keys.resources_current, "system_prompt:seq") == b"3"
