"""The editor: the model APO asks for critiques and rewrites, at any OpenAI-compatible endpoint.

One `chat` is one POST to `{base_url}/chat/completions`. Every call, answered or not, is
recorded on the run's `optimizer:calls` stream (an `Event` named `editor_call` with the
messages, the reply, the seconds and the error) and counted. A call that fails (connection
refused, an HTTP error, a body that is not a chat completion, a reply `parse` cannot use) is
retried with a growing pause until `deadline_s` has passed since the first try; then
`EditorUnavailable` says what the last failure was, and the caller keeps its current prompt.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx
import redis

from squall.shared import bus, schemas
from squall.shared.keys import Keys

CALLS_MAXLEN = 100_000
RECORDED_CHARS = 20_000  # of each message and reply kept in the call record
FIRST_PAUSE_S = 0.5
MAX_PAUSE_S = 10.0
T = TypeVar("T")


class EditorUnavailable(RuntimeError):
    """The editor gave no usable answer before the deadline."""


class EditorGarbage(ValueError):
    """The editor answered, but not with what was asked for (raised by a `parse` function)."""


@dataclass
class Editor:
    base_url: str
    model: str
    r: redis.Redis
    keys: Keys
    api_key: str = ""
    timeout_s: float = 60.0
    deadline_s: float = 300.0
    temperature: float = 0.7
    max_tokens: int = 512
    log: Any = None
    counts: dict[str, int] = field(default_factory=lambda: {"calls": 0, "failures": 0})

    def chat(self, purpose: str, messages: list[dict[str, str]], parse: Callable[[str], T]) -> T:
        """The editor's reply to `messages`, passed through `parse` (which raises EditorGarbage
        for a reply it cannot use); retried until the deadline, then EditorUnavailable."""
        started, pause, last = time.monotonic(), FIRST_PAUSE_S, ""
        while True:
            began, reply = time.monotonic(), ""
            try:
                reply = self._request(messages)
                result = parse(reply)
                self._record(purpose, messages, reply, time.monotonic() - began, "")
                return result
            except (httpx.HTTPError, EditorGarbage) as exc:
                last = f"{type(exc).__name__}: {exc}"[:500]
                self.counts["failures"] += 1
                self._record(purpose, messages, reply, time.monotonic() - began, last)
                if self.log is not None:
                    self.log.warning("editor_failed", purpose=purpose, error=last, retry_in_s=pause)
            if time.monotonic() - started + pause > self.deadline_s:
                raise EditorUnavailable(
                    f"editor at {self.base_url} gave no usable {purpose} within {self.deadline_s:.0f}s: {last}"
                )
            time.sleep(pause)
            pause = min(pause * 2, MAX_PAUSE_S)

    def _request(self, messages: list[dict[str, str]]) -> str:
        self.counts["calls"] += 1
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        body = {
            "model": self.model,
            "messages": messages,
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
        }
        response = httpx.post(
            f"{self.base_url.rstrip('/')}/chat/completions",
            json=body,
            headers=headers,
            timeout=self.timeout_s,
        )
        response.raise_for_status()
        try:
            reply = response.json()["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise EditorGarbage(
                f"not a chat completion: {response.text[:200]!r} ({type(exc).__name__})"
            ) from None
        if not isinstance(reply, str):
            raise EditorGarbage(f"message content is {type(reply).__name__}, not text")
        return reply

    def _record(
        self, purpose: str, messages: list[dict[str, str]], reply: str, seconds: float, error: str
    ) -> None:
        event = schemas.Event(
            run=self.keys.run,
            service="optimizer",
            name="editor_call",
            fields={
                "purpose": purpose,
                "model": self.model,
                "url": self.base_url,
                "messages": [{**m, "content": m["content"][:RECORDED_CHARS]} for m in messages],
                "reply": reply[:RECORDED_CHARS],
                "seconds": round(seconds, 4),
                "error": error,
            },
        )
        try:
            bus.publish(self.r, self.keys.optimizer_calls, event, maxlen=CALLS_MAXLEN)
        except redis.RedisError as exc:  # the record is for people; the optimisation goes on
            if self.log is not None:
                self.log.warning("editor_call_not_recorded", error=str(exc))
