"""One validated config per run: a TOML or YAML file, overridable per service by
environment variables ``SQUALL_<SECTION>__<FIELD>`` (e.g. ``SQUALL_TRAINER__LR=1e-5``, read by
pydantic-settings' EnvSettingsSource against the models, so a list or table field takes JSON).
A secret can come from a file instead: ``SQUALL_RUN__REDIS_URL_FILE=/run/secrets/redis_url``
(pydantic-settings' own secrets_dir does not reach nested fields).

Every section is one pydantic model with a docstring per field and bounds (the docstrings are
the fields' descriptions: `use_attribute_docstrings`); an unknown or bad value is a ConfigError
naming the field (``trainer.lr: must be > 0, got -1``). Renamed fields keep their old name as
an alias that warns (RENAMED).
"""

from __future__ import annotations

import os
import re
import tomllib
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_settings import EnvSettingsSource
from pydantic_settings.exceptions import SettingsError

from .errors import ConfigError
from .keys import RUN_NAME_PATTERN

ENV_PREFIX = "SQUALL_"

# An agent name is one path segment of the gateway's per-agent URL (`/a/{token}/agent/{name}/v1`):
# it must survive a URL unencoded, so no '/', '?', '#', '%' or spaces, and never '.' or '..'.
AGENT_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
AGENT_NAME_RULE = "1-64 letters, digits, '_', '.' or '-', starting with a letter or digit"


def agent_name_problem(name: object) -> str | None:
    """Why `name` cannot be an agent name (None when it can): said the same way by the config,
    `llm.agent_url` and the gateway."""
    if not isinstance(name, str) or not AGENT_NAME_PATTERN.match(name):
        return f"agent name {name!r} is not valid: use {AGENT_NAME_RULE}"
    return None


# section -> old field name -> new name. The old name still loads, with a FutureWarning (shown
# to users, unlike DeprecationWarning); giving both is an error.
RENAMED: dict[str, dict[str, str]] = {
    "scheduler": {"max_staleness": "max_dispatch_lag"},
    "trainer": {"max_staleness": "max_sample_age"},
}


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)
    # the config file's name of this section, for RENAMED (set by each section class)
    section_name: ClassVar[str] = ""

    @model_validator(mode="before")
    @classmethod
    def _renamed_fields(cls, data: Any) -> Any:
        renamed = RENAMED.get(cls.section_name, {})
        if not isinstance(data, dict) or not renamed.keys() & data.keys():
            return data
        data = dict(data)
        for old, new in renamed.items():
            if old not in data:
                continue
            if new in data:
                raise ValueError(
                    f"{cls.section_name}.{old} is the old name of {cls.section_name}.{new}: give only {new}"
                )
            warnings.warn(
                f"{cls.section_name}.{old} is deprecated: call it {cls.section_name}.{new} (same meaning)",
                FutureWarning,
                stacklevel=2,
            )
            data[new] = data.pop(old)
        return data


class RunSection(Section):
    name: str = Field("default", pattern=RUN_NAME_PATTERN.pattern)
    """Run name; every Redis key lives under squall:{name}:."""
    redis_url: str = "redis://127.0.0.1:6379/0"
    """Redis URL (redis:// or rediss:// for TLS, user:password@ for ACL users)."""
    autostart_redis: bool = True
    """Start a local Redis when none answers at a local redis_url."""
    dir: str = "runs/default"
    """Run folder: checkpoints, weights, metrics, plots."""
    seed: int = Field(0, ge=0)
    """Seed for shuffling, sampling and initialisation."""
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """Log level of every service."""
    redis_outage_s: float = Field(120.0, gt=0)
    """How long a service rides through a Redis outage (retrying with backoff) before it exits
    non-zero naming the URL."""
    redis_durability: Literal["off", "warn", "refuse"] = "warn"
    """At start, the scheduler and the trainer check that Redis keeps an fsynced AOF
    (appendonly yes, appendfsync everysec or always; docs/operating.md): warn logs
    `redis_not_durable` and goes on, refuse exits naming the setting, off skips the check."""
    redis_waitaof: bool = False
    """After the writes that must survive a host crash before they count (the trainer's ledger
    moves and acks after a checkpoint, the scheduler's dispatch), wait for Redis to fsync them
    (WAITAOF, Redis 7.2 or newer)."""
    redis_waitaof_timeout_ms: int = Field(2000, ge=1)
    """Longest WAITAOF wait; past it the service logs `redis_waitaof_late` and goes on."""


class ModelSection(Section):
    path: str = ""
    """Directory of the initial policy (transformers format: config, tokenizer, weights)."""
    name: str = "policy"
    """Model name the policy is served under; agents ask for it (or any name not frozen)."""


