"""Agent frameworks through a real runner, gateway and inference server, checked token-exact.

Each framework agent (tests/agents/) runs as the runner's `--agent-cmd`, wrapped by
`tests/agents/record_calls.py`, a pass-through that writes every HTTP exchange the framework
made (request JSON, response as received, SSE included). `check_token_exact` then holds each
chat call against the Turn the gateway recorded for it:
- the Turn's prompt ids are exactly the ids of the chat template rendered from the messages
  and tools the framework sent (with the server's documented normalisation and tool_choice
  prefill, squall.inference.toolcalls);
- its response ids decode to exactly what the framework received: the content and the tool
  calls (parsed from the sampled text as the server does), plus the end-of-turn token;
- it is attributed to the agent whose URL the call went to (`.../agent/NAME/v1` or `main`).

The policy is the committed calculator policy (examples/calc/policy, 512 positions), which
knows the calculator tool's Hermes format: with the tool schema it was trained on and a
tool_choice that forces a call it calls the calculator; under a framework's own prompts and
schemas it mostly answers (badly) without one. What is checked is the record, not the answer.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
from pathlib import Path
from typing import Any

from optional import need
from runner_helpers import dispatch, trajectories
from waiting import wait_for

from squall.inference.toolcalls import (
    forced_prefix,
    normalize_messages,
    parse_tool_calls,
    resolve_tool_choice,
)

TESTS_DIR = Path(__file__).resolve().parent
ROOT = TESTS_DIR.parent
AGENTS_DIR = TESTS_DIR / "agents"
RECORD = AGENTS_DIR / "record_calls.py"
POLICY = ROOT / "examples" / "calc" / "policy"
EOS = "<|im_end|>"
SUITE = "frameworks"
# The framework venvs `make frameworks` builds; AGENTS_PYTHON / CREWAI_PYTHON override them.
VENVS = {
    "agents": ("AGENTS_PYTHON", ".venv-agents"),
    "crewai": ("CREWAI_PYTHON", ".venv-crewai"),
    "litellm": ("LITELLM_PYTHON", ".venv-litellm"),
    "youtu": ("YOUTU_PYTHON", ".venv-youtu"),
}


def venv_python(name: str) -> str:
    """The interpreter of framework venv `name`; skips (fails in CI) when it is not built."""
    variable, folder = VENVS[name]
    python = Path(os.environ.get(variable) or ROOT / folder / "bin" / "python")
    need(SUITE, python.exists(), f"{python} is missing: run `make frameworks` to build the framework venvs")
    return str(python)


def need_tools(*names: str) -> None:
    missing = [n for n in names if shutil.which(n) is None]
    need(SUITE, not missing, f"{', '.join(missing)} not on PATH: apt-get install {' '.join(missing)}")


def recorded_command(record: Path, *argv: str) -> str:
    """The `--agent-cmd` that runs argv with its LLM traffic written to `record`."""
    return shlex.join([sys.executable, str(RECORD), str(record), "--", *argv])


def run_command_agent(
    r, run: str, procs, command: str, inference_url: str, row: dict, deadline_s: float = 120
):
    """Dispatch one task, start a runner with `command` as its agent, return the trajectory."""
    dispatch(r, run, [row], deadline_s=deadline_s)
    procs.start("runner", "--agent-cmd", command, "--inference-url", inference_url)
    (traj,) = wait_for(
        lambda: trajectories(r, run), deadline_s + 30, "the framework agent's trajectory", interval=0.3
    )
    return traj


# --- the record -------------------------------------------------------------------------------


def chat_exchanges(record: Path) -> list[dict[str, Any]]:
    """The chat calls of a record, in the order their responses completed."""
    exchanges = json.loads(record.read_text())["exchanges"]
    calls = []
    for exchange in exchanges:
        if exchange["method"] != "POST" or not exchange["path"].endswith("/chat/completions"):
            continue
        assert exchange["status"] == 200, exchange
        streamed = exchange["response"].startswith("data:")
        reply = assemble_sse(exchange["response"]) if streamed else json.loads(exchange["response"])
        calls.append({"agent": agent_of(exchange["path"]), "request": exchange["request"],
                      "message": reply["choices"][0]["message"], "finish_reason": reply["choices"][0]["finish_reason"],
                      "streamed": streamed, "reply": reply})  # fmt: skip
    return calls


def agent_of(path: str) -> str:
    parts = path.strip("/").split("/")
    return parts[parts.index("agent") + 1] if "agent" in parts else "main"


def assemble_sse(text: str) -> dict[str, Any]:
    """A chat.completion.chunk stream folded back into one reply (content and tool calls)."""
    content: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    finish, usage, saw_done = None, None, False
    for line in text.splitlines():
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            saw_done = True
            continue
        chunk = json.loads(data)
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices", []):
            delta = choice.get("delta") or {}
            content.append(delta.get("content") or "")
            for call in delta.get("tool_calls") or []:
                slot = calls.setdefault(call["index"], {"id": "", "function": {"name": "", "arguments": ""}})
                slot["id"] += call.get("id") or ""
                for key in ("name", "arguments"):
                    slot["function"][key] += (call.get("function") or {}).get(key) or ""
            finish = choice.get("finish_reason") or finish
    assert saw_done, "the stream did not end with [DONE]"
    message = {
        "role": "assistant",
        "content": "".join(content),
        "tool_calls": [calls[i] for i in sorted(calls)],
    }
    return {"choices": [{"message": message, "finish_reason": finish}], "usage": usage}


# --- the check --------------------------------------------------------------------------------


def expected_prompt(tokenizer, request: dict[str, Any]) -> tuple[list[int], str, str | None]:
    """(prompt ids, tool_choice prefill, resolved tool_choice) the server makes of `request`."""
    tools = request.get("tools")
    choice = resolve_tool_choice(request.get("tool_choice"), tools)
    messages = normalize_messages(request["messages"])
    messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
    text = tokenizer.apply_chat_template(
        messages, tools=tools if choice else None, add_generation_prompt=True, tokenize=False
    )
    prefix = forced_prefix(choice)
    return tokenizer.encode(text + prefix, add_special_tokens=False), prefix, choice


def tool_calls_of(message: dict[str, Any]) -> list[tuple[str, Any]]:
    return [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in message.get("tool_calls") or []
    ]


def check_token_exact(tokenizer, traj, calls: list[dict[str, Any]]) -> None:
    """Every chat call the framework made is one Turn whose ids are exactly what it sent and got."""
    assert len(traj.turns) == len(calls), (len(traj.turns), [c["request"]["messages"][-1] for c in calls])
    for i, (call, turn) in enumerate(zip(calls, traj.turns, strict=True)):
        where = f"call {i} ({call['agent']})"
        prompt_ids, prefix, choice = expected_prompt(tokenizer, call["request"])
        assert turn.prompt_tokens.tolist() == prompt_ids, where
        text = tokenizer.decode(turn.response_tokens.tolist(), skip_special_tokens=False)
        stopped = text.endswith(EOS)
        text = text.removesuffix(EOS)
        assert stopped == (turn.finish_reason != "length"), (where, turn.finish_reason, text)
        content, parsed = parse_tool_calls(prefix + text) if choice else (text, [])
        if not parsed:
            content = prefix + text
        got = call["message"]
        assert (got.get("content") or "") == (content or ""), where
        assert tool_calls_of(got) == [
            (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed
        ]
        assert call["finish_reason"] == turn.finish_reason, where
        assert turn.agent == call["agent"] and turn.trained and turn.version == 0, where
        assert turn.logprobs.shape == turn.response_tokens.shape and (turn.logprobs <= 0).all(), where


def extends(earlier, later) -> bool:
    """Does `later`'s prompt start with `earlier`'s prompt + response, token for token (so the
    trainer can merge the two turns into one sequence)?"""
    joined = earlier.prompt_tokens.tolist() + earlier.response_tokens.tolist()
    return later.prompt_tokens.tolist()[: len(joined)] == joined


def tool_results(calls: list[dict[str, Any]]) -> list[str]:
    """Contents of the tool messages the framework sent back (the tools it ran)."""
    seen: list[str] = []
    for call in calls:
        for message in call["request"]["messages"]:
            if message["role"] == "tool" and message["content"] not in seen:
                seen.append(message["content"])
    return seen
