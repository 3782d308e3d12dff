"""The runner's local LLM gateway: an OpenAI-compatible endpoint per attempt, on loopback.

Each attempt gets its own base URL, ``http://127.0.0.1:PORT/a/{token}/v1`` (and one per named
agent, ``/a/{token}/agent/{name}/v1``), so every call is attributed to its rollout. A call:
1. is routed: a model named in `frozen_models` goes to its own endpoint (recorded, never
   trained); anything else goes to the policy pool — least-loaded node, then sticky for the
   rest of the attempt (prefix caching);
2. is forwarded with `return_token_ids: true, logprobs: true` (and `stream: false`: a
   streaming agent gets the answer re-emitted as SSE chunks);
3. becomes a Turn (prompt ids, sampled ids, logprobs, weight version, node, latency) exactly
   as the server sampled it — never re-tokenized;
4. returns to the agent as an ordinary OpenAI response: squall's extra fields are removed
   (logprobs too, unless the agent asked for them).
Anthropic Messages (`/v1/messages`) and OpenAI Responses (`/v1/responses`) calls are translated
to one chat call by `protocols/` and take the same path. Each trained Turn says whether its
prompt `extends` the agent's previous call token for token; breaks and context overflows are
counted (an overflow fails the attempt).
Upstream failures (connection errors, 5xx, 429) are retried with backoff, on another node
when there is one; then the agent gets a 502 whose message says what failed (and, for a
frozen model, which `frozen_models` endpoint is down).

A policy call is never served by a node below the task's `min_version`: a node known to be
behind (from its last reply, or its /health) is passed over; when every node is behind (all
restarting or still loading the version), the call waits up to `runner.behind_wait_s`,
polling their /health. A reply that comes back from an older version is discarded and the
call tried again. A policy call that fails for good marks the attempt with an infrastructure
reason (`Attempt.infra`: connection, http, behind): the runner reports it on the trajectory
and the scheduler retries it without charging the agent's `max_attempts`.

Seats (multi-agent tasks): with `runner.seats` set, only those agent names are served. With
`opponent_fraction` > 0, each attempt hands that share of the seats to `opponent_model`
(`opponent_seats`, a draw seeded by the GRPO group, so a group's members face the same
line-up): whatever model such a seat asks for, its calls go to the opponent's endpoint and are
recorded with the opponent's name and `trained=False`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import random
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import Counter

from squall.runner import continuity
from squall.runner.protocols import anthropic_messages, openai_responses
from squall.runner.turn_rewards import TurnRewardError, attach_reward
from squall.shared.config import AGENT_NAME_RULE, RunnerSection, agent_name_problem
from squall.shared.logs import get_logger
from squall.shared.roles import DEFAULT_ROLE, split_model
from squall.shared.schemas import Turn, pack_logprobs, pack_tokens

RETRY_BACKOFF_S = 0.1  # first retry delay; doubles per retry
CONTINUITY_BREAKS = Counter(
    "squall_gateway_continuity_breaks",
    "Trained calls whose prompt did not extend the same agent's previous prompt + response token for token",
)
CONTEXT_OVERFLOWS = Counter(
    "squall_gateway_context_overflows",
    "Calls refused because prompt + max_tokens exceeded the model's context",
)
RETRYABLE_STATUS = {429, 500, 502, 503, 504}


@dataclass
class Attempt:
    """What the gateway knows about one running attempt."""

    token: str  # secret path segment of its base URL
    key: str  # task_id#attempt, for logs
    turns: list[Turn] = field(default_factory=list)  # every recorded call, in call order
    node: str | None = None  # the policy node this attempt sticks to
    final_answer: str | None = None  # text of the last assistant message returned
    error: str | None = None  # a contract break seen by the gateway (fails the attempt)
    llm_s: float = 0.0  # seconds spent waiting for inference
    call_starts: list[float] = field(default_factory=list)  # unix time each turn's call began (for tracing)
    trace_parent: Callable[[int], str] | None = None  # tracing on: turn index -> `traceparent` sent upstream
    min_version: int = 0  # the task's min_version: no policy turn is served by older weights
    infra: str = ""  # a policy call failed for good, and why (schemas.INFRA_REASONS); "" if none did
    waiting: int = 0  # policy calls waiting on inference right now
    seat_models: dict[str, str] = field(default_factory=dict)  # seat -> opponent model playing it
    # Per-protocol memory of this attempt (Responses: response id -> the conversation it ends).
    protocol_state: dict[str, Any] = field(default_factory=dict)
    context_overflows: int = 0  # calls refused because prompt (+ max_tokens) exceeded the context
    continuity_breaks: int = 0  # trained calls whose prompt did not extend the agent's last call


def group_of(key: str) -> str:
    """The GRPO group of an attempt key ``{group_id}:{index}#{attempt}``."""
    task_id = key.rpartition("#")[0] or key
    return task_id.rpartition(":")[0] or task_id


