"""Every wire message, declared once, typed and versioned.

Wire format: msgpack (via msgspec, which validates types while decoding). A stream entry
holds one field, ``m``, whose value is one encoded message. Each message carries a ``kind``
tag (so any entry decodes without knowing its stream) and ``v``, the schema version.

Token ids and logprobs are packed little-endian binary (int32 / float32) rather than msgpack
lists: a 32k-token trajectory then encodes and decodes in microseconds instead of
milliseconds (numbers in docs/bus.md). Arrays line up index for index:
``response_ids[i]`` was sampled with log-probability ``response_logprobs[i]``.
"""

from __future__ import annotations

import math
import time
from typing import Any, Literal

import msgspec
import numpy as np

from .errors import SchemaError

SCHEMA_VERSION = 1
ENTRY_FIELD = b"m"

TOKEN_DTYPE = np.dtype("<i4")
LOGPROB_DTYPE = np.dtype("<f4")

Mode = Literal["train", "val"]
# Why an attempt failed for the infrastructure's sake, not the agent's (Trajectory.infra):
# connection (no node took the call), http (every node answered 5xx/429), behind (no node
# served the task's min_version before runner.behind_wait_s), deadline (the attempt's
# deadline passed while a policy call was still waiting on inference).
INFRA_REASONS = ("connection", "http", "behind", "deadline")
Status = Literal["ok", "failed", "timeout", "cancelled"]
ControlAction = Literal["pause", "resume", "drain", "limits"]


def pack_tokens(ids: Any) -> bytes:
    """list/array of token ids -> packed int32 bytes."""
    return np.asarray(ids, dtype=TOKEN_DTYPE).tobytes()


def pack_logprobs(logprobs: Any) -> bytes:
    """list/array of log-probabilities -> packed float32 bytes."""
    return np.asarray(logprobs, dtype=LOGPROB_DTYPE).tobytes()


def unpack_tokens(raw: bytes) -> np.ndarray:
    """packed int32 bytes -> read-only int32 array (no copy)."""
    return np.frombuffer(raw, dtype=TOKEN_DTYPE)


def unpack_logprobs(raw: bytes) -> np.ndarray:
    """packed float32 bytes -> read-only float32 array (no copy)."""
    return np.frombuffer(raw, dtype=LOGPROB_DTYPE)


class Message(msgspec.Struct, kw_only=True, tag_field="kind"):
    """Base of every wire message."""

    v: int = SCHEMA_VERSION  # schema version; a decoder rejects any other
    run: str  # run name; every key of the run lives under squall:{run}:

    def validate(self) -> None:
        """Checks beyond types; raises SchemaError. Subclasses extend."""
        if self.v != SCHEMA_VERSION:
            raise SchemaError(f"schema version {self.v} is not supported (expected {SCHEMA_VERSION})")


class Task(Message, kw_only=True, tag="task"):
    """One attempt of one member of one GRPO group, for a runner to execute."""

    task_id: str  # stable id of the group member: f"{group_id}:{index}"; retries keep it
    group_id: str  # the n members of one sample share it
    sample_id: str  # the dataset row's id
    index: int  # position of this member in its group, 0..group_size-1
    group_size: int  # n, the number of members in the group
    attempt: int = 0  # 0 for the first try, +1 per retry of this member
    mode: Mode = "train"  # val attempts are scored, never trained
    payload: dict[str, Any]  # the dataset row, given to the agent as `task`
    min_version: int = 0  # the policy version at dispatch; turns must be served at >= this
    deadline: float  # unix time by which the attempt must finish, or it is a timeout
    epoch: int = 0  # dataset epoch the sample came from
    created_at: float = msgspec.field(default_factory=time.time)  # unix time of dispatch
    not_before: float = 0.0  # unix time before which no runner starts it (an infrastructure retry's backoff)
    resources: dict[str, int] = {}  # resource name -> version pinned at dispatch (shared/resources.py)
    # Seconds the attempt may run from the moment a runner starts it (scheduler.attempt_timeout_s);
    # 0: it must finish by `deadline`. With it, `deadline` only bounds the wait in the queue.
    run_timeout_s: float = 0.0

    def validate(self) -> None:
        super().validate()
        if not 0 <= self.index < self.group_size:
            raise SchemaError(f"task {self.task_id}: index {self.index} outside group of {self.group_size}")
        if self.attempt < 0 or self.min_version < 0:
            raise SchemaError(f"task {self.task_id}: attempt and min_version must be >= 0")
        if not math.isfinite(self.deadline):
            raise SchemaError(f"task {self.task_id}: deadline must be a finite unix time")
        if not (math.isfinite(self.run_timeout_s) and self.run_timeout_s >= 0):
            raise SchemaError(f"task {self.task_id}: run_timeout_s must be a finite number >= 0")

    @property
    def key(self) -> str:
        """(task_id, attempt) as one string: the exactly-once identity of an attempt."""
        return f"{self.task_id}#{self.attempt}"