class SchedulerSection(Section):
    section_name: ClassVar[str] = "scheduler"

    dataset: str = ""
    """Training data: a .jsonl or .parquet file of rows (verl-style rows supported)."""
    val_dataset: str = ""
    """Validation data; empty means carve `val_fraction` out of `dataset`."""
    val_fraction: float = Field(0.0, ge=0.0, lt=1.0)
    """Share of `dataset` held out for validation when `val_dataset` is empty."""
    epochs: int = Field(1, ge=1)
    """Passes over the training data."""
    shuffle: bool = True
    """Shuffle each epoch with the run seed."""
    group_size: int = Field(4, ge=1, le=1024)
    """n: attempts per sample (the GRPO group)."""
    max_inflight_groups: int = Field(8, ge=1)
    """Backpressure: at most this many training groups dispatched and not yet complete."""
    max_dispatch_lag: int = Field(1, ge=0)
    """Dispatch pauses while an open training group was dispatched more than this many weight
    versions before the trainer's newest (0: no rollout runs on weights older than the newest).
    Was `max_staleness`."""
    max_attempts: int = Field(3, ge=1)
    """Tries per group member before it is dead-lettered. An attempt that failed because no
    policy node answered (Trajectory.infra) does not count, within the budget below."""
    infra_retries: int = Field(200, ge=0)
    """Infrastructure retries one group may take (all members together) before such a failure
    counts against max_attempts like any other."""
    infra_retry_s: float = Field(1800.0, gt=0)
    """Seconds from a group's first infrastructure failure during which such failures are
    retried for free; past it they count against max_attempts."""
    infra_backoff_s: float = Field(1.0, gt=0)
    """First delay before an infrastructure retry starts; doubles per retry of the member."""
    infra_backoff_max_s: float = Field(30.0, gt=0)
    """Longest delay before an infrastructure retry starts."""
    task_timeout_s: float = Field(120.0, gt=0)
    """Deadline of one attempt, from dispatch (time waiting in a runner's queue counts). With
    attempt_timeout_s set, it bounds only the wait for a runner to start the attempt."""
    attempt_timeout_s: float = Field(0.0, ge=0)
    """Deadline of one attempt counted from when a runner starts it, so queueing behind other
    attempts on a slow node does not eat into it (0: task_timeout_s from dispatch decides)."""
    group_deadline_s: float = Field(600.0, gt=0)
    """A group is complete when all members finished or this passed since dispatch."""
    val_every: int = Field(0, ge=0)
    """Dispatch the validation set every K weight versions (0: never)."""
    val_samples: int = Field(0, ge=0)
    """Validation samples per round (0: all)."""
    max_samples: int = Field(0, ge=0)
    """Stop after this many training samples (0: the whole dataset times epochs)."""
    hold_until_trained: bool = True
    """A training group counts against max_inflight_groups and max_dispatch_lag until the trainer
    has consumed it (ledger trained/filtered/late), not only until its rollouts finished; this
    is what keeps rollouts from outrunning a slow trainer. Turn off for rollout-only runs."""
    val_at_end: bool = True
    """When the training data runs out, validate once more, on the trainer's last version (the
    one it publishes after training what it still held), before finishing."""
    end_wait_s: float = Field(600.0, gt=0)
    """When the data has run out, how long to wait for the trainer to train what it holds and
    publish its last version (shared/dataend.py); past it, the end-of-run validation measures
    the newest published version and the run's events say it may not be the last."""
    val_group_size: int = Field(1, ge=1, le=1024)
    """Attempts per validation sample (their mean is the sample's score)."""
    metrics_host: str = "127.0.0.1"
    """Where the scheduler's /health, /ready and /metrics (queue lag, ledger) listen."""
    metrics_port: int = Field(0, ge=0, le=65535)
    """Port of the scheduler's /health and /metrics (0: any free port)."""
    standby_after_s: float = Field(10.0, gt=0)
    """A scheduler started while another one's heartbeat is younger than this stands by, and
    takes the lead once it is older (the other died); heartbeats come every third of it."""
    poll_s: float = Field(0.5, gt=0, le=30)
    """Longest blocking wait of the scheduler loop (trajectories, then admission checks)."""
    trim_every_s: float = Field(10.0, gt=0)
    """How often the scheduler trims `tasks`/`trajectories` below what every group acknowledged
    and prunes heartbeats of long-gone processes."""
    keep_rollouts_per_version: int = Field(32, ge=0)
    """Attempts of each weight version (the first ones to finish) the scheduler keeps in
    {run.dir}/rollouts for `squall show`, the dashboard's viewer and `squall rescore` once
    `trajectories` is trimmed (0: keep none)."""


