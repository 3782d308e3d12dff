"""Tiny offline models: a byte-level BPE tokenizer and a small Qwen2 causal LM, built from scratch.

Tests, the demo and CPU development need a real transformers model directory without any
download from a model hub. `build_tiny_model(out_dir)` writes one (config.json,
model.safetensors, generation_config.json, tokenizer files with the project's chat template)
that `AutoModelForCausalLM.from_pretrained(out_dir)` and `AutoTokenizer.from_pretrained(out_dir)`
load offline, in a few seconds, deterministically for a given seed.

Tokenizer: byte-level BPE trained with `tokenizers` on a small corpus, with Qwen2's
normalizer/pre-tokenizer (NFC, Qwen2 split regex, byte-level) because AutoTokenizer loads the
directory as a `Qwen2Tokenizer`, which rebuilds that pipeline. All 256 bytes are in the base
alphabet, so any text encodes without <unk>, and `decode(encode(text)) == text` exactly for
NFC text (all ASCII; no whitespace clean-up). Digits are single tokens (Qwen's `\\p{N}` split,
same effect as `Digits(individual_digits=True)`), which keeps arithmetic copyable. Special tokens (one id each, in this order from id 0): see `SPECIAL_TOKENS`.

Chat template: the project's format, `squall.inference.chat_format.CHAT_TEMPLATE`.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from squall.inference.chat_format import CHAT_TEMPLATE, EOS_TOKEN, PAD_TOKEN, SPECIAL_TOKENS

# Qwen2's split: single digits (`\\p{N}`), words with one leading non-letter, punctuation runs, newlines.
PRETOKENIZE_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""


_NAMES = ("Tom", "Ana", "Lee", "Mia", "Sam", "Kai", "Zoe", "Ben")
_THINGS = ("apples", "books", "coins", "cards", "stamps", "pens", "eggs", "shells")
_DEFAULT_CHAT = (
    "You are a helpful assistant.",
    "Hello! How can I help you today?",
    "What is the capital of France? The capital of France is Paris.",
    "Please answer with a single number.",
    "The answer is 42.",
    "Use the calculator tool when you need to compute something.",
    "Thanks, that was helpful. You're welcome!",
    'The quick brown fox jumps over the lazy dog. {"key": "value", "list": [1, 2, 3]}',
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "Symbols: ~ ` ! @ # $ % ^ & * ( ) - _ = + [ ] { } | \\ ; : ' \" , . < > / ?",
)


def default_corpus(seed: int = 0, n_problems: int = 300) -> list[str]:
    """A small built-in corpus: chat snippets, tool-call JSON and arithmetic, all ASCII."""
    rng = random.Random(seed)
    texts = list(_DEFAULT_CHAT)
    for _ in range(n_problems):
        a, b = rng.randint(1, 999), rng.randint(1, 999)
        op = rng.choice("+-*")
        who, what = rng.choice(_NAMES), rng.choice(_THINGS)
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        texts.append(f"{who} has {a} {what} and gets {b} more. How many {what} does {who} have?")
        texts.append(json.dumps({"name": "calculator", "arguments": {"expression": f"{a} {op} {b}"}}))
        texts.append(f"{a} {op} {b} = {value}. The answer is {value}.")
    return texts


def build_tokenizer(corpus: Iterable[str], vocab_size: int = 512) -> Any:
    """Train a byte-level BPE tokenizer on `corpus`; returns a `PreTrainedTokenizerFast`.

    `vocab_size` is an upper bound (a small corpus yields fewer merges); it counts the 256 byte
    tokens and the special tokens, so it must be at least 263.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    floor = 256 + len(SPECIAL_TOKENS)
    if vocab_size < floor:
        raise ValueError(f"vocab_size={vocab_size} is too small: need at least {floor} (bytes + specials)")
    tok = Tokenizer(models.BPE())
    # Exactly the pipeline transformers' Qwen2Tokenizer rebuilds on load (AutoTokenizer picks that
    # class from config.json's model_type), so the trained merges and the loaded tokenizer agree.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_strings(corpus), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in (EOS_TOKEN, PAD_TOKEN)],
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 30,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _strings(corpus: Iterable[str]) -> Iterator[str]:
    for text in corpus:
        if not isinstance(text, str):
            raise TypeError(f"corpus items must be str, got {type(text).__name__}")
        yield text


def build_tiny_model(
    out_dir: str | Path,
    *,
    corpus: Iterable[str] | None = None,
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    max_position_embeddings: int = 1024,
    seed: int = 0,
) -> Path:
    """Write a randomly initialised tiny Qwen2 model + tokenizer to `out_dir`; returns the path.

    Deterministic for a given (corpus, sizes, seed): same files, same weights.
    """
    tokenizer = build_tokenizer(default_corpus(seed) if corpus is None else corpus, vocab_size)
    sizes = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 4,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
    )
    return _write_qwen2(out_dir, tokenizer, sizes, max_position_embeddings, seed)


def _write_qwen2(
    out_dir: str | Path, tokenizer: Any, sizes: dict[str, int], max_positions: int, seed: int
) -> Path:
    """A Qwen2 of `sizes`, randomly initialised from `seed`, saved with `tokenizer` (whose
    end-of-turn and padding tokens it uses) as a transformers folder."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    eos_id, pad_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN), tokenizer.convert_tokens_to_ids(PAD_TOKEN)
    config = Qwen2Config(
        **sizes,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        use_sliding_window=False,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=None)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


# Real architectures' shapes, for measuring speed and memory without a hub download.
MODEL_SHAPES: dict[str, dict[str, int]] = {
    "qwen2-0.5b": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
    ),
}


def build_shaped_model(
    out_dir: str | Path, shape: str, *, seed: int = 0, max_position_embeddings: int = 32768
) -> Path:
    """A randomly initialised Qwen2 of a real architecture's shape (`MODEL_SHAPES`), with the
    tiny tokenizer: the same compute and memory per token as the real model, for benchmarks
    only (it samples noise; ids past the tokenizer's vocabulary decode to nothing)."""
    if shape not in MODEL_SHAPES:
        raise ValueError(f"unknown model shape {shape!r}: known are {', '.join(sorted(MODEL_SHAPES))}")
    return _write_qwen2(
        out_dir, build_tokenizer(default_corpus(seed)), MODEL_SHAPES[shape], max_position_embeddings, seed
    )
