"""SQL against a read-only SQLite database, served by the pool's `sql` queue (and the `sql` judge).

Model-written SQL is contained by SQLite itself, not by the process sandbox: the file is
opened read-only (`mode=ro`), an authorizer refuses ATTACH/DETACH (which could create files)
and every write, one statement per call, and a progress handler interrupts a query that runs
past its deadline (a recursive CTE that never ends stops with a clear error).
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any

from squall.shared.errors import ToolError

PROGRESS_EVERY = 10_000  # SQLite VM instructions between deadline checks
_ALLOWED = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION, sqlite3.SQLITE_RECURSIVE}


def _authorize(action: int, *_: Any) -> int:
    return sqlite3.SQLITE_OK if action in _ALLOWED else sqlite3.SQLITE_DENY


def connect(path: str | Path) -> sqlite3.Connection:
    if not Path(path).is_file():
        raise ToolError(f"database file {path} does not exist")
    conn = sqlite3.connect(f"file:{Path(path).resolve()}?mode=ro", uri=True, check_same_thread=False)
    conn.set_authorizer(_authorize)
    return conn


def query(path: str | Path, sql: str, timeout_s: float, max_rows: int) -> dict[str, Any]:
    """Run one SELECT; {"columns", "rows", "truncated"}; any failure is a ToolError saying why."""
    conn = connect(path)
    deadline = time.monotonic() + timeout_s
    conn.set_progress_handler(lambda: int(time.monotonic() > deadline), PROGRESS_EVERY)
    try:
        cursor = conn.execute(sql)
        rows = cursor.fetchmany(max_rows + 1)
        columns = [d[0] for d in cursor.description or ()]
    except sqlite3.OperationalError as exc:
        if "interrupted" in str(exc):
            raise ToolError(f"SQL error: the query ran longer than {timeout_s:g} s and was stopped") from None
        raise ToolError(f"SQL error: {exc}") from None
    except (sqlite3.DatabaseError, sqlite3.Warning, sqlite3.ProgrammingError, ValueError) as exc:
        raise ToolError(f"SQL error: {exc}") from None
    finally:
        conn.close()
    return {"columns": columns, "rows": [list(r) for r in rows[:max_rows]], "truncated": len(rows) > max_rows}