class RunnerSection(Section):
    agent: str = ""
    """Python agent as module:function (async or sync)."""
    agent_cmd: str = ""
    """External agent command; gets the task JSON on stdin, prints the reward."""
    reward_fn: str = ""
    """Optional module:function(task, final_answer) -> float, used when the agent returns None."""
    concurrency: int = Field(4, ge=1, le=1024)
    """Slots per runner process (attempts run at once)."""
    inference_urls: list[str] = ["http://127.0.0.1:8000"]
    """Inference nodes of the policy; the gateway balances across them."""
    frozen_models: dict[str, str] = {}
    """Model name -> base URL of models recorded but never trained (judges, opponents)."""
    train_agents: list[str] = []
    """Named agents whose calls train (empty: all agents). With `seats` set, each must be a seat."""
    train_agents_check_after: int = Field(20, ge=0)
    """Finished attempts with calls (per runner) after which a `train_agents` name that no call
    came from is reported, once per run, in the logs, `squall status` and the dashboard (0: never)."""
    agent_failing_after: int = Field(16, ge=0)
    """Agent failures in a row (per runner; `failed` attempts, infrastructure faults aside) after
    which the agent is reported as failing every attempt, once per run, in the logs, `squall
    status`, the dashboard and `squall up` (0: never)."""
    seats: list[str] = []
    """The named agents of a multi-agent task (its seats). Empty: any agent name is accepted;
    set: a call from another name is refused (a typo fails loudly), and seats can be given
    to the opponent (`opponent_model`, `opponent_fraction`)."""
    opponent_model: str = ""
    """A `frozen_models` name that plays the opponent seats (a frozen model, or a snapshot node
    of the policy); empty: no seat is handed to an opponent."""
    opponent_fraction: float = Field(0.0, ge=0.0, le=1.0)
    """Share of `seats` played by `opponent_model` in each attempt (rounded to whole seats).
    Which seats is a seeded draw per GRPO group, so every member of a group faces the same
    line-up; calls from those seats go to the opponent and are recorded untrained."""
    lease_s: float = Field(30.0, gt=0)
    """Lease on a task; renewed while the agent runs, reclaimed by others once it lapses."""
    grace_s: float = Field(30.0, ge=0)
    """On SIGTERM: time for in-flight attempts to finish before they are handed back."""
    gateway_host: str = "127.0.0.1"
    """Where the runner's local LLM gateway listens (loopback: agents run beside it)."""
    gateway_port: int = Field(0, ge=0, le=65535)
    """Gateway port (0: any free port)."""
    upstream_retries: int = Field(3, ge=0)
    """Retries of a failed inference call before the agent gets an error."""
    behind_wait_s: float = Field(60.0, gt=0)
    """How long a policy call waits for a node serving the task's min_version (every node is
    behind, e.g. restarting or reloading) before the attempt fails with an infrastructure reason."""
    api_key: str = ""
    """API key the inference nodes require (empty: none)."""
    metrics_port: int = Field(0, ge=0, le=65535)
    """Port of the runner's /health and /metrics (0: any free port)."""
    max_deliveries: int = Field(3, ge=1)
    """Deliveries of one attempt (first read + reclaims after a lapsed lease) before the runner
    gives up on it with a failed trajectory (the scheduler then retries or dead-letters)."""
    heartbeat_s: float = Field(2.0, gt=0)
    """Interval of the runner's heartbeat in Keys.heartbeats."""
    upstream_timeout_s: float = Field(300.0, gt=0)
    """Deadline of one forwarded inference call (the attempt's own deadline still applies)."""

    @model_validator(mode="after")
    def _check_seats(self) -> RunnerSection:
        for field_name in ("seats", "train_agents"):
            for name in getattr(self, field_name):
                if problem := agent_name_problem(name):
                    raise ValueError(f"runner.{field_name}: {problem} (it goes into the agent's URL)")
        if "" in self.frozen_models:
            raise ValueError("runner.frozen_models has an empty model name: name each endpoint")
        if self.seats and len(set(self.seats)) != len(self.seats):
            raise ValueError(f"runner.seats lists a name twice: {self.seats}")
        unknown = [a for a in self.train_agents if self.seats and a not in self.seats]
        if unknown:
            raise ValueError(
                f"runner.train_agents names {unknown}, which are not in runner.seats {self.seats}; "
                "fix the name or add the seat"
            )
        if self.opponent_model and self.opponent_model not in self.frozen_models:
            raise ValueError(
                f"runner.opponent_model {self.opponent_model!r} is not a key of runner.frozen_models "
                f"(known: {sorted(self.frozen_models) or 'none'}); add its endpoint there"
            )
        if self.opponent_fraction > 0 and not (self.opponent_model and self.seats):
            raise ValueError("runner.opponent_fraction > 0 needs runner.opponent_model and runner.seats")
        return self


