"""`squall export`: a version the trainer published becomes a Hugging Face folder that
transformers loads with the trainer's logits, with the base model's tokenizer and chat
template, and that `squall inference --model OUT` serves (greedy tokens and logprobs equal to
a plain forward of the exported model)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from squall.cli import main as squall
from squall.local.export import has_chat_template
from squall.shared.keys import Keys
from squall.trainer.publish import Publisher
from squall.trainer.torch_backend import TorchBackend
from tests.inference_helpers import free_port
from tests.tracking_helpers import POLICY, tracking_config
from tests.waiting import wait_for

pytestmark = pytest.mark.redis
VERSION = 3
PROMPT = [{"role": "user", "content": "Tom has 12 apples and gets 7 more. How many apples does Tom have?"}]


@pytest.fixture
def trained(r, redis_url, run_name, tmp_path, monkeypatch):
    """A run folder holding version 3 as the trainer writes it: TorchBackend's weights (here
    moved off the base by seeded noise, standing in for training) through Publisher.write."""
    torch.set_num_threads(1)
    config = tracking_config(tmp_path, run_name, redis_url, [])
    backend = TorchBackend(config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in backend.model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    Publisher(r, Keys(run_name), config.run.dir, keep_versions=2).write(VERSION, backend.weights())
    monkeypatch.setenv("SQUALL_RUN__DIR", config.run.dir)
    monkeypatch.setenv("SQUALL_MODEL__PATH", str(POLICY))
    backend.model.eval()
    return backend.model, run_name, tmp_path


def prompt_ids() -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(POLICY).apply_chat_template(
        PROMPT, add_generation_prompt=True, tokenize=True, return_dict=False
    )


def test_transformers_loads_the_trainers_weights(trained, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, run, _ = trained
    out = tmp_path / "export"
    assert squall(["export", "--run", run, "--version", str(VERSION), str(out)]) == 0
    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    base = AutoModelForCausalLM.from_pretrained(POLICY).eval()
    ids = torch.tensor([prompt_ids()])
    with torch.no_grad():
        want, got, before = model(ids).logits, exported(ids).logits, base(ids).logits
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert (got - before).abs().max() > 1e-2  # the version's weights, not the base model's
    tokenizer, base_tok = AutoTokenizer.from_pretrained(out), AutoTokenizer.from_pretrained(POLICY)
    assert tokenizer.chat_template == base_tok.chat_template
    assert tokenizer.apply_chat_template(
        PROMPT, add_generation_prompt=True, tokenize=False
    ) == base_tok.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False)
    assert json.loads((out / "squall_export.json").read_text())["version"] == VERSION
    assert has_chat_template(out)
    assert not list(tmp_path.glob(".export.tmp-*"))


def test_errors_name_what_is_wrong(trained, tmp_path, capsys):
    _, run, _ = trained
    assert squall(["export", "--run", run, "--version", "7", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert "no weights for version 7" in err and f"v{VERSION:06d}" in err, err
    out = tmp_path / "b"
    out.mkdir()
    assert squall(["export", "--run", run, "--version", str(VERSION), str(out)]) == 2
    assert "pass --force" in capsys.readouterr().err
    assert squall(["export", "--run", run, "--version", str(VERSION), "--force", str(out)]) == 0
    assert (out / "model.safetensors").exists()
    from safetensors.torch import save_file

    wrong = tmp_path / "wrong.safetensors"
    save_file({"embed.weight": torch.zeros(2, 2)}, str(wrong))
    assert (
        squall(
            ["export", "--run", run, "--version", str(VERSION), "--weights", str(wrong), str(tmp_path / "c")]
        )
        == 2
    )
    assert "does not fit the base model" in capsys.readouterr().err
    assert (
        squall(
            ["export", "--run", run, "--version", str(VERSION), "--model", str(tmp_path), str(tmp_path / "d")]
        )
        == 2
    )
    assert "no config.json" in capsys.readouterr().err


@pytest.mark.slow
def test_squall_inference_serves_the_export(trained, tmp_path):
    import httpx
    from transformers import AutoModelForCausalLM

    _, run, _ = trained
    out = tmp_path / "export"
    assert squall(["export", "--run", run, "--version", str(VERSION), str(out)]) == 0
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SQUALL_")}
    cmd = [
        sys.executable,
        "-m",
        "squall.cli",
        "inference",
        "--model",
        str(out),
        "--no-follow",
        "--port",
        str(port),
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:

        def healthy() -> bool:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            try:
                return httpx.get(f"{url}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(healthy, 120, "squall inference on the exported folder", interval=0.3)
        ids = prompt_ids()
        body = {
            "model": "policy",
            "prompt": ids,
            "max_tokens": 6,
            "temperature": 0,
            "logprobs": 1,
            "return_token_ids": True,
        }
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
    finally:
        proc.terminate()
        proc.wait(30)
    choice = reply["choices"][0]
    served, served_logprobs = choice["token_ids"], choice["logprobs"]["token_logprobs"]
    # The same greedy continuation and logprobs from a plain forward of the exported folder.
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    seq, want = list(ids), []
    with torch.no_grad():
        for token in served:
            logprobs = torch.log_softmax(model(torch.tensor([seq])).logits[0, -1], dim=-1)
            assert int(logprobs.argmax()) == token
            want.append(float(logprobs[token]))
            seq.append(token)
    assert served_logprobs == pytest.approx(want, abs=1e-3)
