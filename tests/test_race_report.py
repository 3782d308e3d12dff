"""The race's report on made-up runs: time and steps to a target, the summary's cells.

Pure functions of the results benchmarks/race.py records; the harness itself (training and
scoring) is tests/test_race.py.
"""

from __future__ import annotations

from benchmarks.race import final_lines, steps_to_target, summary, time_to_target, untrained


def run(points: list[tuple[int, float, float]], wall: float = 240.0) -> dict:
    """A run whose checkpoints are (step, seconds, held-out reward), after the base model's 0.2."""
    return {
        "rc": 0,
        "wall_s": wall,
        "steps": len(points),
        "checkpoints": [{"step": step, "time_s": t, "path": f"ckpt-{step}"} for step, t, _ in points],
        "curve": [(0.0, 0.2)] + [(t, reward) for _, t, reward in points],
    }


def test_time_and_steps_to_a_target_come_from_the_first_checkpoint_at_it() -> None:
    r = run([(1, 30.0, 0.5), (2, 40.0, 0.85), (3, 50.0, 0.7), (4, 60.0, 0.95)])
    assert time_to_target(r["curve"], 0.8, r["wall_s"]) == (40.0, True)
    assert steps_to_target(r, 0.8) == 2
    assert steps_to_target(r, 0.9) == 4
    assert time_to_target(r["curve"], 0.99, r["wall_s"]) == (240.0, False)
    assert steps_to_target(r, 0.99) is None


def test_the_base_model_meeting_the_target_does_not_count() -> None:
    r = run([(1, 30.0, 0.1)])
    assert time_to_target(r["curve"], 0.2, r["wall_s"]) == (240.0, False)
    assert steps_to_target(r, 0.2) is None


def test_summary_gives_median_and_spread_and_counts_misses() -> None:
    repeats = [
        {"a": run([(1, 30.0, 0.9)]), "b": run([(3, 90.0, 0.9)], wall=200.0)},
        {"a": run([(2, 50.0, 0.9)]), "b": run([(1, 20.0, 0.5)], wall=200.0)},
        {"a": run([(4, 70.0, 0.9)]), "b": run([(2, 60.0, 0.95)], wall=200.0)},
    ]
    lines = summary(repeats, [0.9], 0.9).splitlines()
    assert lines[0] == "| contender | time to 0.9 s | steps to 0.9 | s per step |"
    assert lines[2] == "| a | 50 (30-70) | 2 (1-4) | 240.0 (240.0-240.0) |"
    # b missed once: charged its whole 200 s there; its steps count only the runs that reached it
    assert lines[3] == "| b | 90 (60-200), 1 not reached | 2 (2-3) | 200.0 (200.0-200.0) |"


def timed(seconds: float) -> dict:
    return {"time_to_target_s": seconds}


def test_the_race_line_compares_median_times_and_lists_each_repeats_ratios() -> None:
    repeats = [
        {"squall_async": timed(50.0), "squall_sync": timed(100.0), "trl": timed(200.0)},
        {"squall_async": timed(40.0), "squall_sync": timed(30.0), "trl": timed(240.0)},
        {"squall_async": timed(60.0), "squall_sync": timed(90.0), "trl": timed(180.0)},
    ]
    assert final_lines(repeats, 0.9) == [
        "race repeats: speedup_vs_trl=[4.00, 6.00, 3.00] async_vs_sync=[2.00, 0.75, 1.50]",
        "race: target=0.9 squall_async_s=50 squall_sync_s=90 trl_s=200 speedup_vs_trl=4.00 async_vs_sync=1.80",
    ]


def test_without_trl_the_line_is_async_against_sync_and_without_sync_there_is_none() -> None:
    repeats = [{"squall_async": timed(40.0), "squall_sync": timed(60.0)}]
    assert final_lines(repeats, 0.8) == [
        "race async vs sync: target=0.8 squall_async_s=40 squall_sync_s=60 async_vs_sync=1.50"
    ]
    assert final_lines([{"squall_async": timed(40.0), "trl": timed(90.0)}], 0.8) == []


def test_a_run_that_did_not_train_is_named_with_its_warnings_and_log() -> None:
    idle = run([], wall=69.0) | {"warnings": ["agent 'a' failed 16 attempts in a row"], "log": "sq/log.txt"}
    crashed = run([(1, 30.0, 0.5)]) | {"rc": 1, "log": "trl/log.txt"}
    repeats = [
        {"squall_async": idle, "trl": run([(1, 30.0, 0.5)])},
        {"squall_async": run([]), "trl": crashed},
    ]
    lines = untrained(repeats)
    assert lines[0] == (
        "race: repeat 1 squall_async left no checkpoint in 69 s; it warned: agent 'a' failed 16 "
        "attempts in a row; its log: sq/log.txt"
    )
    assert lines[1].startswith("race: repeat 2 squall_async left no checkpoint in 240 s; its log:")
    assert lines[2] == "race: repeat 2 trl exited 1; its log: trl/log.txt"
    assert untrained([{"trl": run([(1, 30.0, 0.5)])}]) == []