class TrainerSection(Section):
    section_name: ClassVar[str] = "trainer"

    backend: Literal["torch", "verl"] = "torch"
    """Training backend."""
    device: str = "auto"
    """torch device (auto: cuda if available, else cpu)."""
    lr: float = Field(1e-5, gt=0)
    """Learning rate."""
    groups_per_step: int = Field(4, ge=1)
    """Complete groups that make one optimizer step."""
    advantage: Literal["grpo", "drgrpo", "rloo", "turn_grpo", "turn_drgrpo", "turn_rloo"] = "grpo"
    """Advantage estimator. The turn_* ones give each turn its discounted return-to-go
    (turn-level rewards: llm.emit_reward) minus the group baseline of grpo/drgrpo/rloo
    (docs/trainer.md)."""
    turn_gamma: float = Field(1.0, gt=0, le=1)
    """Discount per turn of the turn_* estimators' return-to-go (1: undiscounted)."""
    sft: Literal["off", "only", "mix"] = "off"
    """SFT from the run's own successful trajectories (trainer/sft.py): off, only (instead of
    GRPO), or mix (both in each step)."""
    sft_threshold: float = 1.0
    """A member trains by SFT when its reward is >= this."""
    sft_coef: float = Field(1.0, ge=0)
    """Weight of the SFT (negative log-likelihood) term per token."""
    sft_until_step: int = Field(0, ge=0)
    """SFT stops at this optimizer step and GRPO alone goes on (0: never stops)."""
    distill_url: str = ""
    """On-policy distillation (trainer/distill.py): the teacher's OpenAI-compatible base URL,
    answering prompt_logprobs, with the student's tokenizer ("": off)."""
    distill_model: str = "teacher"
    """The model name the teacher endpoint serves."""
    distill_coef: float = Field(1.0, ge=0)
    """Weight of the per-token reverse KL to the teacher in the advantage."""
    distill_reward_coef: float = Field(0.0, ge=0)
    """Weight of the task advantage mixed in (0: distillation alone)."""
    distill_timeout_s: float = Field(60.0, gt=0)
    """How long one teacher request is retried before the step fails."""
    clip_low: float = Field(0.2, ge=0)
    """PPO clip below 1 (ratio >= 1 - clip_low)."""
    clip_high: float = Field(0.28, ge=0)
    """PPO clip above 1 (ratio <= 1 + clip_high)."""
    tis_cap: float = Field(2.0, gt=0)
    """Truncated importance sampling cap on the trainer/behaviour ratio."""
    loss_agg: Literal["token", "trajectory"] = "token"
    """Normalise the loss per token of the batch or per trajectory."""
    kl_coef: float = Field(0.0, ge=0)
    """KL penalty to the frozen reference (0: no reference model)."""
    max_sample_age: int = Field(1, ge=0)
    """Filter out (ledger `stale`) an attempt whose oldest turn was sampled more than this many
    weight versions before the version being trained. Was `max_staleness`."""
    overlong: Literal["mask", "drop", "keep"] = "mask"
    """Truncated responses: mask them out of the loss, drop the trajectory, or keep."""
    max_tokens_per_microbatch: int = Field(8192, ge=1)
    """Token budget of one micro-batch (activation memory grows with it; a 135M model on CPU
    trains comfortably at 2048)."""
    gradient_checkpointing: bool = False
    """Recompute each layer's activations in the backward pass instead of keeping them: less
    memory per micro-batch token for about a third more compute (torch backend)."""
    share_prefix: bool = True
    """Torch backend: run the prompt a micro-batch's samples share (a group's attempts) once,
    then only each sample's own tokens: the same logprobs and gradients for much less compute
    on long prompts (trainer/prefix_sharing.py). Off under FSDP and gradient_checkpointing."""
    grad_clip: float = Field(1.0, gt=0)
    """Gradient norm clip."""
    publish_every: int = Field(1, ge=1)
    """Publish weights every k steps."""
    checkpoint_every: int = Field(1, ge=1)
    """Write the model + optimizer checkpoint every k steps (1.6 GB for a 135M model). Entries of
    the steps in between stay unacked in the group's pending list until the checkpoint holding
    them is durable; a crash re-trains them from the last checkpoint (docs/trainer.md)."""
    checkpoint_every_s: float = Field(0.0, ge=0)
    """Also checkpoint once this many seconds passed since the last checkpoint (0: steps only)."""
    checkpoint_idle_s: float = Field(30.0, gt=0)
    """With steps deferred, checkpoint anyway after reads came back empty this long (the
    scheduler may hold groups until the trainer acks them)."""
    max_steps: int = Field(0, ge=0)
    """Stop after this many steps (0: until the scheduler finishes)."""
    group_wait_s: float = Field(600.0, gt=0)
    """Deadline for a group's missing members after its first arrived."""
    keep_versions: int = Field(2, ge=1)
    """Weight versions kept on disk beyond those some node still serves."""
    weights_format: Literal["safetensors-sharded", "safetensors"] = "safetensors-sharded"
    """How each version is written: Hugging Face shards + index, written and checksummed in
    parallel, or one model.safetensors (what earlier squall wrote; inference reads both)."""
    weights_shard_mb: int = Field(512, ge=1)
    """Largest shard of a sharded version, MiB (a bigger tensor gets a shard of its own)."""
    weights_write_threads: int = Field(4, ge=1)
    """Shards serialised, hashed and written at once."""
    max_seq_len: int = Field(8192, ge=16)
    """Trajectories whose merged sequence is longer are filtered as overlong (unless overlong=keep)."""
    max_turn_tokens: int = Field(0, ge=0)
    """A trained turn whose prompt + response is longer than this is not trained (its tokens
    stay as context of later turns, with loss mask 0); 0: no cap. Counted as capped:turn_tokens."""
    max_turns_per_trajectory: int = Field(0, ge=0)
    """At most this many trained turns per trajectory, chosen by a sampling seeded with the run
    seed and the attempt key (the same on every replay); the rest are not trained; 0: no cap.
    Counted as capped:turns. A trajectory left with no trained turn is filtered:no_turns_in_cap."""
    lora_rank: int = Field(0, ge=0, le=512)
    """LoRA rank (0: train every weight). With a rank, only low-rank adapters on
    `lora_target_modules` train (peft), checkpoints hold the adapters and their optimizer state,
    and each version is published as the adapter alone (format "lora", peft's layout, whatever
    `weights_format` says); inference nodes apply it to the base model `model.path`. torch backend."""
    lora_alpha: float = Field(32.0, gt=0)
    """LoRA scale numerator: an adapter adds (lora_alpha / lora_rank) * B @ A to its layer."""
    lora_dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapters' input while training (not applied at inference)."""
    lora_target_modules: list[str] = Field(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], min_length=1
    )
    """Linear layers given adapters, by the trailing parts of their module name, as peft
    matches them (`q_proj`: every layer's; `layers.0.self_attn.q_proj`: one). The default is
    the attention and MLP projections of Qwen/Llama models. A name that matches no linear layer
    stops the trainer, listing the linear layers the model has."""
    consumer: str = Field("trainer", min_length=1)
    """Stable consumer name on `trajectories`: a restart re-reads its own unacked entries."""
    metrics_host: str = "127.0.0.1"
    """Where the trainer's /health, /ready and /metrics (step, version, tokens/s) listen."""
    metrics_port: int = Field(0, ge=0, le=65535)
    """Port of the trainer's /health and /metrics (0: any free port; the heartbeat names it)."""
    collective_timeout_s: float = Field(600.0, gt=0)
    """With several ranks: a collective (a step's gradient reduction, a checkpoint, gathering
    the weights) that waits longer than this raises on every rank still alive, so a rank that
    hangs or dies takes the trainer down instead of stalling it."""

    @model_validator(mode="after")
    def _check_lora(self) -> TrainerSection:
        if self.lora_rank and self.backend != "torch":
            raise ValueError(
                f"trainer.lora_rank = {self.lora_rank} needs trainer.backend = 'torch' (the "
                f"{self.backend} backend trains every weight): set backend = 'torch' or lora_rank = 0"
            )
        return self

    @model_validator(mode="after")
    def _check_sft(self) -> TrainerSection:
        if self.sft != "off" and self.backend != "torch":
            raise ValueError(
                f"trainer.sft = {self.sft!r} needs trainer.backend = 'torch' (the {self.backend} "
                "backend has no SFT loss): set backend = 'torch' or sft = 'off'"
            )
        return self


