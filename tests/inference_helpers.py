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
        section = {"port": port, "follow_weights": False, "max_batch": 16, "max_model_len": 1024, **inference}
        self.config = load_config(env={}, overrides={"inference": section, "run": run})
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
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = 0.0
        for ids, n_prompt in batch:
            logits = model(ids).logits[0, n_prompt - 1 : -1]
            loss = loss + torch.nn.functional.cross_entropy(logits, ids[0, n_prompt:])
        loss.backward()
        optimizer.step()
    model.eval().save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    return Path(out_dir)