class Turn(msgspec.Struct, kw_only=True):
    """One LLM call made during an attempt, exactly as the server sampled it."""

    agent: str = "main"  # which named agent made the call (multi-agent tasks)
    model: str  # model name the agent asked for
    trained: bool = True  # False for frozen models and agents outside `train_agents`
    prompt_ids: bytes  # packed int32: the prompt as the server tokenized it
    response_ids: bytes  # packed int32: sampled tokens, never re-tokenized
    response_logprobs: bytes  # packed float32: logprob of each response token, same length
    version: int  # weight version that served this call (-1 when a frozen/external endpoint reports none)
    finish_reason: str = "stop"  # stop | length | tool_calls | error
    node: str = ""  # inference node that served it
    latency_s: float = 0.0  # wall time of the call as the gateway saw it
    # True: the prompt extends this agent's previous trained call (prompt + response) token for
    # token; False: it does not (the client rewrote or re-rendered its history; counted by the
    # gateway as a continuity break); None: no previous trained call of this agent to compare.
    extends: bool | None = None
    role: str = "policy"  # the trained role whose adapter served the call (shared.roleplan); trains only it
    # The sum of the rewards the agent emitted after this call and before its next one
    # (llm.emit_reward, or POST /a/TOKEN/reward for command agents); None: none emitted. The
    # attempt's `reward` includes them (trainer/advantages.py, turn-level estimators).
    reward: float | None = None

    @property
    def prompt_tokens(self) -> np.ndarray:
        return unpack_tokens(self.prompt_ids)

    @property
    def response_tokens(self) -> np.ndarray:
        return unpack_tokens(self.response_ids)

    @property
    def logprobs(self) -> np.ndarray:
        return unpack_logprobs(self.response_logprobs)

    def validate(self, where: str) -> None:
        for name in ("prompt_ids", "response_ids"):
            raw = getattr(self, name)
            if len(raw) % TOKEN_DTYPE.itemsize:
                raise SchemaError(f"{where}: {name} is not a whole number of int32 values")
            ids = unpack_tokens(raw)
            if ids.size and int(ids.min()) < 0:
                raise SchemaError(f"{where}: {name} holds a negative token id ({int(ids.min())})")
        if len(self.response_logprobs) % LOGPROB_DTYPE.itemsize:
            raise SchemaError(f"{where}: response_logprobs is not a whole number of float32 values")
        n_ids, logprobs = len(self.response_ids) // 4, self.logprobs
        if logprobs.size != n_ids:
            raise SchemaError(f"{where}: {n_ids} response ids but {logprobs.size} logprobs")
        if logprobs.size and not bool(np.isfinite(logprobs).all()):
            raise SchemaError(f"{where}: response_logprobs holds NaN or infinity")
        if self.reward is not None and not math.isfinite(self.reward):
            raise SchemaError(f"{where}: reward is {self.reward}, must be a finite number")