class InferenceSection(Section):
    backend: Literal["torch", "vllm"] = "torch"
    """Inference backend."""
    host: str = "127.0.0.1"
    """Listen address."""
    port: int = Field(8000, ge=0, le=65535)
    """Listen port."""
    node: str = ""
    """Node id in weights:applied (empty: host:port)."""
    device: str = "auto"
    """torch device (auto: cuda if available, else cpu)."""
    swap: Literal["overlap", "drain"] = "overlap"
    """How the torch engine swaps in a new weight version: "overlap" admits new requests on the
    new version at once while the running ones finish on the old (both models in memory until
    then); "drain" stops admitting until the running ones finished (new requests wait)."""
    max_batch: int = Field(32, ge=1)
    """Most sequences decoded together."""
    max_model_len: int = Field(2048, ge=16)
    """Context length: prompt plus completion."""
    api_key: str = ""
    """Required bearer key (empty: none)."""
    follow_weights: bool = True
    """Follow the `weights` stream and hot-reload new versions."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights dtype (auto: bfloat16 on CUDA, float32 on CPU)."""
    torch_threads: int = Field(1, ge=0)
    """CPU threads torch uses in the server process (0: torch's default)."""
    model_name: str = ""
    """Name the model is served under (empty: model.name)."""
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1)
    """vllm backend: share of GPU memory vLLM may take."""
    pin_version: int = Field(-1, ge=-1)
    """Serve exactly this published weight version and never load another (a policy snapshot,
    e.g. an opponent for self-play); -1: follow the newest. The node refuses to start when the
    version was never published or its file is gone."""
    behind_versions: int = Field(0, ge=0)
    """Serve the version this many behind the newest published one (0: the newest), moving on
    as the trainer publishes: an opponent that trails the policy. Not with pin_version."""
    reasoning_parser: Literal["think", "none"] = "think"
    """think: text between <think> and </think> in a chat reply goes to `reasoning_content`
    and out of `content` (the token ids stay exactly the sampled ones); none: all in content."""
    tool_parser: Literal["auto", "hermes", "smollm2", "llama3_json", "json"] = "auto"
    """How tool calls are read from chat replies: hermes (`<tool_call>{json}</tool_call>`, Qwen,
    Hermes), smollm2 (`<tool_call>[json list]</tool_call>`), llama3_json (`{"name", "parameters"}`),
    json (a bare JSON call); auto: the format the model's chat template teaches (docs/inference.md)."""
    chat_template: str = ""
    """A Jinja chat template file used instead of the model folder's own (empty: the model's)."""
    snapshots: dict[str, Annotated[int, Field(ge=0)]] = {}
    """`squall up` only: policy snapshots to serve beside the policy, as served name -> weight
    version to pin (0: the model the run starts from). Each is one more inference node pinned
    to that version and added to `runner.frozen_models` under its name, so an agent that asks
    for the name plays against it (e.g. a frozen opponent team) and its turns are untrained."""

    @model_validator(mode="after")
    def _check_snapshot(self) -> InferenceSection:
        if self.pin_version >= 0 and self.behind_versions:
            raise ValueError(
                "inference.pin_version and inference.behind_versions exclude each other; set one"
            )
        return self


