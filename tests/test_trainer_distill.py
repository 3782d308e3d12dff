"""On-policy distillation against a real teacher server (`squall inference`, tiny models):
the teacher's prompt logprobs over the student's own tokens equal a local forward of the
teacher, a teacher with another tokenizer is refused, the per-token advantage is the negative
reverse KL (plus the mixed task advantage), and a trainer run with a teacher trains its step
on those advantages."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_gateway_agents import start_inference
from test_trainer_loop import retag, run_until_step
from test_trainer_step import config_for, sampled_trajectory

from squall.inference.tiny import build_tiny_model, default_corpus
from squall.shared import bus
from squall.shared.keys import GROUP_TRAINER, Keys
from squall.shared.ledger import Ledger
from squall.shared.schemas import Trajectory, decode
from squall.trainer.distill import Teacher, TokenizerMismatch, distill_advantages
from squall.trainer.sequences import trajectory_to_samples
from squall.trainer.trainer import Trainer

pytestmark = [pytest.mark.slow]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill")
    student = build_tiny_model(root / "student", seed=0)
    # Same corpus and vocabulary size: the same tokenizer, other weights.
    teacher = build_tiny_model(root / "teacher", corpus=default_corpus(0), seed=1)
    other = build_tiny_model(root / "other", vocab_size=300, seed=0)  # another tokenizer
    return student, teacher, other


@pytest.fixture(scope="module")
def teacher_url(models, tmp_path_factory):
    proc, url = start_inference(
        str(models[1]), tmp_path_factory.mktemp("teacher"), "--served-name", "teacher"
    )
    yield url
    proc.terminate()
    proc.wait(10)


def test_teacher_logprobs_on_student_tokens_equal_a_local_forward(models, teacher_url):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    student_dir, teacher_dir, _ = models
    tokenizer = AutoTokenizer.from_pretrained(student_dir)
    teacher = Teacher(teacher_url, "teacher", timeout_s=30)
    teacher.check_tokenizer(tokenizer)  # same tokenizer: accepted
    student = AutoModelForCausalLM.from_pretrained(student_dir)
    gen = torch.Generator().manual_seed(0)
    prompt = tokenizer.encode("12 + 7 =", add_special_tokens=True)
    with torch.no_grad():  # the student samples its own continuation
        ids = list(prompt)
        for _ in range(12):
            probs = torch.softmax(student(input_ids=torch.tensor([ids])).logits[0, -1], -1)
            ids.append(int(torch.multinomial(probs, 1, generator=gen)))
    got = teacher.prompt_logprobs(ids)
    local = AutoModelForCausalLM.from_pretrained(teacher_dir).eval()
    with torch.no_grad():
        logits = local(input_ids=torch.tensor([ids])).logits[0, :-1].float()
    want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1).numpy()
    assert got[0] == 0.0
    np.testing.assert_allclose(got[1:], want, atol=2e-4)
    student_lp = torch.log_softmax(student(input_ids=torch.tensor([ids])).logits[0, :-1].float(), -1)
    assert not np.allclose(
        got[1:],
        student_lp.gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1).detach().numpy(),
        atol=1e-2,
    )
    teacher.close()


def test_a_teacher_with_another_tokenizer_is_refused(models, teacher_url):
    from transformers import AutoTokenizer

    teacher = Teacher(teacher_url, "teacher", timeout_s=30)
    with pytest.raises(
        TokenizerMismatch, match="tokenizes differently from the student .* first differ at token"
    ):
        teacher.check_tokenizer(AutoTokenizer.from_pretrained(models[2]))
    teacher.close()


def test_advantage_is_the_negative_reverse_kl_plus_the_mixed_task_advantage():
    from squall.shared.schemas import Turn, pack_logprobs, pack_tokens

    t = Trajectory(
        run="t", task_id="g:0", group_id="g", sample_id="g", index=0, group_size=2, attempt=0, runner_id="r",
        status="ok", reward=1.0, turns=[Turn(model="policy", prompt_ids=pack_tokens([1, 2]), response_ids=pack_tokens([3, 4]),
                                              response_logprobs=pack_logprobs([-1.0, -2.0]), version=0)],
    )  # fmt: skip
    (sample,) = trajectory_to_samples(t, advantage=0.5)
    teacher = np.asarray([0.0, -9.0, -0.5, -3.0], np.float32)  # positions 0, 1 are prompt: ignored
    np.testing.assert_allclose(distill_advantages(sample, teacher), [0, 0, 0.5, -1.0])
    np.testing.assert_allclose(
        distill_advantages(sample, teacher, coef=2.0, reward_coef=0.5), [0, 0, 1.0 + 0.25, -2.0 + 0.25]
    )


@pytest.mark.redis
def test_a_trainer_step_distils_from_the_teacher(models, teacher_url, tmp_path, r, redis_url, run_name):
    torch.set_num_threads(1)
    config = config_for(
        tmp_path,
        models[0],
        groups_per_step=1,
        group_wait_s=30.0,
        distill_url=teacher_url,
        distill_model="teacher",
    )
    config = config.model_copy(
        update={"run": config.run.model_copy(update={"name": run_name, "redis_url": redis_url})}
    )
    keys = Keys(run_name)
    bus.ensure_group(r, keys.trajectories, GROUP_TRAINER)
    trainer = Trainer(config)
    model = trainer.backend.model
    # Every reward equal: GRPO alone would filter the group (zero variance); OPD trains it.
    group = [sampled_trajectory(model, "a", i, 1.0, seed=i, turns=2) for i in range(4)]
    bus.publish_many(r, keys.trajectories, [retag(t, run_name) for t in group])
    run_until_step(trainer, 1)
    assert {Ledger(r, keys).state_of(t.key) for t in group} == {"trained"}
    (metrics,) = [decode(f[b"m"]).values for _, f in r.xrange(keys.metrics)]
    assert metrics["distill/tokens"] == metrics["tokens"] == 40
    assert metrics["distill/reverse_kl"] != 0.0 and metrics["advantage_abs_max"] == 0.0
    assert metrics["pg_loss"] != 0.0  # the distillation advantages, not the (absent) task ones


def test_prompt_logprobs_bad_requests_name_the_field(teacher_url):
    import httpx

    body = {"model": "teacher", "prompt": [1, 2, 3], "max_tokens": 1}
    top = httpx.post(f"{teacher_url}/v1/completions", json={**body, "prompt_logprobs": 5}, timeout=30)
    assert top.status_code == 400 and "prompt_logprobs" in top.json()["error"]["message"]
    streamed = httpx.post(
        f"{teacher_url}/v1/completions", json={**body, "prompt_logprobs": 0, "stream": True}, timeout=30
    )
    assert streamed.status_code == 400 and "prompt_logprobs needs stream = false" in streamed.text
    plain = httpx.post(f"{teacher_url}/v1/completions", json=body, timeout=30).json()
    assert "prompt_logprobs" not in plain["choices"][0]  # only when asked for
