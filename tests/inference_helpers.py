"""Helpers for the inference tests: a real node on a free port in a background thread,
the tiny model, a model taught to call a tool, and logprobs recomputed by a plain forward."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from squall.inference.node import InferenceNode
from squall.shared.config import load_config

API_KEY = "sk-test"

CALC_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
TOOL_QUESTION = [{"role": "user", "content": "What is 12 * 7?"}]
TOOL_ARGS = {"expression": "12 * 7"}
TOOL_ANSWER = "The answer is 84."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class NodeThread:
    """`squall inference` in a thread of this process, on a free port (a real uvicorn server)."""

    def __init__(self, model_dir: str | Path, **inference: Any) -> None:
        port = free_port()
        run = inference.pop("run", {})
        trainer = inference.pop("trainer", {})  # e.g. lora_rank: a vLLM node enables LoRA from it
        section = {"port": port, "follow_weights": False, "max_batch": 16, "max_model_len": 1024, **inference}
        self.config = load_config(env={}, overrides={"inference": section, "run": run, "trainer": trainer})
        self.node = InferenceNode(self.config, str(model_dir))
        self.url = f"http://127.0.0.1:{port}"
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        try:
            asyncio.run(self.node.serve())
        except BaseException as exc:  # surfaced by start()
            self.error = exc

    def start(self, timeout_s: float = 60.0) -> NodeThread:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.node.ready.wait(0.05):
            if self.error is not None or not self._thread.is_alive():
                raise RuntimeError(f"inference node failed to start: {self.error!r}")
            if time.monotonic() > deadline:
                raise TimeoutError("inference node did not start in time")
        return self

    def stop(self) -> None:
        self.node.stop()
        self._thread.join(30)

    def client(self, **kwargs: Any) -> Any:
        import openai

        return openai.OpenAI(
            base_url=f"{self.url}/v1", api_key=kwargs.pop("api_key", API_KEY), max_retries=0, **kwargs
        )


def load_model(model_dir: str | Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


@torch.inference_mode()
def recompute_logprobs(model: Any, prompt_ids: list[int], token_ids: list[int]) -> list[float]:
    """log p(token_ids[i] | prompt, token_ids[:i]) from one plain forward pass, temperature 1."""
    ids = torch.tensor([prompt_ids + token_ids])
    logprobs = torch.log_softmax(model(ids).logits[0].float(), dim=-1)  # (T, V)
    start = len(prompt_ids) - 1
    return [float(logprobs[start + i, t]) for i, t in enumerate(token_ids)]


def teach_tool_use(model_dir: str | Path, out_dir: str | Path, steps: int = 300) -> Path:
    """Overfit the tiny model on one conversation: call `calculator`, then answer.

    A random tiny model never emits a well-formed tool call; one that memorised a real
    conversation does, greedily, so the round trip through the server is tested honestly.
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = load_model(model_dir).train()
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "calculator", "arguments": json.dumps(TOOL_ARGS)},
    }
    turns = [
        TOOL_QUESTION,
        [
            *TOOL_QUESTION,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "84"},
        ],
    ]
    targets = [
        f'<tool_call>\n{{"name": "calculator", "arguments": {json.dumps(TOOL_ARGS)}}}\n</tool_call><|im_end|>',
        f"{TOOL_ANSWER}<|im_end|>",
    ]
    batch = []
    for messages, target in zip(turns, targets, strict=True):
        prompt = tokenizer.apply_chat_template(
            messages, tools=[CALC_TOOL], add_generation_prompt=True, tokenize=False
        )
        p = tokenizer.encode(prompt, add_special_tokens=False)
        t = tokenizer.encode(target, add_special_tokens=False)
        batch.append((torch.tensor([p + t]), len(p)))
    # 1e-2 memorised on one CPU and diverged on another (same versions, other summation
    # order): 3e-3 memorises on both within the steps, and the loss check below says so if not.
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = 0.0
        for ids, n_prompt in batch:
            logits = model(ids).logits[0, n_prompt - 1 : -1]
            loss = loss + torch.nn.functional.cross_entropy(logits, ids[0, n_prompt:])
        loss.backward()
        optimizer.step()
    assert float(loss) < 0.05, (
        f"teach_tool_use: the tiny model did not memorise the conversation (loss {float(loss):.3f})"
    )
    model.eval().save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    return Path(out_dir)


# --- the serving contract, checked the same way on every backend ----------------------------
CHAT_MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hello! How are you?"},
]
LOGPROB_TOLERANCE = 1e-4  # float32 on both sides; kernels may sum in another order


def perturbed_versions(model_dir: str | Path) -> dict[int, Any]:
    """Version 0 (the model directory) and version 1 (every parameter perturbed)."""
    import copy

    base = load_model(model_dir)
    changed = copy.deepcopy(base)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in changed.parameters():  # tied weights appear once, so they stay tied
            param.add_(torch.randn(param.shape, generator=gen) * 0.5)
    return {0: base, 1: changed}


def response_text(tokenizer: Any, token_ids: list[int], finish_reason: str | None) -> str:
    """The documented relation: text is the decoding of token_ids without a final eos."""
    ids = token_ids[:-1] if finish_reason == "stop" and token_ids[-1] == tokenizer.eos_token_id else token_ids
    return tokenizer.decode(ids, skip_special_tokens=False)