def opponent_seats(seats: list[str], fraction: float, group_id: str) -> list[str]:
    """The seats the opponent plays in this group's attempts: round(fraction x seats) of them,
    drawn with a seed derived from the group id alone (every member, retry and runner agrees)."""
    count = int(fraction * len(seats) + 0.5)
    seed = int.from_bytes(hashlib.blake2b(group_id.encode(), digest_size=8).digest(), "little")
    chosen = set(random.Random(seed).sample(seats, count))
    return [seat for seat in seats if seat in chosen]


class UpstreamError(Exception):
    """Inference could not answer after every retry; `reason` is one of schemas.INFRA_REASONS."""

    def __init__(self, message: str, reason: str = "connection") -> None:
        super().__init__(message)
        self.reason = reason


BEHIND_POLL_S = 0.5  # how often every node's /health is asked while all are behind


class Pool:
    """Policy inference nodes: those already serving the attempt's `min_version` first (as far
    as their last reply showed), then the fewest in-flight calls, ties broken by order."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = [u.rstrip("/") for u in urls]
        self.inflight = dict.fromkeys(self.urls, 0)
        self.versions = dict.fromkeys(self.urls, -1)  # weight version of each node's last reply

    def behind(self, url: str, min_version: int) -> bool:
        return 0 <= self.versions[url] < min_version

    def pick(self, exclude: set[str] = frozenset(), min_version: int = 0) -> str:  # type: ignore[assignment]
        candidates = [u for u in self.urls if u not in exclude] or self.urls
        return min(candidates, key=lambda u: (self.behind(u, min_version), self.inflight[u]))


def _v1(base: str) -> str:
    base = base.rstrip("/")
    return base if base.endswith("/v1") else f"{base}/v1"


class Gateway:
    def __init__(
        self, section: RunnerSection, policy_model: str, agent_roles: dict[str, str] | None = None
    ) -> None:
        self.section, self.policy_model = section, policy_model
        # Several trained roles (shared.roleplan): agent name -> the role whose adapter serves
        # and trains its calls; None: the single-policy run (`train_agents` says what trains).
        self.agent_roles = agent_roles
        self.pool = Pool(section.inference_urls)
        self.frozen = {name: _v1(url) for name, url in section.frozen_models.items()}
        self.train_agents = set(section.train_agents)
        self.attempts: dict[str, Attempt] = {}
        self.log = get_logger(component="gateway")
        headers = {"authorization": f"Bearer {section.api_key}"} if section.api_key else {}
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
        self.client = httpx.AsyncClient(
            headers=headers, limits=limits, timeout=httpx.Timeout(section.upstream_timeout_s, connect=5.0)
        )
        self.port = 0
        self.calls = 0
        self.context_overflows = 0  # over all attempts, see Attempt.context_overflows
        self.continuity_breaks = 0  # over all attempts, see Attempt.continuity_breaks
        self.app = self._build_app()
        self._server: Any = None
        self._serve_task: asyncio.Task | None = None

    # --- attempts ------------------------------------------------------------------------
    def open(self, key: str, min_version: int = 0, group_id: str | None = None) -> Attempt:
        """A new attempt `key` of group `group_id` (default: read from the key, for callers
        that have no Task at hand)."""
        attempt = Attempt(token=secrets.token_hex(12), key=key, min_version=min_version)
        section = self.section
        if section.opponent_fraction > 0:
            group = group_id if group_id is not None else group_of(key)
            seats = opponent_seats(section.seats, section.opponent_fraction, group)
            attempt.seat_models = dict.fromkeys(seats, section.opponent_model)
        self.attempts[attempt.token] = attempt
        return attempt

    def close(self, token: str) -> Attempt | None:
        return self.attempts.pop(token, None)

    def base_url(self, token: str, agent: str | None = None) -> str:
        host = self.section.gateway_host
        suffix = f"/agent/{agent}" if agent else ""
        return f"http://{host}:{self.port}/a/{token}{suffix}/v1"

    # --- server ----------------------------------------------------------------------------
    async def start(self) -> int:
        """Serve on the running event loop; returns the port."""
        import uvicorn

        class _QuietServer(uvicorn.Server):
            # The runner owns SIGTERM; uvicorn must not install its own handlers.
            @contextlib.contextmanager
            def capture_signals(self):  # type: ignore[override]
                yield

            def install_signal_handlers(self) -> None:
                pass

        config = uvicorn.Config(
            self.app,
            host=self.section.gateway_host,
            port=self.section.gateway_port,
            log_level="warning",
            access_log=False,
            lifespan="off",
        )
        self._server = _QuietServer(config)
        self._serve_task = asyncio.create_task(self._server.serve())
        for _ in range(500):
            if self._server.started:
                break
            if self._serve_task.done():
                self._serve_task.result()
            await asyncio.sleep(0.01)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._serve_task, 5)  # type: ignore[arg-type]
        await self.client.aclose()

    def _build_app(self) -> FastAPI:
        # Plain Starlette routes (request -> response): no per-call dependency resolution.
        app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)

        async def chat(request: Request) -> Response:
            params = request.path_params
            return await self._forward(
                request, params["token"], params.get("agent", "main"), "chat/completions"
            )

        async def completions(request: Request) -> Response:
            params = request.path_params
            return await self._forward(request, params["token"], params.get("agent", "main"), "completions")

        async def messages(request: Request) -> Response:
            return await anthropic_messages.handle(request, self._protocol_call(request))

        async def responses(request: Request) -> Response:
            return await openai_responses.handle(request, self._protocol_call(request))

        async def models(request: Request) -> Response:
            if request.path_params["token"] not in self.attempts:
                return _error(
                    404, "this attempt is over (or never existed): its base URL is no longer served"
                )
            names = [self.policy_model, *self.frozen]
            data = [{"id": n, "object": "model", "created": 0, "owned_by": "squall"} for n in names]
            return Response(orjson.dumps({"object": "list", "data": data}), media_type="application/json")

        async def health(request: Request) -> Response:
            return Response(
                orjson.dumps({"status": "ok", "attempts": len(self.attempts)}), media_type="application/json"
            )

        async def unrouted(request: Request) -> Response:
            return _error(404, _unrouted_message(request))

        async def reward(request: Request) -> Response:
            return await self._reward(request, request.path_params["token"])

        for prefix in ("/a/{token}/v1", "/a/{token}/agent/{agent}/v1"):
            app.router.add_route(f"{prefix}/chat/completions", chat, methods=["POST"])
            app.router.add_route(f"{prefix}/completions", completions, methods=["POST"])
            app.router.add_route(f"{prefix}/models", models, methods=["GET"])
            app.router.add_route(f"{prefix}/messages", messages, methods=["POST"])
            app.router.add_route(f"{prefix}/responses", responses, methods=["POST"])
            app.router.add_route(f"{prefix}/reward", reward, methods=["POST"])
        app.router.add_route("/health", health, methods=["GET"])
        # Last: whatever matched no route above gets an error saying why, not a bare 404.
        app.router.add_route("/{rest:path}", unrouted, methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
        return app

    async def _reward(self, request: Request, token: str) -> Response:
        """POST .../v1/reward {"reward": x}: a command agent's llm.emit_reward(x). A bad value,
        or one before any call, answers 400 saying why; the attempt goes on."""
        attempt = self.attempts.get(token)
        if attempt is None:
            return _error(404, "this attempt is over (or never existed): its base URL is no longer served")
        where = "POST /v1/reward"
        try:
            body = orjson.loads(await request.body())
        except orjson.JSONDecodeError:
            return _error(400, f'{where}: the body must be JSON like {{"reward": 1.0}}')
        if not isinstance(body, dict) or "reward" not in body:
            return _error(400, f'{where}: the body must be a JSON object with a "reward" number')
        try:
            turn = attach_reward(attempt.turns, body["reward"], where)
        except TurnRewardError as exc:
            return _error(400, str(exc))
        return Response(
            orjson.dumps({"turn": turn, "turn_reward": attempt.turns[turn].reward}),
            media_type="application/json",
        )

    # --- one call --------------------------------------------------------------------------
    def _protocol_call(self, request: Request) -> ProtocolCall:
        """What a protocol handler (protocols/) needs: the attempt's memory and a chat forward."""
        params = request.path_params
        token, agent = params["token"], params.get("agent", "main")
        attempt = self.attempts.get(token)

        async def forward(body: dict) -> Response:
            return await self._forward(request, token, agent, "chat/completions", body=body)

        return ProtocolCall(forward, attempt.protocol_state if attempt else None)

    async def _forward(
        self, request: Request, token: str, agent: str, route: str, body: dict | None = None
    ) -> Response:
        """One call on `route`; `body` is the request already decoded (and translated from
        another protocol), else the request's own JSON body."""
        attempt = self.attempts.get(token)
        if attempt is None:
            return _error(404, "this attempt is over (or never existed): its base URL is no longer served")
        body = await self._request_body(request, agent, body)
        if isinstance(body, Response):
            return body
        asked_model = str(body.get("model") or self.policy_model)
        model = attempt.seat_models.get(agent, asked_model)  # an opponent seat plays the opponent
        frozen_url = self.frozen.get(model)
        if frozen_url is not None:
            body["model"] = model
        wants_stream = bool(body.pop("stream", False))
        include_usage = bool((body.pop("stream_options", None) or {}).get("include_usage"))
        wants_logprobs = body.get("logprobs")
        role, pinned = self._role_of(agent, asked_model) if frozen_url is None else (None, False)
        if frozen_url is None:
            body["model"] = asked_model if pinned else role or self.policy_model
            body["return_token_ids"] = True
            body["logprobs"] = True
        started = time.perf_counter()
        attempt.waiting += frozen_url is None
        try:
            status, reply, node = await self._post(attempt, route, body, frozen_url, model)
        except UpstreamError as exc:
            attempt.llm_s += time.perf_counter() - started
            if frozen_url is None:
                attempt.infra = exc.reason
            self.log.warning("upstream_failed", attempt=attempt.key, reason=exc.reason, error=str(exc))
            return _error(502, str(exc), kind="upstream_unavailable")
        finally:
            attempt.waiting -= frozen_url is None
        latency = time.perf_counter() - started
        attempt.llm_s += latency
        if status != 200:
            return self._refused(attempt, agent, status, reply)
        try:
            self._record(
                attempt,
                reply,
                agent,
                model,
                node,
                latency,
                trained_model=frozen_url is None and not pinned,
                role=role,
            )
        except (KeyError, TypeError, ValueError) as exc:
            attempt.error = f"inference reply from {node} broke the token-id contract: {exc}"
            return _error(502, attempt.error, kind="upstream_contract")
        self.calls += 1
        _strip(reply, keep_logprobs=bool(wants_logprobs))
        reply["model"] = asked_model
        if wants_stream:
            return StreamingResponse(_sse(reply, route, include_usage), media_type="text/event-stream")
        return Response(orjson.dumps(reply), media_type="application/json")

    def _role_of(self, agent: str, asked_model: str) -> tuple[str | None, bool]:
        """(the role serving `agent`'s policy call, whether the agent pinned a snapshot). With
        roles, an agent that asks for `role@version` gets exactly that snapshot, never trained
        (a league opponent, or the warm start `role@0`); any other call of a seat is sent with
        model = its role; an agent no role covers is served the base, untrained."""
        if self.agent_roles is None:
            return None, False
        try:
            pinned_role, version = split_model(asked_model)
        except ValueError:
            pinned_role, version = asked_model, None
        if version is not None and pinned_role in self.agent_roles.values():
            return pinned_role, True
        return self.agent_roles.get(agent), False

    async def _request_body(self, request: Request, agent: str, body: dict | None) -> dict | Response:
        """The call's JSON object (`body` when another protocol already decoded it), or the
        error response that names what is wrong with the request or the agent URL."""
        if body is None:
            try:
                body = orjson.loads(await request.body())
            except orjson.JSONDecodeError as exc:
                return _error(400, f"request body is not JSON: {exc}")
        if not isinstance(body, dict):
            return _error(400, "request body must be a JSON object")
        if agent != "main" and (problem := agent_name_problem(agent)):
            return _error(400, f"{problem}; build the URL with llm.agent_url(name)")
        if self.section.seats and agent != "main" and agent not in self.section.seats:
            return _error(
                404,
                f"agent {agent!r} is not one of runner.seats {self.section.seats}; "
                "use one of those names in the agent URL, or add the seat",
            )
        return body

    def _role_unknown(self, response: httpx.Response, pinned: bool) -> bool:
        """A role the node has not heard of yet (its first version is still on its way from the
        trainer): the infrastructure is behind, not the agent wrong. A missing version of a role
        the node serves (`pinned`: the node answers "version N of role R is not available") is
        the agent's error and goes back to it."""
        return (
            response.status_code == 404
            and self.agent_roles is not None
            and b"model_not_found" in response.content
            and (not pinned or b"is not served here" in response.content)
        )

    def _served_behind(self, reply: Any, base: str, need: int) -> str | None:
        """Why a policy reply from an older version than `need` is discarded (e.g. the node
        restarted on older weights), or None. Notes the node's version (single policy only:
        with roles each reply carries its own role's)."""
        if not isinstance(reply, dict) or "weight_version" not in reply:
            return None
        served = int(reply["weight_version"])
        if self.agent_roles is None:
            self.pool.versions[base] = served
        return f"{base}: served version {served}, the task needs {need}" if 0 <= served < need else None

    async def _post(
        self, attempt: Attempt, route: str, body: dict, frozen_url: str | None, model: str
    ) -> tuple[int, dict, str]:
        """POST with retries; returns (status, json, node url). Raises UpstreamError."""
        payload = orjson.dumps(body)
        # A pinned snapshot (`role@version`, [roles] runs) is old on purpose: the task's
        # min_version does not apply to it, and its reply says nothing about the node's newest.
        pinned = self.agent_roles is not None and "@" in str(body.get("model", ""))
        need = 0 if pinned else attempt.min_version  # the reply's own version must reach this
        # With roles, a node's /health and replies each carry one role's version (or the base's),
        # so one number per node cannot say whether it is behind for this call's role: only the
        # reply's own version is checked.
        pool_need = 0 if self.agent_roles is not None else need
        tried: set[str] = set()
        errors: list[str] = []
        reason = "connection"
        for retry in range(self.section.upstream_retries + 1):
            if retry:
                await asyncio.sleep(RETRY_BACKOFF_S * 2 ** (retry - 1))
            if frozen_url is not None:
                base = frozen_url
            else:
                await self._await_version(pool_need)
                sticky = attempt.node if attempt.node and attempt.node not in tried else None
                if sticky and self.pool.behind(sticky, pool_need):
                    sticky = None  # a node that caught up beats the prefix cache
                base = sticky or self.pool.pick(tried, pool_need)
                attempt.node = base
                self.pool.inflight[base] += 1
            headers = {"content-type": "application/json"}
            if attempt.trace_parent is not None:  # the call's span (tracking/otel.py): its spans join it
                headers["traceparent"] = attempt.trace_parent(len(attempt.turns))
            try:
                response = await self.client.post(f"{_v1(base)}/{route}", content=payload, headers=headers)
            except httpx.HTTPError as exc:
                errors.append(f"{base}: {type(exc).__name__} {exc}".strip())
                tried.add(base)
                reason = "connection"
                continue
            finally:
                if frozen_url is None:
                    self.pool.inflight[base] -= 1
            if response.status_code in RETRYABLE_STATUS:
                errors.append(f"{base}: HTTP {response.status_code} {response.text[:200]}")
                tried.add(base)
                reason = "http"
                continue
            if self._role_unknown(response, pinned):
                errors.append(f"{base}: HTTP 404 {response.text[:200]}")
                reason = "behind"
                continue
            try:
                reply = orjson.loads(response.content)
            except orjson.JSONDecodeError:
                errors.append(f"{base}: HTTP {response.status_code} with a non-JSON body")
                tried.add(base)
                reason = "http"
                continue
            behind = None if frozen_url is not None or pinned else self._served_behind(reply, base, need)
            if behind:
                errors.append(behind)
                reason = "behind"
                continue
            return response.status_code, reply, base
        where = (
            f"the endpoint of frozen model {model!r} in runner.frozen_models ({frozen_url}) is up"
            if frozen_url is not None
            else "the inference nodes in runner.inference_urls are up"
        )
        raise UpstreamError(
            f"inference failed {len(errors)} time(s) for route /v1/{route}: {'; '.join(errors[-3:])}"
            f" — check that {where}",
            reason,
        )

    async def _await_version(self, min_version: int) -> None:
        """Return once some policy node is not known to be behind `min_version`; while every
        node is, poll their /health. UpstreamError (reason behind) past runner.behind_wait_s."""
        if not all(self.pool.behind(url, min_version) for url in self.pool.urls):
            return
        deadline = time.monotonic() + self.section.behind_wait_s
        while True:
            for url in self.pool.urls:
                try:
                    reply = await self.client.get(f"{url.removesuffix('/v1')}/health", timeout=2.0)
                    self.pool.versions[url] = int(reply.json()["weight_version"])
                except (httpx.HTTPError, ValueError, KeyError, TypeError):
                    continue  # a node still starting: its last known version stands
            if not all(self.pool.behind(url, min_version) for url in self.pool.urls):
                return
            if time.monotonic() >= deadline:
                versions = ", ".join(f"{u}={v}" for u, v in self.pool.versions.items())
                raise UpstreamError(
                    f"no policy node served version >= {min_version} within runner.behind_wait_s="
                    f"{self.section.behind_wait_s}s (last seen: {versions}); check that the nodes "
                    "follow the weights stream (inference.follow_weights) and can load the newest version",
                    "behind",
                )
            await asyncio.sleep(BEHIND_POLL_S)

    def _record(
        self,
        attempt: Attempt,
        reply: dict,
        agent: str,
        model: str,
        node: str,
        latency: float,
        *,
        trained_model: bool,
        role: str | None = None,
    ) -> None:
        """One Turn per choice, from the ids and logprobs the server sampled."""
        if self.agent_roles is None:
            trained = trained_model and (not self.train_agents or agent in self.train_agents)
        else:  # with roles: a seat's own role's call trains that role
            trained = trained_model and role is not None
        version = int(reply["weight_version"]) if "weight_version" in reply else -1
        top_prompt = reply.get("prompt_token_ids")
        node_id = str(reply.get("node") or node)
        for choice in reply["choices"]:
            prompt = choice.get("prompt_token_ids", top_prompt)
            ids = choice.get("token_ids")
            logprobs = _logprobs_of(choice.get("logprobs"))
            if trained_model and (prompt is None or ids is None or logprobs is None):
                raise ValueError("a policy reply must carry prompt_token_ids, token_ids and logprobs")
            if ids is not None and logprobs is not None and len(ids) != len(logprobs):
                raise ValueError(f"{len(ids)} token ids but {len(logprobs)} logprobs")
            if ids is None or logprobs is None:  # a frozen endpoint without both: text only
                ids, logprobs = None, None  # the version stays when it said (a snapshot node)
            attempt.call_starts.append(time.time() - latency)
            attempt.turns.append(
                Turn(
                    agent=agent,
                    model=model,
                    trained=trained,
                    prompt_ids=pack_tokens(prompt or []),
                    response_ids=pack_tokens(ids or []),
                    response_logprobs=pack_logprobs(logprobs if ids is not None and logprobs else []),
                    version=version,
                    finish_reason=str(choice.get("finish_reason") or "stop"),
                    node=node_id,
                    latency_s=latency,
                    role=role or DEFAULT_ROLE,
                )
            )
        self._check_continuity(attempt, agent)
        first = reply["choices"][0] if reply["choices"] else {}
        message = first.get("message")
        attempt.final_answer = message.get("content") if isinstance(message, dict) else first.get("text")

    def _refused(self, attempt: Attempt, agent: str, status: int, reply: Any) -> Response:
        """The server's error, passed on; a context overflow is counted and fails the attempt
        with the server's message (whatever the agent does next, its conversation was cut short)."""
        if _is_overflow(reply):
            self._overflowed(attempt, agent, reply)
        return Response(orjson.dumps(reply), status_code=status, media_type="application/json")

    def _overflowed(self, attempt: Attempt, agent: str, reply: dict) -> None:
        attempt.context_overflows += 1
        self.context_overflows += 1
        CONTEXT_OVERFLOWS.inc()
        message = str(reply["error"].get("message"))
        self.log.warning(
            "context_overflow",
            attempt=attempt.key,
            agent=agent,
            error=message,
            overflows=attempt.context_overflows,
        )
        if attempt.error is None:
            attempt.error = f"context overflow: a call of agent {agent!r} was refused: {message}"

    def _check_continuity(self, attempt: Attempt, agent: str) -> None:
        """Mark the last Turn `extends` (its prompt continues this agent's previous trained call
        prompt + response token for token) or count and log the break: a client that rewrote or
        re-rendered its history. The trainer then starts a new sample rather than merging."""
        broken = continuity.mark_last(attempt.turns)
        if broken is None:
            return
        attempt.continuity_breaks += 1
        self.continuity_breaks += 1
        CONTINUITY_BREAKS.inc()
        self.log.info(
            "token_continuity_break",
            attempt=attempt.key,
            agent=agent,
            turn=len(attempt.turns) - 1,
            first_diff=broken[0],
            history_tokens=broken[1],
            prompt_tokens=len(attempt.turns[-1].prompt_ids) // 4,
            breaks=attempt.continuity_breaks,
        )


