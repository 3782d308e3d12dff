"""The trajectory viewer's data: attempts listed and filtered, one attempt opened turn by turn,
a group's members side by side. Used by the dashboard (`/api/trajectories`, `/api/trajectory/
KEY`, `/api/group/ID`) and by `squall show`.

An attempt is read from the kept sample in the run folder and the live `trajectories` stream
(monitor.rollouts). Opening one decodes every turn's recorded token ids with the run's
tokenizer (model.path, as the tracker does), never re-tokenizing text: what is shown is what
the model saw and sampled. Per turn: the agent and model, whether it was trained, the weight
version and node that served it, latency, finish reason, prompt and response token counts,
the tokens that carried loss (a trained turn's response tokens; none for a frozen one), the
mean logprob, the new part of the prompt since the previous call (tool results, user turns),
the response and any `<tool_call>` blocks in it. Per attempt: reward, the group's advantage
under the trainer's estimator (trainer.advantage) over the group's members found here, the
attempt's ledger state, timings, error and final answer.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from squall.shared import schemas
from squall.shared.errors import ConfigError

from .rollouts import Rollout, read_all

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
LIST_LIMIT = 500  # rows a listing returns at most (newest first)


class NotFound(LookupError):
    """No attempt (or group) with that id among what is kept and live."""


@dataclass(frozen=True)
class Filters:
    """What a listing keeps; None: any."""

    version: int | None = None
    group: str | None = None
    status: str | None = None  # ok | failed | timeout | cancelled
    ledger: str | None = None  # a ledger state, prefix match (`filtered` matches `filtered:overlong`)
    mode: str | None = None  # train | val
    min_reward: float | None = None
    max_reward: float | None = None

    def keep(self, row: dict[str, Any]) -> bool:
        reward = row["reward"]
        return (
            (self.version is None or row["version"] == self.version)
            and (self.group is None or row["group_id"] == self.group)
            and (self.status is None or row["status"] == self.status)
            and (self.ledger is None or (row["ledger"] or "").startswith(self.ledger))
            and (self.mode is None or row["mode"] == self.mode)
            and (self.min_reward is None or (reward is not None and reward >= self.min_reward))
            and (self.max_reward is None or (reward is not None and reward <= self.max_reward))
        )


def _decoder(model_dir: str | None) -> Any:
    if not model_dir or not Path(model_dir).is_dir():
        return None
    from squall.tracking.sources import TextDecoder

    try:
        return TextDecoder(model_dir)
    except ConfigError:
        return None


class TrajectoryView:
    """Attempts of one run: `r`/`keys` for the live stream and ledger (None: the run folder
    only), `run_dir` for the kept sample, `model_dir` for the tokenizer (None: ids only)."""

    def __init__(
        self, r: Any, keys: Any, run_dir: str | None, model_dir: str | None, advantage: str = "grpo"
    ) -> None:
        self.r, self.keys, self.run_dir, self.advantage = r, keys, run_dir, advantage
        self.text = _decoder(model_dir)
        self.model_dir = model_dir

    def rollouts(self) -> list[Rollout]:
        return read_all(self.run_dir, self.r, self.keys)

    def _ledger_states(self, keys: list[str]) -> dict[str, str | None]:
        if self.r is None or not keys:
            return dict.fromkeys(keys)
        values = self.r.hmget(self.keys.attempts, keys)
        return {k: (v.decode() if v is not None else None) for k, v in zip(keys, values, strict=True)}

    def _row(self, rollout: Rollout, ledger: str | None) -> dict[str, Any]:
        t = rollout.trajectory
        return {
            "key": t.key,
            "group_id": t.group_id,
            "index": t.index,
            "group_size": t.group_size,
            "mode": t.mode,
            "version": rollout.version,
            "status": t.status,
            "reward": t.reward,
            "ledger": ledger,
            "turns": len(t.turns),
            "runner": t.runner_id,
            "finished_at": t.finished_at,
            "source": rollout.source,
            "error": (t.error or "")[:200],
        }

    def list(self, filters: Filters = Filters(), limit: int = LIST_LIMIT) -> dict[str, Any]:
        rollouts = self.rollouts()
        states = self._ledger_states([x.key for x in rollouts])
        rows = [self._row(x, states[x.key]) for x in rollouts]
        kept = [row for row in rows if filters.keep(row)]
        kept.reverse()  # newest first
        return {
            "total": len(rows),
            "matched": len(kept),
            "rows": kept[:limit],
            "versions": sorted({row["version"] for row in rows}),
            "ledger_states": sorted({row["ledger"] for row in rows if row["ledger"]}),
            "sources": {s: sum(1 for row in rows if row["source"] == s) for s in ("kept", "live")},
            "decoded": self.text is not None,
        }

    def _find(self, key: str, rollouts: list[Rollout]) -> Rollout:
        found = next((x for x in rollouts if x.key == key), None)
        if found is None:
            where = f"the run folder {self.run_dir}" if self.run_dir else "no run folder"
            raise NotFound(
                f"no trajectory {key!r} in {where} or the live `trajectories` stream "
                f"({len(rollouts)} attempts there): ids look like `<group>:<index>#<attempt>`; "
                "list them with `squall show trajectories`"
            )
        return found

    def _advantages(self, members: list[Rollout]) -> dict[str, float]:
        from squall.trainer.advantages import get_advantage_fn

        scored = [m for m in members if m.trajectory.status == "ok" and m.trajectory.reward is not None]
        if not scored:
            return {}
        values = get_advantage_fn(self.advantage)([m.trajectory.reward for m in scored], [0] * len(scored))
        return {m.key: float(v) for m, v in zip(scored, values, strict=True)}

    def _decode(self, ids: Any) -> str | None:
        return self.text(ids) if self.text is not None else None

    def _turns(self, trajectory: schemas.Trajectory) -> list[dict[str, Any]]:
        out = []
        previous: list[int] = []
        for i, turn in enumerate(trajectory.turns):
            prompt, response = turn.prompt_tokens.tolist(), turn.response_tokens.tolist()
            grew = len(prompt) >= len(previous) and prompt[: len(previous)] == previous and i > 0
            new_prompt = prompt[len(previous) :] if grew else prompt
            response_text = self._decode(response)
            logprobs = turn.logprobs
            out.append(
                {
                    "index": i,
                    "agent": turn.agent,
                    "model": turn.model,
                    "trained": turn.trained,
                    "version": turn.version,
                    "node": turn.node,
                    "latency_s": turn.latency_s,
                    "finish_reason": turn.finish_reason,
                    "prompt_tokens": len(prompt),
                    "response_tokens": len(response),
                    "loss_tokens": len(response) if turn.trained else 0,
                    "mean_logprob": float(logprobs.mean()) if logprobs.size else None,
                    "prompt_continues": grew,
                    "new_prompt_text": self._decode(new_prompt),
                    "prompt_text": self._decode(prompt),
                    "response_text": response_text,
                    "tool_calls": _tool_calls(response_text),
                    **({} if self.text is not None else {"prompt_ids": prompt, "response_ids": response}),
                }
            )
            previous = prompt + response
        return out

    def detail(self, key: str) -> dict[str, Any]:
        rollouts = self.rollouts()
        rollout = self._find(key, rollouts)
        t = rollout.trajectory
        members = _latest_members([x for x in rollouts if x.trajectory.group_id == t.group_id])
        advantages = self._advantages(members)
        rewards = [m.trajectory.reward for m in members if m.trajectory.reward is not None]
        return {
            **self._row(rollout, self._ledger_states([key])[key]),
            "task_id": t.task_id,
            "sample_id": t.sample_id,
            "attempt": t.attempt,
            "min_version": t.min_version,
            "timings": t.timings,
            "final_answer": t.final_answer,
            "error": t.error,
            "payload": rollout.payload,
            "entry": rollout.entry,
            "decoded": self.text is not None,
            "group": {
                "members_found": len(members),
                "mean_reward": sum(rewards) / len(rewards) if rewards else None,
                "advantage": advantages.get(key),
                "estimator": self.advantage,
            },
            "turns": self._turns(t),
        }

    def group(self, group_id: str) -> dict[str, Any]:
        rollouts = self.rollouts()
        members = [x for x in rollouts if x.trajectory.group_id == group_id]
        if not members:
            raise NotFound(f"no group {group_id!r} among the {len(rollouts)} attempts kept and live")
        latest = _latest_members(members)
        advantages = self._advantages(latest)
        states = self._ledger_states([m.key for m in members])
        rows = []
        for m in sorted(members, key=lambda x: (x.trajectory.index, x.trajectory.attempt)):
            turns = m.trajectory.turns
            last = self._decode(turns[-1].response_tokens) if turns else None
            rows.append(
                {
                    **self._row(m, states[m.key]),
                    "advantage": advantages.get(m.key),
                    "final_answer": m.trajectory.final_answer,
                    "last_response": last,
                }
            )
        return {"group_id": group_id, "estimator": self.advantage, "members": rows}


def _latest_members(members: list[Rollout]) -> list[Rollout]:
    """The newest attempt of each member index (a retried member's last try)."""
    latest: dict[int, Rollout] = {}
    for m in members:
        held = latest.get(m.trajectory.index)
        if held is None or m.trajectory.attempt > held.trajectory.attempt:
            latest[m.trajectory.index] = m
    return list(latest.values())


def _tool_calls(text: str | None) -> list[Any]:
    if not text:
        return []
    calls = []
    for body in TOOL_CALL.findall(text):
        try:
            calls.append(json.loads(body))
        except ValueError:
            calls.append(body)
    return calls


def jsonable(value: Any) -> Any:
    """Non-finite floats to None, for JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [jsonable(v) for v in value]
    return value


def resolve_dirs(
    r: Any, keys: Any, config: Any, run_dir: str | None, model_dir: str | None
) -> tuple[str, str]:
    """The run folder and model folder: the flags, else the run's own config (stored in Redis by
    `squall up`), else the local config."""
    stored = None
    if r is not None:
        raw = r.hget(keys.config, "json")
        if raw:
            try:
                stored = json.loads(raw)
            except ValueError:
                stored = None
    run = run_dir or (stored or {}).get("run", {}).get("dir") or config.run.dir
    model = model_dir or (stored or {}).get("model", {}).get("path") or config.model.path
    return run, model
