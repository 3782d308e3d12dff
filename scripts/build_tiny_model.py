"""Build a tiny random Qwen2 model + BPE tokenizer offline (see squall.inference.tiny).

    python scripts/build_tiny_model.py --out runs/tiny --seed 0 [--corpus FILE] [--hidden 64] [--layers 2]

FILE is a text file, one corpus line per line (the default corpus is built in).
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, help="output model directory")
    parser.add_argument("--seed", type=int, default=0, help="seed for the default corpus and the weights")
    parser.add_argument("--corpus", default=None, help="text file, one training line per line")
    parser.add_argument("--vocab", type=int, default=512, help="vocabulary size incl. 256 bytes + specials")
    parser.add_argument("--hidden", type=int, default=64, help="hidden size")
    parser.add_argument("--layers", type=int, default=2, help="number of transformer layers")
    parser.add_argument("--heads", type=int, default=4, help="attention heads")
    parser.add_argument("--max-positions", type=int, default=1024, help="max_position_embeddings")
    args = parser.parse_args(argv)

    import torch

    from squall.inference.tiny import build_tiny_model

    torch.set_num_threads(1)
    corpus = None
    if args.corpus:
        with open(args.corpus, encoding="utf-8") as f:
            corpus = [line.rstrip("\n") for line in f if line.strip()]
    out = build_tiny_model(
        args.out,
        corpus=corpus,
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=args.heads,
        max_position_embeddings=args.max_positions,
        seed=args.seed,
    )
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
