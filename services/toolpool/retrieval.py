"""BM25 retrieval over a corpus file, served by the pool's `retrieval` queue.

A corpus is a .jsonl file of {"id", "title", "text"} rows. Its index (bm25s: a maintained
BM25 library on sparse matrices; English stop words, no stemming) is built once per worker
process, before the first job, so that every forked work horse shares it.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from squall.shared.errors import ToolError


@dataclass
class Index:
    docs: list[dict[str, Any]]
    retriever: Any  # bm25s.BM25


_INDEXES: dict[str, Index] = {}
_LOCK = threading.Lock()


def load_corpus(path: str | Path) -> list[dict[str, Any]]:
    docs = []
    with Path(path).open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                docs.append({"id": str(row["id"]), "title": row.get("title", ""), "text": row["text"]})
    if not docs:
        raise ToolError(f"corpus {path} has no rows: write {{id, title, text}} JSON lines")
    return docs


def build(path: str | Path) -> Index:
    import bm25s

    docs = load_corpus(path)
    tokens = bm25s.tokenize([f"{d['title']} {d['text']}" for d in docs], stopwords="en", show_progress=False)
    retriever = bm25s.BM25()
    retriever.index(tokens, show_progress=False)
    return Index(docs, retriever)


def index_for(name: str, corpora: dict[str, str]) -> Index:
    """The index of corpus `name` (built on first use); unknown names list the known ones."""
    if name not in corpora:
        raise ToolError(
            f"unknown corpus {name!r}: this pool serves {sorted(corpora) or 'none'} (worker.corpora)"
        )
    with _LOCK:
        if name not in _INDEXES:
            _INDEXES[name] = build(corpora[name])
        return _INDEXES[name]


def search(index: Index, query: str, k: int) -> list[dict[str, Any]]:
    """The `k` best documents for `query`, best first, with their BM25 scores."""
    import bm25s

    k = min(k, len(index.docs))
    tokens = bm25s.tokenize([query], stopwords="en", show_progress=False)
    if not tokens.vocab or not any(tokens.ids):
        return []
    found, scores = index.retriever.retrieve(tokens, k=k, show_progress=False, n_threads=1)
    hits = []
    for position, score in zip(found[0].tolist(), scores[0].tolist(), strict=True):
        if score > 0:
            hits.append({**index.docs[int(position)], "score": round(float(score), 4)})
    return hits