def assert_logprobs_match(model: Any, prompt_ids: list[int], token_ids: list[int], logprobs: list[float],
                          tol: float = LOGPROB_TOLERANCE) -> None:  # fmt: skip
    import math

    assert len(logprobs) == len(token_ids)
    assert all(math.isfinite(x) for x in logprobs)
    expected = recompute_logprobs(model, prompt_ids, token_ids)
    assert max(abs(a - b) for a, b in zip(logprobs, expected, strict=True)) < tol


def check_n_choices_differ_and_a_seed_repeats_them(client: Any) -> None:
    def ask() -> list[list[int]]:
        reply = client.chat.completions.create(
            model="policy", messages=CHAT_MESSAGES, max_tokens=12, n=3, seed=1234,
            extra_body={"return_token_ids": True},
        )  # fmt: skip
        return [c.model_extra["token_ids"] for c in sorted(reply.choices, key=lambda c: c.index)]

    first = ask()
    assert len(first) == 3 and len({tuple(ids) for ids in first}) == 3
    assert ask() == first


def check_streaming_contract(client: Any, model: Any, tokenizer: Any, same_text: Any = None) -> None:
    """Streamed chunks add up to the non-streamed contract: ids, text, logprobs, version, usage.

    `same_text(text, expected, finish_reason)` compares the text (a backend may differ on a
    trailing half character, see docs/inference.md).
    """
    stream = client.chat.completions.create(
        model="policy", messages=CHAT_MESSAGES, max_tokens=20, stream=True, logprobs=True,
        stream_options={"include_usage": True}, extra_body={"return_token_ids": True},
    )  # fmt: skip
    text, token_ids, logprobs, prompt_ids, finish, versions, usage = "", [], [], None, None, set(), None
    for chunk in stream:
        versions.add(chunk.model_extra["weight_version"])
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
            token_ids += c.model_extra["token_ids"]
            logprobs += [e.logprob for e in c.logprobs.content]
            prompt_ids = c.model_extra.get("prompt_token_ids", prompt_ids)
            finish = c.finish_reason or finish
    assert versions == {0} and finish in ("stop", "length")
    expected = response_text(tokenizer, token_ids, finish)
    assert same_text(text, expected, finish) if same_text else text == expected, (
        text,
        expected,
    )
    assert_logprobs_match(model, prompt_ids, token_ids, logprobs)
    assert usage.completion_tokens == len(token_ids)


def check_completions_contract(client: Any, model: Any, tokenizer: Any, same_text: Any = None) -> None:
    """/v1/completions on token ids: ids round-trip, text decodes from them, logprobs match the
    model, and a stop string cuts the same sampled continuation (same seed) before itself."""
    prompt_ids = tokenizer.encode("The quick brown fox", add_special_tokens=False)
    base = client.completions.create(
        model="policy", prompt=prompt_ids, max_tokens=40, seed=5, logprobs=1,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )  # fmt: skip
    choice = base.choices[0]
    assert choice.model_extra["prompt_token_ids"] == prompt_ids
    token_ids = choice.model_extra["token_ids"]
    assert len(token_ids) == 40 and choice.finish_reason == "length"
    expected = tokenizer.decode(token_ids, skip_special_tokens=False)
    assert same_text(choice.text, expected, choice.finish_reason) if same_text else choice.text == expected
    assert_logprobs_match(model, prompt_ids, token_ids, choice.logprobs.token_logprobs)
    stop = choice.text[10:12]
    cut = client.completions.create(
        model="policy", prompt=prompt_ids, max_tokens=40, seed=5, stop=[stop],
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )  # fmt: skip
    c = cut.choices[0]
    assert c.finish_reason == "stop" and c.text == choice.text[: choice.text.index(stop)]
    assert token_ids[: len(c.model_extra["token_ids"])] == c.model_extra["token_ids"]
    assert stop in tokenizer.decode(c.model_extra["token_ids"], skip_special_tokens=False)


def weight_errors(node: NodeThread) -> dict[str, float]:
    """Weight versions the node refused so far, by reason (its /metrics counter)."""
    out = {}
    for line in httpx.get(f"{node.url}/metrics").text.splitlines():
        if line.startswith("squall_inference_weight_errors_total{"):
            out[line.split('reason="')[1].split('"')[0]] = float(line.split()[-1])
    return out


def random_adapter(model, folder, *, version: int, seed: int):
    """A rank-8 adapter with random A and B on every q_proj and v_proj of `model`, written by the
    trainer's adapter writer (peft's layout); returns its checksum and the model it makes
    (the torch engine's merge, which tests/test_trainer_lora.py checks against peft's)."""
    from squall.inference.weights.adapters import merged_copy
    from squall.trainer.publish import write_adapter

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, module in model.named_modules():
        if name.endswith(("q_proj", "v_proj")):
            out_features, in_features = module.weight.shape
            tensors[f"base_model.model.{name}.lora_A.weight"] = (
                torch.randn(8, in_features, generator=gen) * 0.3
            )
            tensors[f"base_model.model.{name}.lora_B.weight"] = (
                torch.randn(out_features, 8, generator=gen) * 0.3
            )
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 8, "lora_alpha": 16, "lora_dropout": 0.0,
        "target_modules": ["q_proj", "v_proj"], "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
        "use_dora": False, "modules_to_save": None, "base_model_name_or_path": None,
    }  # fmt: skip
    checksum = write_adapter(folder, tensors, config, version=version)
    return checksum, merged_copy(model, folder)
