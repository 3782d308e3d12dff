"""The agent contract: a Python callable or an external command, and how a reward is obtained.

- Python: `agent(task: dict, llm) -> float | None`, async or sync (a sync agent runs in a
  thread; on its deadline the attempt is a timeout, but Python cannot stop the thread, so a
  sync agent that hangs keeps a worker thread until it returns — prefer async agents).
- Command: a shell command; the task JSON on stdin, OPENAI_BASE_URL / OPENAI_API_KEY /
  OPENAI_MODEL (and ANTHROPIC_BASE_URL / ANTHROPIC_API_KEY, the same endpoint) in its environment, the reward as the last line of stdout (empty: no reward).
  Turn-level rewards: POST `{"reward": x}` to `$AGENT_REWARD_URL` (= `$OPENAI_BASE_URL/reward`).
  It inherits the runner's environment except the `SQUALL_*` variables (Redis credentials,
  API keys). On its deadline its whole process group is killed.
- Resources (shared/resources.py): the versions the task pinned, as `llm.resources[name]`
  (text) and `llm.resource_versions[name]` for a Python agent; for a command,
  AGENT_RESOURCE_<NAME> (upper-cased) holds each text and AGENT_RESOURCES_FILE a JSON file of
  {name: {"version": v, "text": ...}} (removed when the command ends).
- The reward is the agent's return value plus every `llm.emit_reward(x)` it made (each one
  attaches to the model call it follows: turn-level rewards, runner/turn_rewards.py); if it
  did neither, `reward_fn(task, final_answer)` from the config; if still none, or not a finite
  number, the attempt fails with an error saying so — never a silent zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import json
import math
import os
import signal
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from squall.shared.config import agent_name_problem
from squall.shared.errors import AgentError, ConfigError

STDERR_TAIL = 2000  # characters of a failed command's stderr kept in the error
SECRET_ENV_PREFIX = "SQUALL_"  # settings (Redis URL with password, API keys) kept from agent commands


@dataclass
class LLM:
    """What an agent gets to reach the model: an OpenAI-compatible endpoint for this attempt."""

    base_url: str  # e.g. http://127.0.0.1:PORT/a/TOKEN/v1
    model: str  # the policy's model name
    api_key: str  # any non-empty string works; the URL identifies the attempt
    _root: str = ""  # base_url without /v1, for per-agent URLs
    traceparent: str = ""  # W3C traceparent of the attempt's span (tracing on): an agent's own spans join it
    resources: dict[str, str] = field(default_factory=dict)  # name -> text of the pinned version
    resource_versions: dict[str, int] = field(default_factory=dict)  # name -> the version handed out
    _emitted: list[float] = field(
        default_factory=list
    )  # only without _on_reward (an LLM built outside a runner)
    # The runner's hook: attach a reward to the attempt's newest turn (turn_rewards.attach_reward).
    _on_reward: Callable[[float], Any] | None = None

    def agent_url(self, name: str) -> str:
        """Base URL for a named agent (multi-agent tasks): its calls are attributed to `name`.
        ValueError for a name that cannot be one URL segment (config.AGENT_NAME_RULE)."""
        if problem := agent_name_problem(name):
            raise ValueError(f"llm.agent_url: {problem}")
        return f"{self._root}/agent/{name}/v1"

    def emit_reward(self, reward: float) -> None:
        """Reward the model call just made (a turn-level reward); the attempt's reward is the
        sum of these plus what the agent returns. TurnRewardError (a ValueError) for a value
        that is not a finite number, or when no call was made yet."""
        if self._on_reward is not None:
            self._on_reward(reward)
        else:
            self._emitted.append(reward)


def load_callable(spec: str, what: str) -> Callable[..., Any]:
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{what} {spec!r} must look like package.module:function")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{what} {spec!r}: cannot import {module_name}: {exc}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"{what} {spec!r}: {module_name} has no callable {attr!r}")
    return fn


async def call_maybe_async(fn: Callable[..., Any], *args: Any) -> Any:
    if inspect.iscoroutinefunction(fn):
        return await fn(*args)
    result = await asyncio.to_thread(fn, *args)
    if inspect.isawaitable(result):
        return await result
    return result


class PythonAgent:
    def __init__(self, spec: str) -> None:
        self.spec = spec
        self.fn = load_callable(spec, "agent")

    async def __call__(self, payload: dict[str, Any], llm: LLM) -> Any:
        return await call_maybe_async(self.fn, payload, llm)


class CommandAgent:
    def __init__(self, cmd: str) -> None:
        self.spec = cmd
        self.cmd = cmd

    async def __call__(self, payload: dict[str, Any], llm: LLM) -> Any:
        env = {
            **agent_environment(),
            "OPENAI_BASE_URL": llm.base_url,
            "OPENAI_API_KEY": llm.api_key,
            "OPENAI_MODEL": llm.model,
            "AGENT_REWARD_URL": f"{llm.base_url}/reward",  # POST {"reward": x}: a turn-level reward
            **({"TRACEPARENT": llm.traceparent} if llm.traceparent else {}),
            # Anthropic clients (Claude Code, the anthropic SDK) add /v1/messages themselves.
            "ANTHROPIC_BASE_URL": llm.base_url.removesuffix("/v1"),
            "ANTHROPIC_API_KEY": llm.api_key,
            **{f"AGENT_RESOURCE_{name.upper()}": text for name, text in llm.resources.items()},
        }
        with _resources_file(llm) as path:
            if path:
                env["AGENT_RESOURCES_FILE"] = path
            return await self._run(env, payload)

    async def _run(self, env: dict[str, str], payload: dict[str, Any]) -> Any:
        process = await asyncio.create_subprocess_shell(
            self.cmd,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            start_new_session=True,  # its own process group, so a timeout kills its children too
        )
        try:
            out, err = await process.communicate(json.dumps(payload).encode())
        except BaseException:
            with _suppress_lookup():
                os.killpg(process.pid, signal.SIGKILL)
            raise
        if process.returncode != 0:
            tail = err.decode(errors="replace")[-STDERR_TAIL:]
            raise AgentError(f"agent command exited with {process.returncode}: {tail.strip()}")
        lines = [line.strip() for line in out.decode(errors="replace").splitlines() if line.strip()]
        if not lines:
            return None
        try:
            return float(lines[-1])
        except ValueError:
            raise AgentError(
                f"agent command's last stdout line must be the reward (a number), got {lines[-1][:200]!r}"
            ) from None


@contextlib.contextmanager
def _resources_file(llm: LLM) -> Iterator[str]:
    """A JSON file of the attempt's resources for a command agent ("" when it has none)."""
    if not llm.resources:
        yield ""
        return
    body = {n: {"version": llm.resource_versions.get(n, 0), "text": t} for n, t in llm.resources.items()}
    fd, path = tempfile.mkstemp(prefix="squall-resources-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as out:
            json.dump(body, out)
        yield path
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)


