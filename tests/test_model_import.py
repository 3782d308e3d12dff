"""`squall model import`: the real model's folder as it imported, and GGUF files it must refuse."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from squall.local.model_import import ImportFailed, import_gguf


def write_gguf(path, arch: str) -> None:
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), arch=arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_unsupported_architecture_is_refused_naming_the_known_ones(tmp_path):
    gguf = tmp_path / "odd.gguf"
    write_gguf(gguf, "rwkv7")
    with pytest.raises(ImportFailed, match=r"'rwkv7' model.*supported architectures: .*llama"):
        import_gguf(gguf, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_cli_refuses_a_file_that_is_not_gguf(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_text("not a gguf file")
    run = subprocess.run([sys.executable, "-m", "squall.cli", "model", "import", str(bad), str(tmp_path / "o")],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 2
    assert "is not a readable GGUF file" in run.stderr


def test_existing_output_needs_force(tmp_path):
    gguf = tmp_path / "x.gguf"
    write_gguf(gguf, "llama")
    (tmp_path / "out").mkdir()
    with pytest.raises(ImportFailed, match="already exists; pass --force"):
        import_gguf(gguf, tmp_path / "out")


@pytest.mark.realmodel
def test_real_model_folder_is_an_ordinary_hf_folder(real_model):
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(real_model)
    assert config.model_type == "llama" and config.tie_word_embeddings
    assert "quantization_config" not in json.loads((real_model / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(real_model)
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    generation = json.loads((real_model / "generation_config.json").read_text())
    assert tokenizer.convert_ids_to_tokens(generation["eos_token_id"]) == "<|im_end|>"
    from safetensors import safe_open

    with safe_open(str(real_model / "model.safetensors"), "np") as f:
        names = set(f.keys())
        assert str(f.get_slice("model.embed_tokens.weight").get_dtype()) in ("F32", "float32")
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names  # tied
    assert len(names) == 272  # 30 layers x 9 tensors + embeddings + final norm
