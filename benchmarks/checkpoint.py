"""Checkpoint save time with a large done set: the whole set rewritten into meta.json at every
commit (before) vs this commit's keys in meta.json plus one line appended to done.jsonl (now).

    .venv/bin/python benchmarks/checkpoint.py [--keys 1000000] [--per-commit 32] [--repeat 5]

The backend state is a 1-byte file, so the numbers are the done set's cost alone (a real
model's state.pt adds the same to both).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from squall.trainer.checkpoint import CheckpointStore, DoneDelta, TrainerState, fsync_dir, fsync_file


def tiny_backend(path: Path) -> None:
    path.write_bytes(b"\0")


def save_whole(root: Path, state: TrainerState) -> None:
    """The previous format: meta.json with the whole done set, fsync, rename."""
    tmp, final = root / ".tmp-whole", root / f"ckpt-{state.commit:08d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    tiny_backend(tmp / "state.pt")
    meta = {"commit": state.commit, "step": state.step, "version": state.version, "trained": state.trained,
            "consumed": state.consumed, "done_groups": state.done_groups}  # fmt: skip
    (tmp / "meta.json").write_text(json.dumps(meta))
    for path in tmp.iterdir():
        fsync_file(path)
    fsync_dir(tmp)
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    fsync_dir(root)


def build_state(n_keys: int) -> TrainerState:
    state = TrainerState(commit=1, step=n_keys // 32, version=n_keys // 32)
    state.trained = {f"run-{i // 8:07d}:{i % 8}#0": i // 32 + 1 for i in range(n_keys)}
    state.consumed = {f"run-f{i // 8:06d}:{i % 8}#0": "zero_variance" for i in range(n_keys // 10)}
    state.done_groups = [f"run-{g:07d}" for g in range(n_keys // 8)]
    return state


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--keys", type=int, default=1_000_000, help="trained keys in the done set")
    parser.add_argument("--per-commit", type=int, default=32, help="keys one commit adds")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    state = build_state(args.keys)
    work = Path(tempfile.mkdtemp(prefix="squall-ckpt-bench-"))
    try:
        whole_s, delta_s = [], []
        (work / "whole").mkdir()
        store = CheckpointStore(work / "delta")
        store.save(state, tiny_backend)  # the first commit of this store holds everything once
        for i in range(args.repeat):
            state.commit += 1
            delta = DoneDelta(
                {f"new-{i}-{k}#0": state.step for k in range(args.per_commit)}, {}, [f"new-{i}"]
            )
            state.add(delta)
            start = time.perf_counter()
            save_whole(work / "whole", state)
            whole_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            store.save(state, tiny_backend, delta)
            delta_s.append(time.perf_counter() - start)
        meta_whole = (work / "whole" / f"ckpt-{state.commit:08d}" / "meta.json").stat().st_size
        meta_delta = (store.list()[-1] / "meta.json").stat().st_size
        start = time.perf_counter()
        loaded, _ = CheckpointStore(work / "delta").latest()
        load_s = time.perf_counter() - start
        assert loaded.trained == state.trained and loaded.consumed == state.consumed
        print(f"done set: {len(state.trained):,} trained + {len(state.consumed):,} consumed keys, "
              f"{len(state.done_groups):,} groups; {args.per_commit} keys per commit; median of {args.repeat}")  # fmt: skip
        print(f"{'':28}{'whole set (before)':>20}{'delta + log (now)':>20}")
        print(f"{'save per commit':28}{statistics.median(whole_s) * 1000:>17.1f} ms"
              f"{statistics.median(delta_s) * 1000:>17.1f} ms")  # fmt: skip
        print(f"{'meta.json size':28}{meta_whole / 1e6:>17.1f} MB{meta_delta / 1e3:>17.1f} kB")
        print(f"resume (read log + meta, whole set back in memory): {load_s:.2f} s")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