class Trajectory(Message, kw_only=True, tag="trajectory"):
    """The outcome of one finished attempt, whatever it was."""

    task_id: str  # as in the Task
    group_id: str
    sample_id: str
    index: int  # member index in the group
    group_size: int
    attempt: int
    mode: Mode = "train"
    runner_id: str  # the runner process and slot that ran it
    status: Status  # ok: reward is valid; otherwise reward is None and error says why
    reward: float | None = None  # finite when status == "ok"
    turns: list[Turn] = []  # every LLM call, in call order
    error: str | None = None  # what went wrong, for failed/timeout/cancelled
    timings: dict[str, float] = {}  # seconds: queue, agent, llm, reward ...
    min_version: int = 0  # copied from the Task
    final_answer: str | None = None  # the agent's last assistant message, for reward functions
    infra: str = ""  # why no policy node answered, when that failed the attempt (INFRA_REASONS); "" otherwise
    resources: dict[str, int] = {}  # the resource versions the agent was handed (copied from the Task)
    finished_at: float = msgspec.field(default_factory=time.time)
    # Several trained roles: each role's reward for this attempt (its seats' sample trains with
    # it); empty: every role takes `reward`.
    role_rewards: dict[str, float] = {}

    @property
    def key(self) -> str:
        return f"{self.task_id}#{self.attempt}"

    def validate(self) -> None:
        super().validate()
        where = f"trajectory {self.key}"
        if self.reward is not None and not math.isfinite(self.reward):
            raise SchemaError(f"{where}: reward is {self.reward}, must be a finite number")
        if self.status == "ok" and self.reward is None:
            raise SchemaError(f"{where}: status ok but no reward")
        for role, value in self.role_rewards.items():
            if not math.isfinite(value):
                raise SchemaError(f"{where}: role_rewards[{role!r}] is {value}, must be a finite number")
        for i, turn in enumerate(self.turns):
            turn.validate(f"{where} turn {i}")


class WeightVersion(Message, kw_only=True, tag="weights"):
    """A policy version the trainer published."""

    version: int  # monotonically increasing; 0 is the initial model
    step: int  # trainer optimizer steps behind this version
    location: str  # path (or URL) of the safetensors file or directory
    checksum: str  # sha256 hex of the file at `location` (sharded: of the folder's index file)
    format: str = "safetensors"  # safetensors (one file) | safetensors-sharded (shared.weightfiles)
    created_at: float = msgspec.field(default_factory=time.time)
    role: str = "policy"  # which trained role's weights (shared.roles); versions count per role


class WeightApplied(Message, kw_only=True, tag="weights_applied"):
    """An inference node now serves `version`."""

    node: str  # inference node id
    version: int
    load_s: float  # seconds from reading the WeightVersion to serving it
    applied_at: float = msgspec.field(default_factory=time.time)
    role: str = "policy"  # the role whose version this is (shared.roles)


class ResourceVersion(Message, kw_only=True, tag="resource"):
    """A version of a named text artifact agents read (shared/resources.py)."""

    name: str  # e.g. system_prompt
    version: int  # per name, from 1; candidates take numbers too
    generation: int  # promotions to current of this name up to this one; -1 for a candidate
    checksum: str  # sha256 hex of the text
    size: int  # bytes of the text
    content: str = ""  # the text, when inline
    location: str = ""  # a file holding the text, when too big to carry inline
    current: bool = True  # False: a candidate (e.g. APO's), handed only to tasks that pin it
    source: str = ""  # who published it: config | optimizer:apo | a person
    note: str = ""  # why (e.g. the critique that produced it), for people
    created_at: float = msgspec.field(default_factory=time.time)


class Control(Message, kw_only=True, tag="control"):
    """An operator command to the scheduler (and, through it, the run)."""

    action: ControlAction
    limits: dict[str, float] = {}  # for action == "limits": field -> new value


class Metrics(Message, kw_only=True, tag="metrics"):
    """One trainer step's metrics."""

    step: int
    version: int  # weight version produced by this step
    values: dict[str, float]  # metric name -> value
    time: float = msgspec.field(default_factory=time.time)
    role: str = "policy"  # the trained role this step updated (shared.roles)


class Event(Message, kw_only=True, tag="event"):
    """A lifecycle event for people and the dashboard."""

    service: str  # scheduler | runner | trainer | inference | ...
    name: str  # e.g. started, stopped, group_complete, weights_published
    fields: dict[str, Any] = {}
    time: float = msgspec.field(default_factory=time.time)


RewardMode = Literal["train", "val"]


class RewardPoint(Message, kw_only=True, tag="reward"):
    """One point of the reward curve (stream `rewards`): a train group or a validation round."""

    version: int  # trainer weight version the rewards were sampled with (train: at dispatch)
    mode: RewardMode
    mean: float  # mean reward of the ok attempts (NaN for a validation round with none)
    count: int  # ok attempts in the mean
    group_id: str  # the train group, or `round<N>` for validation round N
    time: float = msgspec.field(default_factory=time.time)
    role: str = ""  # "": the attempts' reward; a role's name: that role's own rewards ([roles] runs)


ServiceName = Literal["scheduler", "runner", "trainer", "inference", "worker", "monitor", "optimizer"]