class WorkerSection(Section):
    """The tool pool (`squall worker`, services/toolpool): rq workers that run agents' tool calls
    (model-written code, retrieval, SQL, judges) apart from the runners."""

    queues: list[Literal["code", "retrieval", "sql", "judge"]] = []
    """Tools this run's pool serves, one rq queue each; empty: `squall up` starts no pool."""
    workers: int = Field(2, ge=1, le=256)
    """rq worker processes one `squall worker` starts (each runs one job at a time)."""
    job_timeout_s: int = Field(30, ge=1)
    """Longest a job may run before rq kills its work horse (a caller's shorter deadline wins)."""
    result_ttl_s: int = Field(300, ge=1)
    """How long a finished job's result stays in Redis."""
    failure_ttl_s: int = Field(86400, ge=1)
    """How long a failed job stays in rq's failed registry (`rq info`, `squall status`)."""
    retries: int = Field(0, ge=0, le=10)
    """rq retries of a failed or abandoned job (a worker killed mid-job)."""
    maintenance_s: int = Field(15, ge=1)
    """How often a worker moves abandoned jobs (their worker died) to failed or retries them."""
    heartbeat_s: int = Field(5, ge=1)
    """A worker renews its running job's lease this often; a job whose worker died counts as
    abandoned 3 heartbeats later, and is failed (or retried) at the next maintenance."""
    deadline_s: float = Field(30.0, gt=0)
    """A tool call's deadline when the caller gives none (enqueue to result)."""
    http_host: str = "127.0.0.1"
    """Where `squall worker --http` serves the tools over HTTP for external-command agents."""
    http_port: int = Field(0, ge=0, le=65535)
    """Port of the tools' HTTP API (0: not served)."""
    sandbox_python: str = ""
    """Interpreter of sandboxed code (empty: the worker's own, or the system python3 when a
    sandbox uid could not reach it)."""
    code_cpu_s: int = Field(5, ge=1, le=3600)
    """Sandbox: CPU seconds per run."""
    code_wall_s: float = Field(10.0, gt=0, le=3600)
    """Sandbox: wall-clock seconds per run."""
    code_memory_mb: int = Field(512, ge=32)
    """Sandbox: address-space limit in MB."""
    code_file_mb: int = Field(8, ge=0)
    """Sandbox: largest file the code may write, MB."""
    code_processes: int = Field(16, ge=1)
    """Sandbox: processes and threads at once."""
    code_output_bytes: int = Field(65536, ge=1)
    """Sandbox: stdout + stderr kept; more kills the run."""
    corpora: dict[str, str] = {}
    """Retrieval: corpus name -> .jsonl file of {id, title, text} rows (BM25-indexed at start)."""
    databases: dict[str, str] = {}
    """SQL and the `sql` judge: database name -> SQLite file (opened read-only)."""
    sql_timeout_s: float = Field(2.0, gt=0)
    """SQL: a query running longer is interrupted."""
    sql_max_rows: int = Field(50, ge=1)
    """SQL: rows returned at most (the rest is cut and marked)."""


class TrackingSection(Section):
    """Experiment tracking (`squall track`, services/tracking): trainer metrics, rewards, ledger
    counts and rollout samples, copied from the run's streams to the listed backends."""

    backends: list[Literal["wandb", "tensorboard", "mlflow"]] = []
    """Where to log; empty: no tracking (`squall up` starts no `squall track`)."""
    dir: str = ""
    """Folder of the tracker's cursor, TensorBoard event files, W&B files and the default MLflow
    store (empty: {run.dir}/tracking)."""
    project: str = Field("squall", min_length=1)
    """W&B project and MLflow experiment name; the tracked run is named after run.name."""
    wandb_mode: Literal["online", "offline"] = "online"
    """online: W&B streams to its server (needs WANDB_API_KEY); offline: files only, for `wandb sync`."""
    wandb_entity: str = ""
    """W&B entity (team or user; empty: the API key's default)."""
    mlflow_uri: str = ""
    """MLflow tracking URI (http://..., sqlite:///..., a folder); empty: a file store in `dir`/mlruns."""
    samples_per_version: int = Field(4, ge=0, le=1000)
    """Rollout samples (trajectories decoded to text) logged per policy version (0: none)."""
    poll_s: float = Field(2.0, gt=0, le=300)
    """How often the tracker reads the streams."""
    otlp_endpoint: str = ""
    """OpenTelemetry: the OTLP/HTTP endpoint (e.g. http://collector:4318) the runner and trainer
    send their spans to (services/tracking/otel.py; needs the `otel` extra); empty: no tracing."""


class AlertsSection(Section):
    """Stall detection (services/monitor/stalls.py): what counts as a run that stopped making
    progress. The scheduler checks every `check_every_s` and writes `stall`/`stall_cleared`
    events; `squall status`, the dashboard and /metrics show the stalls found now."""

    step_stall_s: float = Field(600.0, gt=0)
    """The trainer's step counter has not moved for this long while trajectories wait for it."""
    slow_group_factor: float = Field(3.0, gt=1)
    """A group still rolling out is slow once its age passes this many times the median age of
    the groups rolling out (and `slow_group_min_s`)."""
    slow_group_min_s: float = Field(60.0, ge=0)
    """No group younger than this is called slow."""
    attempt_stuck_s: float = Field(0.0, ge=0)
    """An attempt a live runner has held this long is stuck (0: scheduler.task_timeout_s + 30 s,
    past the deadline by which the runner should have ended it)."""
    node_stale_s: float = Field(60.0, ge=0)
    """A node more than scheduler.max_staleness versions behind is stale once the first version
    it misses has been published this long."""
    deadletter_window_s: float = Field(300.0, gt=0)
    """Dead letters are counted over this window and the one before it."""
    deadletter_min: int = Field(5, ge=1)
    """Dead letters in the last window that, when more than in the window before, make a rising rate."""
    check_every_s: float = Field(10.0, gt=0)
    """How often the scheduler looks for stalls."""


