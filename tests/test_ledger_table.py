"""The ledger's one table of moves: every entry behaves as declared on a real Redis, and no
service writes attempt states any other way."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from squall.shared.keys import Keys
from squall.shared.ledger import (
    FINISH_BY_STATUS,
    SCHEDULER_OWNED_REASONS,
    TRANSITIONS,
    Actor,
    FilterReason,
    Ledger,
    State,
    filtered_state,
    transition,
)

pytestmark = pytest.mark.redis
SERVICES = Path(__file__).resolve().parents[1] / "services"
ALL_STATES = [s for s in State if s is not State.NEW] + [filtered_state(FilterReason.STALE)]


def put(r, ledger: Ledger, key: str, state: str) -> None:
    """Set up one attempt in `state` (raw move: the tests' privilege, not a service's)."""
    if state != State.NEW:
        assert ledger.move([key], state) == 1


@pytest.mark.parametrize("name", list(TRANSITIONS))
def test_each_move_goes_exactly_from_its_sources(r, run_name, name):
    move = TRANSITIONS[name]
    ledger = Ledger(r, Keys(run_name))
    reason = FilterReason.ZERO_VARIANCE if move.target is None else None
    target = move.target_state(reason)
    for i, start in enumerate([State.NEW, *ALL_STATES]):
        key = f"g0:{i}#0"
        put(r, ledger, key, start)
        moved = ledger.apply(name, [key], reason=reason)
        allowed = start in move.sources and start != target
        assert moved == int(allowed), (name, start)
        assert ledger.state_of(key) == (target if allowed else (None if start == State.NEW else start))
        assert ledger.apply(name, [key], reason=reason) == 0  # a replay changes nothing
    assert ledger.balanced()


def test_moves_queue_on_a_callers_transaction(r, run_name):
    ledger, keys = Ledger(r, Keys(run_name)), Keys(run_name)
    pipe = r.pipeline(transaction=True)
    pipe.xadd(keys.tasks, {"m": b"x"})
    assert ledger.apply("dispatch", ["g0:0#0", "g0:1#0"], pipe=pipe) is None
    pipe.execute()
    assert ledger.counts() == {"dispatched": 2, "pending": 2}


def test_the_table_is_consistent():
    assert set(FINISH_BY_STATUS) == {"ok", "failed", "timeout"}
    assert all(m.actor is Actor.RUNNER for m in FINISH_BY_STATUS.values())
    # Finished-with-an-error attempts are the scheduler's alone (retry or dead-letter): the
    # trainer never moves them, so the two services never overwrite each other.
    errors = {State.FAILED, State.TIMEOUT, State.CANCELLED}
    for move in TRANSITIONS.values():
        if move.actor is Actor.TRAINER:
            assert not move.sources & errors, move
    assert TRANSITIONS["retry"].sources == TRANSITIONS["give_up"].sources == errors
    # Every state but `new` is reachable, and only `new` has no way in.
    targets = {m.target for m in TRANSITIONS.values()}
    assert set(State) - targets == {State.NEW, State.CANCELLED}  # cancelled: set by operators' tools
    with pytest.raises(KeyError, match="known: dispatch"):
        transition("teleport")
    with pytest.raises(ValueError, match="needs a filter reason"):
        TRANSITIONS["filter"].target_state()
    for reason in SCHEDULER_OWNED_REASONS:
        with pytest.raises(ValueError, match="scheduler's to settle"):
            TRANSITIONS["filter"].target_state(reason)
    with pytest.raises(ValueError):
        filtered_state("bored")


def _ledger_writes(tree: ast.AST) -> list[tuple[int, str]]:
    """Calls that write attempt states without the table: Ledger.move/move_in/filtered, or a
    Redis write naming the attempts or ledger hash."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        name = node.func.attr
        if name in ("move", "move_in", "filtered") and "ledger" in ast.unparse(node.func.value).lower():
            found.append((node.lineno, ast.unparse(node)))
        if name in ("hset", "hincrby", "hdel", "hsetnx") and node.args:
            target = ast.unparse(node.args[0])
            if target.endswith((".attempts", ".ledger")):
                found.append((node.lineno, ast.unparse(node)))
    return found


def test_services_move_attempts_only_through_the_table():
    offenders = []
    for path in sorted(SERVICES.rglob("*.py")):
        for line, call in _ledger_writes(ast.parse(path.read_text())):
            offenders.append(f"{path.relative_to(SERVICES.parent)}:{line}: {call}")
    assert not offenders, "ledger writes outside Ledger.apply:\n" + "\n".join(offenders)


def test_lua_scripts_that_move_attempts_are_built_from_the_table():
    """A script literal that writes the attempts hash must include the shared move function."""
    for path in sorted(SERVICES.rglob("*.py")):
        text = path.read_text()
        scripts = [
            node.value
            for node in ast.walk(ast.parse(text))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and "redis.call(" in node.value
        ]
        for script in scripts:
            writes_ledger = "'HINCRBY'" in script or "squall_move(" in script
            if writes_ledger:
                assert "lua_move_function" in text and "'HINCRBY'" not in script, (
                    f"{path}: a Lua ledger write not built from shared.ledger"
                )
