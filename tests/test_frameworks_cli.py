"""A real coding-agent CLI, unchanged: Claude Code (`claude`, npm) as a runner's command agent on
a small repository task with a test-based reward, speaking Anthropic Messages to the gateway.

The tiny policies solve nothing; what must hold is the plumbing. With a model whose context
holds Claude Code's long prompt, its requests are served, recorded token-exact (one Turn per
Messages call) and attributed, and the attempt ends with the test's reward. With a model whose
context does not (the suite's 1024-position tiny model), every request is refused in Anthropic's
error shape ("prompt is too long"), the overflow is counted and the attempt fails with the reason;
either way the ledger balances and nothing hangs. Part of the `frameworks` suite: CI installs
the CLI (`make cli`) and a missing `claude` fails there instead of skipping (tests/optional.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
from unittest import mock

import pytest
from framework_helpers import AGENTS_DIR, SUITE, agent_of, recorded_command, run_command_agent
from optional import need
from runner_helpers import Procs
from test_gateway_agents import start_inference
from waiting import reap, wait_for

from squall.shared.heartbeat import read_heartbeats
from squall.shared.keys import Keys
from squall.shared.ledger import Ledger

pytestmark = [pytest.mark.redis, pytest.mark.slow, pytest.mark.timeout(600)]

TASK = {
    "files": {
        "calc.py": "def add(a, b):\n    return a - b\n",
        "test_calc.py": "from calc import add\n\nassert add(2, 3) == 5\nprint('ok')\n",
    },
    "prompt": "Fix the bug in calc.py so that `python3 test_calc.py` passes.",
    "test": "python3 test_calc.py",
    "max_turns": 2,
}


@pytest.fixture(scope="module")
def claude():
    found = shutil.which("claude")
    need(SUITE, found is not None and shutil.which("jq") is not None and shutil.which("git") is not None,
         "claude, jq or git is missing: `make cli` installs Claude Code (npm, needs node >= 20)")  # fmt: skip
    return found


@pytest.fixture
def procs(redis_url, run_name, tmp_path):
    p = Procs(redis_url, run_name, tmp_path, SQUALL_RUNNER__GRACE_S="1", SQUALL_RUNNER__HEARTBEAT_S="0.5")
    yield p
    p.stop_all()


def served(tmp_path_factory, positions: int):
    from squall.inference.tiny import build_tiny_model

    model = build_tiny_model(
        tmp_path_factory.mktemp(f"tiny{positions}"), seed=0, max_position_embeddings=positions
    )
    with mock.patch.dict(os.environ, {"SQUALL_INFERENCE__MAX_MODEL_LEN": str(positions)}):
        proc, url = start_inference(str(model), tmp_path_factory.mktemp(f"inference{positions}"))
    proc.model_dir = str(model)  # type: ignore[attr-defined]
    return proc, url


@pytest.fixture(scope="module")
def short_context(tmp_path_factory):
    proc, url = served(tmp_path_factory, 1024)
    yield url
    stop(proc)


def messages_exchanges(record) -> list[dict]:
    exchanges = json.loads(record.read_text())["exchanges"]
    return [
        e for e in exchanges if e["method"] == "POST" and e["path"].split("?")[0].endswith("/v1/messages")
    ]


def runner_stats(r, run_name) -> dict:
    beats = [b for _, b, _ in read_heartbeats(r, Keys(run_name)) if b and b.service == "runner"]
    return beats[0].stats if beats else {}


def test_claude_code_over_the_context_is_refused_counted_and_fails_the_attempt(
    claude, r, run_name, procs, short_context, tmp_path
):
    record = tmp_path / "record.json"
    command = recorded_command(record, "bash", str(AGENTS_DIR / "claude_code_task.sh"))
    traj = run_command_agent(r, run_name, procs, command, short_context, TASK, deadline_s=300)
    calls = messages_exchanges(record)
    assert calls, "Claude Code sent no Messages request"
    for call in calls:
        assert call["status"] == 400, call
        body = json.loads(call["response"])
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        assert "prompt is too long" in body["error"]["message"], body
        assert agent_of(call["path"]) == "main"
    assert traj.status == "failed" and traj.turns == []
    assert "context overflow" in traj.error and "context is 1024 tokens" in traj.error, traj.error
    wait_for(
        lambda: runner_stats(r, run_name).get("context_overflows") == len(calls), 10, "the overflow count"
    )
    ledger = Ledger(r, Keys(run_name))
    wait_for(lambda: ledger.state_of(traj.key) == "failed", 10, "the failed ledger state")
    assert ledger.balanced()


# Claude Code's own flags narrow its prompt to what a small served context can hold: two tools
# and a short system prompt (the default one with its 12 tools is some 34k tiny-model tokens).
SMALL = {**TASK, "cli_args": ["--tools", "Read,Edit", "--system-prompt", "You fix bugs. Be brief."]}


@pytest.fixture(scope="module")
def long_context(tmp_path_factory):
    proc, url = served(tmp_path_factory, 8192)
    yield url, proc.model_dir
    stop(proc)


def test_claude_code_episode_is_served_recorded_and_attributed(
    claude, r, run_name, procs, long_context, tmp_path
):
    from transformers import AutoTokenizer

    url, model_dir = long_context
    record = tmp_path / "record.json"
    command = recorded_command(record, "bash", str(AGENTS_DIR / "claude_code_task.sh"))
    traj = run_command_agent(r, run_name, procs, command, url, SMALL, deadline_s=400)
    calls = messages_exchanges(record)
    assert traj.status == "ok" and traj.reward == 0.0, traj.error  # the tiny policy fixes nothing
    served_calls = [c for c in calls if c["status"] == 200]
    assert served_calls and len(served_calls) == len(traj.turns), [c["status"] for c in calls]
    assert all(t.agent == "main" and t.trained and t.version == 0 for t in traj.turns)
    # What Claude Code read from each stream is exactly the recorded ids' text.
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    for call, turn in zip(served_calls, traj.turns, strict=True):
        assert call["request"]["stream"] is True and call["request"]["system"]
        text = tokenizer.decode(turn.response_tokens.tolist(), skip_special_tokens=False)
        assert streamed_text(call["response"]) == text.removesuffix("<|im_end|>")
    ledger = Ledger(r, Keys(run_name))
    wait_for(lambda: ledger.state_of(traj.key) == "ok", 10, "the ok ledger state")
    assert ledger.balanced()


def streamed_text(sse: str) -> str:
    """The text deltas of an Anthropic event stream, after checking its event order."""
    events = [json.loads(line[5:]) for line in sse.splitlines() if line.startswith("data:")]
    kinds = [e["type"] for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"], kinds
    return "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")


@pytest.fixture(scope="module")
def codex():
    found = shutil.which("codex")
    need(SUITE, found is not None, "codex is missing: `make cli` installs the Codex CLI (npm)")
    return found


def responses_exchanges(record) -> list[dict]:
    exchanges = json.loads(record.read_text())["exchanges"]
    return [
        e for e in exchanges if e["method"] == "POST" and e["path"].split("?")[0].endswith("/v1/responses")
    ]


def test_codex_over_the_context_is_refused_counted_and_fails_the_attempt(
    codex, r, run_name, procs, short_context, tmp_path
):
    record = tmp_path / "record.json"
    command = recorded_command(record, "bash", str(AGENTS_DIR / "codex_task.sh"))
    traj = run_command_agent(r, run_name, procs, command, short_context, TASK, deadline_s=300)
    calls = responses_exchanges(record)
    assert calls, "Codex sent no Responses request"
    for call in calls:
        assert call["status"] == 400, call
        error = json.loads(call["response"])["error"]
        assert error["code"] == "context_length_exceeded" and error["type"] == "invalid_request_error", error
    assert traj.status == "failed" and traj.turns == []
    assert "context overflow" in traj.error and "context is 1024 tokens" in traj.error, traj.error
    wait_for(
        lambda: runner_stats(r, run_name).get("context_overflows") == len(calls), 10, "the overflow count"
    )
    ledger = Ledger(r, Keys(run_name))
    wait_for(lambda: ledger.state_of(traj.key) == "failed", 10, "the failed ledger state")
    assert ledger.balanced()


def stop(proc) -> None:
    """SIGTERM, then a kill if the server is still up after 30 s (a loaded machine is slow)."""
    proc.terminate()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(30)
    reap(proc)
