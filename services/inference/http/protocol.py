"""Request bodies of the OpenAI-compatible API, validated, and the errors the API answers.

Unknown fields are ignored (clients send many); fields squall cannot honour are rejected
with a message naming them, never silently dropped.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

MAX_STOP_STRINGS = 16


class ApiError(Exception):
    """An error answered as OpenAI does: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # squall / vLLM extra body fields
    return_token_ids: bool = False
    ignore_eos: bool = False

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
            raise ValueError(f"stop must be at most {MAX_STOP_STRINGS} non-empty strings")
        return value

    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def unsupported(self) -> str | None:
        """The first field set to something squall cannot do, or None."""
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                return name
        return None


class ChatRequest(_Sampling):
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[Any] | None = None
    tool_choice: Any = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=0)
    max_completion_tokens: int | None = Field(None, ge=1)

    @field_validator("messages")
    @classmethod
    def _messages(cls, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for i, message in enumerate(messages):
            role = message.get("role")
            if role not in ("system", "developer", "user", "assistant", "tool"):
                raise ValueError(f"messages[{i}].role must be system, user, assistant or tool, got {role!r}")
            content = message.get("content")
            if content is not None and not isinstance(content, (str, list)):
                raise ValueError(f"messages[{i}].content must be a string or a list of text parts")
            if isinstance(content, list):
                for part in content:
                    if (
                        not isinstance(part, dict)
                        or part.get("type") != "text"
                        or not isinstance(part.get("text"), str)
                    ):
                        raise ValueError(f"messages[{i}].content: only text parts are supported")
        return messages


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=1)  # 0/1/true: the sampled token's logprob
    # vLLM's field: 0 gives each prompt token's own logprob (no alternatives), in
    # choices[i].prompt_logprobs as [None, {"<id>": {"logprob", "rank", "decoded_token"}}, ...].
    prompt_logprobs: int | None = Field(None, ge=0, le=0)
    echo: Literal[False] = False
    suffix: None = None

    def single_prompt(self) -> str | list[int]:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ApiError(400, "one prompt per request: send several requests instead", param="prompt")
            prompt = prompt[0]
        if not prompt:
            raise ApiError(400, "prompt is empty", param="prompt")
        return prompt


def parse(model: type[BaseModel], body: Any) -> Any:
    """Validate a decoded JSON body; a bad field is a 400 naming it."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"]) or "body"
        got = error.get("input")
        shown = "" if isinstance(got, (dict, list)) else f" (got {got!r})"
        raise ApiError(400, f"{where}: {error['msg']}{shown}", param=where) from None
