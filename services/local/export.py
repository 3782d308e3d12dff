"""`squall export --run NAME --version N OUT`: one published weight version as a Hugging Face
model folder, which `AutoModelForCausalLM.from_pretrained(OUT)` and `squall inference --model OUT` load.

OUT gets the base model's files from model.path (config, generation config, tokenizer and
chat template, any custom code) and the version's weights as the trainer published them
(`{run.dir}/weights/v{N:06d}/`: its shards, checked against their index, or its one
model.safetensors; a LoRA version's adapter merged into the base model's weights, W + scale
* B @ A, as inference serves it), as OUT/model.safetensors. The weights must
name exactly the base model's tensors; a tied `lm_head.weight` (the trainer writes it as a
copy of the embeddings) is left out, as `save_pretrained` does. config.json's dtype is set to
the weights' dtype, so `dtype="auto"` loads what was trained. The folder is built under a
temporary name beside OUT and renamed into place, so OUT is never half-written.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from squall.shared.cliargs import add_common_arguments
from squall.shared.errors import ConfigError, WeightsError

WEIGHTS_FILE = "model.safetensors"
# Base-model files that are weights (replaced by the version's) or the trainer's own notes.
SKIPPED_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack")
SKIPPED_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
TIED_HEAD = "lm_head.weight"
PROVENANCE = "squall_export.json"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out", metavar="OUT", help="folder to write (must not exist, or use --force)")
    parser.add_argument("--version", type=int, required=True, help="published weight version to export")
    parser.add_argument("--model", metavar="DIR", help="base model folder (default model.path)")
    parser.add_argument(
        "--weights", metavar="FILE", help="safetensors file to export instead of the run's version N"
    )
    parser.add_argument("--force", action="store_true", help="replace OUT if it exists")
    add_common_arguments(parser)


def main(args: argparse.Namespace) -> int:
    from squall.shared.cliargs import config_from_args

    config = config_from_args(args, model={"path": args.model})
    try:
        weights = Path(args.weights) if args.weights else version_file(config.run.dir, args.version)
        out = export(
            config.model.path,
            weights,
            args.out,
            force=args.force,
            provenance={"run": config.run.name, "version": args.version, "weights": str(weights.resolve())},
        )
    except (ConfigError, WeightsError) as exc:
        print(f"squall export: {exc}", file=sys.stderr)
        return 2
    print(f"squall export: run {config.run.name!r} version {args.version} -> {out}")
    if not has_chat_template(out):
        print(
            f"squall export: note: {config.model.path} has no chat template, so neither has {out}",
            file=sys.stderr,
        )
    return 0


def has_chat_template(folder: Path) -> bool:
    config = folder / "tokenizer_config.json"
    in_config = config.exists() and "chat_template" in json.loads(config.read_text())
    return in_config or (folder / "chat_template.jinja").exists() or (folder / "chat_template.json").exists()


def version_file(run_dir: str, version: int) -> Path:
    """The weights of `version` in the run folder; WeightsError listing those on disk when absent."""
    from squall.shared.adapterfiles import ADAPTER_CONFIG
    from squall.shared.weightfiles import INDEX_FILE, version_dir

    folder = version_dir(run_dir, version)
    if (folder / INDEX_FILE).exists() or (folder / ADAPTER_CONFIG).exists():  # the folder is the weights
        return folder
    path = folder / WEIGHTS_FILE
    if not path.exists():
        root = Path(run_dir) / "weights"
        have = (
            sorted(
                p.name
                for p in root.glob("v*")
                if (p / WEIGHTS_FILE).exists() or (p / INDEX_FILE).exists() or (p / ADAPTER_CONFIG).exists()
            )
            if root.is_dir()
            else []
        )
        raise WeightsError(
            f"no weights for version {version} at {path}; on disk: {', '.join(have) or 'none'} "
            "(the trainer keeps only the newest trainer.keep_versions; check --run / run.dir)"
        )
    return path


def _base_files(model_dir: Path) -> list[str]:
    """The base model's safetensors files (one file or the shards its index names)."""
    index = model_dir / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if index.exists()
        else [WEIGHTS_FILE]
    )
    for name in files:
        if not (model_dir / name).exists():
            raise ConfigError(
                f"model.path {model_dir} has no {name}: it must be a transformers folder with safetensors weights"
            )
    return files


