"""Running squall on one machine: `squall up` (up.py, its child services procs.py and progress
line progress.py), `squall init` (init.py), `squall redis` (redis_cmd.py), `squall export`
(export.py)."""