def agent_environment() -> dict[str, str]:
    """The runner's environment minus its `SQUALL_*` settings: those hold the Redis URL (with
    its password) and API keys, which agent code — possibly model-written — must not see."""
    return {
        name: value for name, value in os.environ.items() if not name.upper().startswith(SECRET_ENV_PREFIX)
    }


class _suppress_lookup:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> bool:
        return exc[0] is not None and issubclass(exc[0], ProcessLookupError)


def make_agent(agent: str, agent_cmd: str) -> PythonAgent | CommandAgent:
    if bool(agent) == bool(agent_cmd):
        raise ConfigError(
            "give exactly one of --agent module:function and --agent-cmd CMD (runner.agent / runner.agent_cmd)"
        )
    return PythonAgent(agent) if agent else CommandAgent(agent_cmd)


async def resolve_reward(
    returned: Any,
    llm: LLM,
    reward_fn: Callable[..., Any] | None,
    payload: dict[str, Any],
    final_answer: str | None,
    emitted: float | None = None,
) -> float:
    """The attempt's reward, or AgentError saying why there is none. `emitted`: the sum of
    the turn rewards the gateway attached (turn_rewards.emitted_total), None when none."""
    if llm._emitted:
        emitted = (emitted or 0.0) + float(sum(llm._emitted))
    if emitted is not None:  # turn rewards, plus the returned outcome reward if any
        if returned is not None and (isinstance(returned, bool) or not isinstance(returned, int | float)):
            raise AgentError(
                f"reward must be a number, got {type(returned).__name__} {str(returned)[:100]!r}"
            )
        returned = emitted + (float(returned) if returned is not None else 0.0)
    value = returned
    if value is None and reward_fn is not None:
        value = await call_maybe_async(reward_fn, payload, final_answer)
        if value is None:
            raise AgentError("reward_fn returned None: it must return a number")
    if value is None:
        raise AgentError("agent returned no reward (None) and no runner.reward_fn is configured")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise AgentError(f"reward must be a number, got {type(value).__name__} {str(value)[:100]!r}")
    value = float(value)
    if not math.isfinite(value):
        raise AgentError(f"reward is {value}: it must be a finite number")
    return value