class RoleLora(Section):
    """One role's LoRA adapter on the shared base (`[roles.<name>] lora = {...}`)."""

    rank: int = Field(8, ge=1, le=512)
    """The adapter's rank."""
    alpha: float = Field(16.0, gt=0)
    """Scale numerator: the adapter adds (alpha / rank) * B @ A to its layer."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter's input while training."""
    targets: list[str] = []
    """Linear layers given this role's adapter (peft's target_modules); empty: trainer.lora_target_modules."""


class RoleSection(Section):
    """One trained role (`[roles.<name>]`): the agent names (seats) whose calls it trains, and
    its own adapter, learning rate, advantage estimator and group size. See docs/multi_agent.md."""

    agents: list[str] = []
    """The seats this role covers: every call made by one of these agent names is served by the
    role's adapter and trains it. Each seat belongs to one role at most."""
    lora: RoleLora = RoleLora()
    """The role's adapter (rank, alpha, dropout, targets)."""
    lr: float | None = Field(None, gt=0)
    """The role's learning rate (default: trainer.lr)."""
    estimator: Literal["grpo", "drgrpo", "rloo", "turn_grpo", "turn_drgrpo", "turn_rloo"] | None = None
    """The role's advantage estimator (default: trainer.advantage)."""
    group_size: int | None = Field(None, ge=1, le=1024)
    """The role's GRPO group: scheduler.group_size split into groups of this size (it must
    divide scheduler.group_size; default: scheduler.group_size)."""


class ResourcesSection(Section):
    """Named text artifacts agents read (shared/resources.py), one line each: `name = "text"`
    or `name = "file:PATH"`. The scheduler publishes each as version 1 when none is published
    yet; a function agent reads `llm.resources[name]`. No fixed fields: every key is a name."""

    model_config = ConfigDict(extra="allow", validate_assignment=True, use_attribute_docstrings=True)

    @model_validator(mode="after")
    def _texts(self) -> ResourcesSection:
        for name, value in (self.model_extra or {}).items():
            if not isinstance(value, str):
                raise ValueError(
                    f'resources.{name}: must be text (or "file:PATH"), got {type(value).__name__}'
                )
        return self

    def named(self) -> dict[str, str]:
        """name -> text or `file:PATH`, as the run file gives them."""
        return dict(self.model_extra or {})


OPTIMIZER_ALGORITHMS = ("apo",)  # what `squall optimize --algorithm` knows (services/optimizer)


class OptimizerSection(Section):
    """The prompt optimiser (`squall optimize`, services/optimizer; docs/optimizer.md)."""

    algorithm: str = ""
    """Which optimiser `squall up` starts beside (or instead of) the trainer: `apo`, or empty: none."""
    resource: str = "system_prompt"
    """The `[resources]` entry it rewrites."""
    editor_url: str = ""
    """OpenAI-compatible base URL of the editor model (…/v1): the served policy, a frozen node or
    an external API. Empty: the run's first inference node."""
    editor_model: str = ""
    """Model name sent to the editor (empty: model.name)."""
    editor_api_key: str = ""
    """Bearer key for the editor endpoint (empty: none)."""
    editor_timeout_s: float = Field(60.0, gt=0)
    """Deadline of one editor call."""
    editor_deadline_s: float = Field(300.0, gt=0)
    """How long one expansion retries a down or garbled editor before it gives up for the round
    (the current prompt stays)."""
    editor_temperature: float = Field(0.7, ge=0)
    """Sampling temperature of the editor's rewrites."""
    editor_max_tokens: int = Field(512, ge=16)
    """Longest reply asked of the editor per call."""
    rounds: int = Field(5, ge=1)
    """Expansion rounds (critique, rewrites, evaluation) before the optimiser stops."""
    beam_width: int = Field(2, ge=1)
    """Prompts kept between rounds (ProTeGi's beam)."""
    candidates: int = Field(2, ge=1, le=16)
    """Rewrites asked of the editor per beam member and round."""
    errors_per_critique: int = Field(4, ge=1)
    """Low-reward attempts shown to the editor in one critique."""
    eval_samples: int = Field(16, ge=1)
    """Training rows each candidate is scored on (the same rows for every candidate)."""
    heldout_samples: int = Field(0, ge=0)
    """Validation rows the best prompt is measured on after each round (0: the whole
    validation split); reported as `val` reward points."""
    eval_timeout_s: float = Field(600.0, gt=0)
    """How long one evaluation waits for its attempts; missing ones count as reward 0."""
    min_improvement: float = Field(0.0, ge=0)
    """A candidate replaces the current prompt only if it scores more than this much higher."""

    @model_validator(mode="after")
    def _known_algorithm(self) -> OptimizerSection:
        if self.algorithm and self.algorithm not in OPTIMIZER_ALGORITHMS:
            raise ValueError(
                f"optimizer.algorithm {self.algorithm!r} is not known: use one of {list(OPTIMIZER_ALGORITHMS)}"
            )
        return self


