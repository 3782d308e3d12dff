"""On-policy distillation (OPD): a teacher scores the tokens the student sampled.

The teacher is any OpenAI-compatible endpoint that answers vLLM's `prompt_logprobs` on
`/v1/completions` with token-id prompts (vLLM's server; a squall inference node serving the
teacher, `squall inference --no-follow`). For each training sample (the student's own
sequence: prompt, its sampled responses, tool results in between) one request returns
log p_teacher(token t | tokens before t) for every position. On the tokens the student
sampled, the per-token reverse KL KL(student || teacher) has the one-sample estimate
log p_student(y_t) - log p_teacher(y_t), with p_student the behaviour logprob the inference
server returned; its negative is the token's advantage:

    A_t = distill_coef * (teacher_t - behaviour_t) + distill_reward_coef * A_task_t

(A_task_t: the task advantage the estimator gave the token, 0 in a group without reward
variance), so the PPO/TIS loss pushes up tokens the teacher likes more than the student
did and down the others (Agarwal et al. 2024, GKD; Lu and Thinking Machines 2025, "On-policy
distillation"). Every sample's advantages are replaced (Sample.advantages).

The teacher must tokenize like the student: the ids are sent as they are. At start a probe
text is tokenized by both (the endpoint's `prompt_token_ids` with `return_token_ids`) and a
difference refuses the teacher with TokenizerMismatch, naming the first differing position.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import httpx
import numpy as np

from .sequences import Sample

# Letters, digits, spaces, punctuation, accents, CJK and an emoji: two tokenizers that agree
# on this almost surely share their vocabulary and merges.
PROBE = "On-policy distillation probe: 12 + 7 = 19, (x) => x*x; naïve café — 東京 🙂\n\tEnd."
RETRY_BACKOFF_S = 0.5


class TeacherError(RuntimeError):
    """The teacher endpoint did not answer usable logprobs before its deadline."""


class TokenizerMismatch(ValueError):
    """The teacher tokenizes differently from the student: its logprobs would score other tokens."""


class Teacher:
    """A client of the teacher endpoint (`trainer.distill_url`, `trainer.distill_model`)."""

    def __init__(self, url: str, model: str, *, timeout_s: float = 60.0) -> None:
        base = url.rstrip("/")
        self.url = base if base.endswith("/v1") else f"{base}/v1"
        self.model, self.timeout_s = model, timeout_s
        self.client = httpx.Client(timeout=timeout_s)

    def close(self) -> None:
        self.client.close()

    def _post(self, body: dict[str, Any], what: str) -> dict[str, Any]:
        """POST /completions, retried on connection errors and 5xx/429 until timeout_s."""
        deadline, wait, last = time.monotonic() + self.timeout_s, RETRY_BACKOFF_S, ""
        while True:
            try:
                reply = self.client.post(f"{self.url}/completions", json={"model": self.model, **body})
                if reply.status_code < 400:
                    return reply.json()
                last = f"HTTP {reply.status_code}: {reply.text[:300]}"
                if reply.status_code not in (429, 500, 502, 503, 504):
                    raise TeacherError(f"teacher {self.url} refused {what}: {last}")
            except (httpx.HTTPError, ValueError) as exc:
                last = f"{type(exc).__name__}: {exc}"
            if time.monotonic() + wait > deadline:
                raise TeacherError(
                    f"teacher {self.url} gave no {what} within trainer.distill_timeout_s={self.timeout_s}s: {last}"
                )
            time.sleep(wait)
            wait = min(wait * 2, 5.0)

    def check_tokenizer(self, student_tokenizer: Any) -> None:
        """TokenizerMismatch unless the teacher tokenizes PROBE exactly as the student does."""
        reply = self._post(
            {"prompt": PROBE, "max_tokens": 1, "temperature": 0, "return_token_ids": True},
            "a tokenizer probe",
        )
        choice = (reply.get("choices") or [{}])[0]
        teacher = choice.get("prompt_token_ids", reply.get("prompt_token_ids"))
        if teacher is None:
            raise TokenizerMismatch(
                f"teacher {self.url} does not return prompt_token_ids (return_token_ids): its tokenizer "
                "cannot be checked, so it is refused; serve it with vLLM >= 0.10.2 or `squall inference`"
            )
        student = list(student_tokenizer.encode(PROBE, add_special_tokens=True))
        if list(teacher) != student:
            at = next((i for i, (a, b) in enumerate(zip(teacher, student, strict=False)) if a != b), None)
            at = min(len(teacher), len(student)) if at is None else at
            raise TokenizerMismatch(
                f"teacher {self.url} (model {self.model!r}) tokenizes differently from the student "
                f"(model.path): on a probe text they first differ at token {at} (teacher "
                f"{list(teacher)[at : at + 3]}, student {student[at : at + 3]}). On-policy distillation "
                "scores the student's token ids as they are: use a teacher with the student's tokenizer"
            )

    def prompt_logprobs(self, ids: Sequence[int]) -> np.ndarray:
        """(T,) log p_teacher(ids[t] | ids[:t]); position 0 (no context) is 0."""
        reply = self._post(
            {"prompt": [int(i) for i in ids], "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0},
            "prompt_logprobs",
        )
        entries = (reply.get("choices") or [{}])[0].get("prompt_logprobs")
        if not isinstance(entries, list) or len(entries) != len(ids):
            raise TeacherError(
                f"teacher {self.url}: prompt_logprobs holds {len(entries) if isinstance(entries, list) else 'no'} "
                f"entries for a {len(ids)}-token prompt"
            )
        out = np.zeros(len(ids), np.float32)
        for t in range(1, len(ids)):
            entry = entries[t] or {}
            picked = entry.get(str(int(ids[t]))) or entry.get(int(ids[t]))  # type: ignore[call-overload]
            if picked is None:
                raise TeacherError(f"teacher {self.url}: no logprob for prompt token {t} (id {int(ids[t])})")
            out[t] = float(picked["logprob"] if isinstance(picked, dict) else picked)
        return out


def distill_advantages(
    sample: Sample, teacher_logprobs: np.ndarray, *, coef: float = 1.0, reward_coef: float = 0.0
) -> np.ndarray:
    """(T,) the OPD advantage of each token: coef * (teacher - behaviour) + reward_coef * task,
    0 where the loss mask is 0. Pure."""
    mask = sample.loss_mask > 0
    reverse_kl = sample.behaviour_logprobs - teacher_logprobs  # log p_student - log p_teacher
    adv = -coef * reverse_kl + reward_coef * sample.token_advantages()
    return np.where(mask, adv, 0.0).astype(np.float32)


def apply(
    samples: Sequence[Sample], teacher: Teacher, *, coef: float, reward_coef: float
) -> dict[str, float]:
    """Score every sample with the teacher and set its per-token advantages; the step's
    metrics (mean reverse KL over trained tokens). SFT samples are left alone."""
    total_kl, tokens = 0.0, 0
    for sample in samples:
        if sample.sft:
            continue
        teacher_lp = teacher.prompt_logprobs(sample.input_ids.tolist())
        mask = sample.loss_mask > 0
        total_kl += float((sample.behaviour_logprobs - teacher_lp)[mask].sum())
        tokens += int(mask.sum())
        sample.advantages = distill_advantages(sample, teacher_lp, coef=coef, reward_coef=reward_coef)
    return {"distill/reverse_kl": total_kl / tokens if tokens else 0.0, "distill/tokens": float(tokens)}


def connect(config: Any) -> Teacher | None:
    """The run's teacher (None without trainer.distill_url), its tokenizer checked against the
    student's (model.path): TokenizerMismatch refuses to start the trainer."""
    cfg = config.trainer
    if not cfg.distill_url:
        return None
    from transformers import AutoTokenizer

    teacher = Teacher(cfg.distill_url, cfg.distill_model, timeout_s=cfg.distill_timeout_s)
    teacher.check_tokenizer(AutoTokenizer.from_pretrained(config.model.path))
    return teacher