@dataclass(frozen=True)
class ProtocolCall:
    """A protocol handler's view of one gateway call."""

    forward: Any  # async (chat-completions body) -> Response, recorded like any chat call
    state: dict[str, Any] | None  # the attempt's protocol memory; None when the attempt is over


def _is_overflow(reply: Any) -> bool:
    error = reply.get("error") if isinstance(reply, dict) else None
    return isinstance(error, dict) and error.get("code") == "context_length_exceeded"


def _logprobs_of(block: Any) -> list[float] | None:
    """Sampled-token logprobs from either OpenAI shape (chat `content` or legacy `token_logprobs`)."""
    if not isinstance(block, dict):
        return None
    if block.get("content") is not None:
        return [float(item["logprob"]) for item in block["content"]]
    if block.get("token_logprobs") is not None:
        return [float(x) for x in block["token_logprobs"]]
    return None


def _strip(reply: dict, *, keep_logprobs: bool) -> None:
    """Remove what squall added so the agent sees an ordinary OpenAI response."""
    for name in ("weight_version", "node", "prompt_token_ids"):
        reply.pop(name, None)
    for choice in reply.get("choices", []):
        choice.pop("prompt_token_ids", None)
        choice.pop("token_ids", None)
        if not keep_logprobs:
            choice["logprobs"] = None