class Heartbeat(Message, kw_only=True, tag="heartbeat"):
    """A process's last word: field `<service>:<instance>` of the hash `heartbeats`.

    Stored as flat JSON (`encode_heartbeat`) so `redis-cli HGETALL` shows it as it is: the
    fields below plus `stats`' entries at top level. A stale `time` means a dead process; a
    non-zero `stopped` one that exited cleanly.
    """

    service: ServiceName
    instance: str  # unique within the service: host-pid, runner id, node name, consumer name
    time: float = msgspec.field(default_factory=time.time)  # wall clock, seconds
    pid: int = 0
    version: int = -1  # weight version the process holds or last saw (-1: none)
    metrics_port: int = 0  # where its /metrics listens (0: none)
    stats: dict[str, float] = {}  # service-specific counters and gauges (open_groups, busy...)
    stopped: float = 0.0  # wall clock of a clean exit (0: still running); `time` is its last beat

    @property
    def hash_field(self) -> str:
        return f"{self.service}:{self.instance}"


_HEARTBEAT_FIELDS = ("service", "instance", "time", "pid", "version", "metrics_port", "stopped")


def encode_heartbeat(beat: Heartbeat) -> bytes:
    """Flat JSON: the typed fields, then each stat as its own top-level field."""
    body: dict[str, Any] = {name: getattr(beat, name) for name in _HEARTBEAT_FIELDS}
    body["run"] = beat.run
    for name, value in beat.stats.items():
        body.setdefault(name, value)
    return msgspec.json.encode(body)


def decode_heartbeat(field: bytes | str, raw: bytes | str, run: str) -> Heartbeat:
    """Read one heartbeat field back; numeric extras become `stats`, other extras are dropped.

    Raises SchemaError naming what was wrong (not JSON, a wrong type, an unknown service).
    """
    name = field.decode() if isinstance(field, bytes) else field
    service, _, instance = name.partition(":")
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise SchemaError(f"heartbeat {name!r} is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise SchemaError(f"heartbeat {name!r} is not a JSON object")
    known = {k: body[k] for k in _HEARTBEAT_FIELDS if k in body}
    known.setdefault("service", service)
    known.setdefault("instance", instance)
    stats = {
        k: float(v)
        for k, v in body.items()
        if k not in _HEARTBEAT_FIELDS
        and k != "run"
        and isinstance(v, int | float)
        and not isinstance(v, bool)
    }
    try:
        return msgspec.convert({**known, "run": run, "stats": stats}, Heartbeat, strict=False)
    except msgspec.ValidationError as exc:
        raise SchemaError(f"heartbeat {name!r}: {exc}") from None


AnyMessage = (
    Task | Trajectory | WeightVersion | WeightApplied | Control | Metrics | Event | RewardPoint | Heartbeat
)
AnyKnownMessage = AnyMessage | ResourceVersion  # what `decode` without a kind accepts

_encoder = msgspec.msgpack.Encoder()
_any_decoder = msgspec.msgpack.Decoder(AnyKnownMessage)
_decoders: dict[type, msgspec.msgpack.Decoder] = {}


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decode(raw: bytes, kind: type[Message] | None = None) -> Any:
    """Decode and validate one message; raises SchemaError naming what was wrong."""
    if kind is None:
        decoder = _any_decoder
    else:
        decoder = _decoders.get(kind) or _decoders.setdefault(kind, msgspec.msgpack.Decoder(kind))
    try:
        message = decoder.decode(raw)
    except msgspec.ValidationError as exc:
        raise SchemaError(f"invalid {kind.__name__ if kind else 'message'}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise SchemaError(f"not a msgpack message: {exc}") from None
    message.validate()
    return message


def to_jsonable(message: Message) -> dict[str, Any]:
    """For people: packed arrays become lists so `squall peek` prints readable JSON."""
    data = msgspec.to_builtins(message, enc_hook=None)
    data["kind"] = type(message).__struct_config__.tag
    for turn in data.get("turns", []):
        turn["prompt_ids"] = unpack_tokens(_raw(turn["prompt_ids"])).tolist()
        turn["response_ids"] = unpack_tokens(_raw(turn["response_ids"])).tolist()
        turn["response_logprobs"] = [
            round(x, 5) for x in unpack_logprobs(_raw(turn["response_logprobs"])).tolist()
        ]
    return data


def _raw(value: Any) -> bytes:
    # to_builtins renders bytes as base64 text.
    import base64

    return value if isinstance(value, bytes) else base64.b64decode(value)