class RunConfig(Section):
    """The whole run file."""

    run: RunSection = RunSection()
    model: ModelSection = ModelSection()
    scheduler: SchedulerSection = SchedulerSection()
    runner: RunnerSection = RunnerSection()
    trainer: TrainerSection = TrainerSection()
    inference: InferenceSection = InferenceSection()
    worker: WorkerSection = WorkerSection()
    tracking: TrackingSection = TrackingSection()
    alerts: AlertsSection = AlertsSection()
    roles: dict[str, RoleSection] = {}
    """Trained roles by name (`[roles.wolves] agents = [...]`); none: one role, `policy`,
    training the calls `runner.train_agents` names (a single-policy run, as before roles)."""
    optimizer: OptimizerSection = OptimizerSection()
    """The prompt optimiser, when the run has one (`algorithm = "apo"`)."""
    resources: ResourcesSection = ResourcesSection()
    """Named texts the agents read, versioned like weights (`llm.resources[name]`)."""

    @model_validator(mode="after")
    def _check_roles(self) -> RunConfig:
        from .roleplan import check_roles  # the checks live with the plan they guard

        check_roles(self)
        return self

    def to_json(self) -> str:
        return self.model_dump_json()


def _read_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    try:
        if path.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text) or {}
        elif path.suffix == ".json":  # what `squall up` writes for its services (up.py)
            import json

            data = json.loads(text)
        else:
            data = tomllib.loads(text)
    except Exception as exc:  # the parsers' own errors carry line numbers
        raise ConfigError(f"config file {path} is not valid {path.suffix[1:] or 'TOML'}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: top level must be a table of sections")
    return data


FILE_SUFFIX = "_FILE"


def _is_field(section: str, field: str) -> bool:
    model = RunConfig.model_fields.get(section)
    annotation = model.annotation if model else None
    return (
        isinstance(annotation, type)
        and issubclass(annotation, BaseModel)
        and field in annotation.model_fields
    )


def _read_secret_files(env: Mapping[str, str]) -> dict[str, str]:
    """`SQUALL_<SECTION>__<FIELD>_FILE=path` stands for `SQUALL_<SECTION>__<FIELD>` = the file's
    text, whitespace stripped (the Docker/compose convention for secrets): a container gets its
    Redis password as a mounted file, so it never shows in `podman inspect`'s environment.
    Applies only where `<field>` is a setting and `<field>_file` is not."""
    out = dict(env)
    for name, path in env.items():
        upper = name.upper()
        if not (upper.startswith(ENV_PREFIX) and "__" in upper and upper.endswith(FILE_SUFFIX)):
            continue
        section, field = upper[len(ENV_PREFIX) : -len(FILE_SUFFIX)].lower().split("__", 1)
        if not _is_field(section, field) or _is_field(section, field + FILE_SUFFIX.lower()):
            continue
        target = name[: -len(FILE_SUFFIX)]
        if any(other.upper() == target.upper() for other in env):
            raise ConfigError(f"environment variable {name} and {target} are both set: give only one")
        try:
            out[target] = Path(path).read_text().strip()
        except OSError as exc:
            raise ConfigError(
                f"environment variable {name}: cannot read {path!r} ({exc.strerror}); "
                f"mount the file there or unset {name}"
            ) from None
        del out[name]
    return out


def _env_overrides(env: Mapping[str, str]) -> dict[str, Any]:
    """`SQUALL_<SECTION>__<FIELD>` variables as nested sections (pydantic-settings' reading:
    scalars stay strings for pydantic to validate, list and table fields are parsed as JSON);
    `SQUALL_<SECTION>__<FIELD>_FILE` reads the value from a file (_read_secret_files)."""
    env = _read_secret_files(env)
    ours = {
        name: value for name, value in env.items() if name.upper().startswith(ENV_PREFIX) and "__" in name
    }
    sections = set(RunConfig.model_fields)
    for name in ours:
        section = name[len(ENV_PREFIX) :].split("__", 1)[0].lower()
        if section not in sections:
            raise ConfigError(
                f"environment variable {name}: no config section {section!r} (sections: {sorted(sections)})"
            )
    source = EnvSettingsSource(
        RunConfig,  # type: ignore[arg-type]  # reads only the fields and their types
        case_sensitive=False,
        env_prefix=ENV_PREFIX,
        env_nested_delimiter="__",
    )
    try:
        source.env_vars = {name.lower(): value for name, value in ours.items()}
        return source()
    except SettingsError:
        for name, value in ours.items():  # name the variable that does not parse
            source.env_vars = {name.lower(): value}
            try:
                source()
            except SettingsError:
                raise ConfigError(
                    f"environment variable {name}: {value!r} is not valid JSON (list and table fields take JSON)"
                ) from None
        raise


def _format_errors(exc: ValidationError, source: str) -> str:
    lines = []
    for error in exc.errors():
        where = ".".join(str(part) for part in error["loc"])
        got = error.get("input")
        shown = "" if isinstance(got, dict) else f" (got {got!r})"
        message = error["msg"].removeprefix("Value error, ")
        lines.append(
            f"{where}: {message}{shown}" if where else message
        )  # a whole-file check names its fields
    return f"invalid config {source}:\n  " + "\n  ".join(lines)


def merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for section, fields in extra.items():
        if isinstance(fields, Mapping) and isinstance(merged.get(section), dict):
            merged[section] = {**merged[section], **fields}
        else:
            merged[section] = fields
    return merged


def load_config(
    path: str | Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    base: Mapping[str, Any] | None = None,
) -> RunConfig:
    """File (optional; or `base`, sections given in code) <- environment overrides <- explicit
    overrides, validated."""
    data = _read_file(Path(path)) if path else {name: dict(value) for name, value in (base or {}).items()}
    data = merge(data, _env_overrides(os.environ if env is None else env))
    if overrides:
        data = merge(data, overrides)
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc, str(path) if path else "(defaults + environment)")) from None