ROUTES = "/a/TOKEN/v1/{chat/completions,completions,messages,responses,models,reward} and /a/TOKEN/agent/NAME/v1/..."


def _unrouted_message(request: Request) -> str:
    """Why a request matched no route: most often an agent name that is not one URL segment
    (`team/a` adds a segment, `a?b` starts a query string, an empty name leaves `//`)."""
    path = request.url.path
    query = f"?{request.url.query}" if request.url.query else ""
    said = f"no route for {request.method} {path}{query}: the gateway serves {ROUTES}"
    head, sep, tail = path.partition("/agent/")
    if sep and head.startswith("/a/"):
        name = tail.removesuffix("/").rsplit("/v1", 1)[0] if "/v1" in tail else tail
        if query and "/v1" not in tail:  # the name held a '?': the rest of it is in the query
            name = f"{name}?{request.url.query.split('/v1')[0]}"
        said += f"; the agent name here reads {name!r}, and an agent name must be {AGENT_NAME_RULE}"
    return said


def _error(status: int, message: str, kind: str = "invalid_request_error") -> Response:
    body = {"error": {"message": message, "type": kind, "code": status}}
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


async def _sse(reply: dict, route: str, include_usage: bool) -> AsyncIterator[bytes]:
    """A complete reply re-emitted as OpenAI stream chunks."""
    base = {
        "id": reply.get("id", ""),
        "created": reply.get("created", int(time.time())),
        "model": reply.get("model"),
    }
    chat = route == "chat/completions"
    base["object"] = "chat.completion.chunk" if chat else "text_completion"
    for choice in reply.get("choices", []):
        index = choice.get("index", 0)
        if chat:
            message = dict(choice.get("message") or {})
            delta: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
            if message.get("reasoning_content") is not None:
                delta["reasoning_content"] = message["reasoning_content"]
            if message.get("tool_calls"):
                delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
            first = {
                "index": index,
                "delta": delta,
                "finish_reason": None,
                "logprobs": choice.get("logprobs"),
            }
            last = {"index": index, "delta": {}, "finish_reason": choice.get("finish_reason")}
        else:
            first = {
                "index": index,
                "text": choice.get("text", ""),
                "finish_reason": None,
                "logprobs": choice.get("logprobs"),
            }
            last = {"index": index, "text": "", "finish_reason": choice.get("finish_reason")}
        yield b"data: " + orjson.dumps({**base, "choices": [first]}) + b"\n\n"
        yield b"data: " + orjson.dumps({**base, "choices": [last]}) + b"\n\n"
    if include_usage and reply.get("usage"):
        yield b"data: " + orjson.dumps({**base, "choices": [], "usage": reply["usage"]}) + b"\n\n"
    yield b"data: [DONE]\n\n"
