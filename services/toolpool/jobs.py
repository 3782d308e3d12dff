"""The functions rq runs for each tool, in a work horse forked from a `squall worker` process.

Each takes plain JSON arguments (the pool serialises jobs as JSON, never pickle: whoever can
write a job into Redis must not be able to run code in the worker), checks them, and returns
plain JSON. Wrong arguments and tool failures raise ToolError: rq records the job as failed
with that message, which is what the calling agent sees. The pool's settings (limits,
corpora, databases) come from `configure`, called once per worker process before it forks.
"""

from __future__ import annotations

from typing import Any

from squall.shared.config import WorkerSection
from squall.shared.errors import ToolError
from squall.toolpool import judges, retrieval, sqltool
from squall.toolpool.sandbox import Limits, run_python

MAX_CODE_CHARS = 20_000
MAX_QUERY_CHARS = 2_000
MAX_SQL_CHARS = 10_000
MAX_K = 50

_settings = WorkerSection()


def configure(settings: WorkerSection, warm: bool = True) -> None:
    """Use `settings` for every later job of this process; build the retrieval indexes now
    (before rq forks its work horses) when `warm`."""
    global _settings
    _settings = settings
    if warm:
        for name in settings.corpora:
            retrieval.index_for(name, settings.corpora)


def settings() -> WorkerSection:
    return _settings


def _text(value: Any, name: str, limit: int) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ToolError(f"argument {name!r} must be a non-empty string, got {type(value).__name__}")
    if len(value) > limit:
        raise ToolError(f"argument {name!r} is {len(value)} characters long; the limit is {limit}")
    return value


def limits() -> Limits:
    s = _settings
    return Limits(
        cpu_s=s.code_cpu_s,
        memory_mb=s.code_memory_mb,
        file_mb=s.code_file_mb,
        processes=s.code_processes,
        wall_s=s.code_wall_s,
        output_bytes=s.code_output_bytes,
    )


def ping(value: Any = None) -> Any:
    """The trivial job (benchmarks, health checks): returns its argument."""
    return value


def run_code(code: Any) -> dict[str, Any]:
    """Run model-written Python in the sandbox; a limit hit is a result (reason, detail), not a failure."""
    result = run_python(_text(code, "code", MAX_CODE_CHARS), limits(), _settings.sandbox_python)
    return {**result.to_dict(), "text": result.text()}


def search(query: Any, k: Any = 3, corpus: Any = "default") -> list[dict[str, Any]]:
    """The `k` best documents of `corpus` for `query` (BM25)."""
    query = _text(query, "query", MAX_QUERY_CHARS)
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_K:
        raise ToolError(f"argument 'k' must be an integer from 1 to {MAX_K}, got {k!r}")
    index = retrieval.index_for(_text(corpus, "corpus", 100), _settings.corpora)
    return retrieval.search(index, query, k)


def _database(db: Any) -> str:
    name = _text(db, "db", 100)
    if name not in _settings.databases:
        known = sorted(_settings.databases) or "none"
        raise ToolError(f"unknown database {name!r}: this pool serves {known} (worker.databases)")
    return _settings.databases[name]


def run_sql(sql: Any, db: Any = "default") -> dict[str, Any]:
    """One read-only SELECT on database `db`: {"columns", "rows", "truncated"}."""
    s = _settings
    return sqltool.query(_database(db), _text(sql, "sql", MAX_SQL_CHARS), s.sql_timeout_s, s.sql_max_rows)


def judge(kind: Any, prediction: Any, reference: Any, db: Any = "default") -> dict[str, Any]:
    """Score `prediction` against `reference` with judge `kind`: {"score", "detail"}.

    `sql`: both are queries on database `db`; 1 when their results hold the same rows
    (order ignored); a prediction that fails to run scores 0 with the error as detail.
    """
    if not isinstance(kind, str):
        raise ToolError(f"argument 'kind' must be a string naming a judge: {list(judges.KNOWN)}")
    if kind != "sql":
        return {"score": judges.by_name(kind)(prediction, reference), "detail": kind}
    path, s = _database(db), _settings
    gold = sqltool.query(path, _text(reference, "reference", MAX_SQL_CHARS), s.sql_timeout_s, 10_000)
    try:
        got = sqltool.query(path, _text(prediction, "prediction", MAX_SQL_CHARS), s.sql_timeout_s, 10_000)
    except ToolError as exc:
        return {"score": 0.0, "detail": str(exc)}
    same = judges.result_rows(got["rows"]) == judges.result_rows(gold["rows"])
    return {"score": float(same), "detail": "same rows" if same else "different rows"}