def _base_tensors(model_dir: Path) -> dict[str, str]:
    """Tensor name -> dtype of the base model's safetensors (one file or an index of shards)."""
    from safetensors import safe_open

    out: dict[str, str] = {}
    for name in _base_files(model_dir):
        with safe_open(str(model_dir / name), framework="pt") as handle:
            out.update({key: handle.get_slice(key).get_dtype() for key in handle.keys()})  # noqa: SIM118
    return out


def _check_names(weights: dict[str, Any], base: set[str], tied: bool, source: Path) -> dict[str, Any]:
    """The version's tensors with the tied head dropped; WeightsError when the names differ."""
    if tied and TIED_HEAD in weights and TIED_HEAD not in base:
        weights = {k: v for k, v in weights.items() if k != TIED_HEAD}
    missing, extra = sorted(base - set(weights)), sorted(set(weights) - base)
    if missing or extra:
        raise WeightsError(
            f"{source} does not fit the base model: missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {extra[:5]}{'...' if len(extra) > 5 else ''}; is model.path the model this run trained?"
        )
    return weights


def _read_weights(weights: Path, base_dir: Path) -> dict[str, Any]:
    """The state dict in a safetensors file, in a sharded version's folder (every shard
    checked against the index's sha256), or of the base model with a LoRA version merged in."""
    from safetensors.torch import load_file

    from squall.shared.adapterfiles import ADAPTER_CONFIG

    if (weights / ADAPTER_CONFIG).exists():
        from squall.inference.weights.adapters import merge_into_state

        base = {}
        for name in _base_files(base_dir):
            base.update(load_file(str(base_dir / name)))
        return merge_into_state(base, weights)
    if weights.is_dir():
        from squall.inference.weights.shardload import iter_shards
        from squall.shared.weightfiles import read_index

        index = read_index(weights)
        return {name: tensor for shard in iter_shards(weights, index) for name, tensor in shard.items()}
    try:
        return load_file(str(weights))
    except Exception as exc:  # safetensors raises several types for a bad file
        raise WeightsError(f"{weights} is not a readable safetensors file: {exc}") from None


def export(
    model_dir: str,
    weights: Path,
    out: str | Path,
    *,
    force: bool = False,
    provenance: dict[str, Any] | None = None,
) -> Path:
    """Write base model files + `weights` into `out` (see the module docstring); returns `out`."""
    from safetensors.torch import save_file

    base_dir, out = Path(model_dir), Path(out)
    if not model_dir or not (base_dir / "config.json").exists():
        raise ConfigError(
            f"model.path {model_dir!r} is not a transformers model folder (no config.json); set --model or model.path"
        )
    if not weights.exists():
        raise WeightsError(f"weights file {weights} does not exist")
    if out.exists() and not force:
        raise ConfigError(f"{out} exists; choose another folder or pass --force to replace it")
    config = json.loads((base_dir / "config.json").read_text())
    state = _read_weights(weights, base_dir)
    state = _check_names(
        state, set(_base_tensors(base_dir)), bool(config.get("tie_word_embeddings")), weights
    )
    dtypes = {str(t.dtype).removeprefix("torch.") for t in state.values() if t.is_floating_point()}

    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        for path in sorted(base_dir.iterdir()):
            if path.is_file() and not path.name.endswith(SKIPPED_SUFFIXES) and path.name not in SKIPPED_FILES:
                shutil.copy2(path, tmp / path.name)
        if len(dtypes) == 1:
            config["dtype"] = next(iter(dtypes))
            config.pop("torch_dtype", None)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(state, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / PROVENANCE).write_text(
            json.dumps({**(provenance or {}), "base_model": str(base_dir.resolve())}, indent=2) + "\n"
        )
        if out.exists():
            shutil.rmtree(out)
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
