"""`squall peek STREAM [-n N]`: print a stream's newest entries decoded to JSON lines.

The run's Redis is found as `squall status` finds it (shared.runlookup); a run with no key in
any Redis looked in is an error (exit 2) naming where it looked."""

from __future__ import annotations

import argparse
import sys

from squall.shared.cliargs import add_common_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("stream", help="short stream name (tasks, trajectories, weights, ...) or a full key")
    parser.add_argument("-n", type=int, default=10, help="entries to show, newest last (default 10)")
    parser.add_argument("--oldest", action="store_true", help="show the oldest entries instead")
    add_common_arguments(parser)


def main(args: argparse.Namespace) -> int:
    import orjson

    from squall.shared import schemas
    from squall.shared.cliargs import config_from_args
    from squall.shared.errors import SchemaError
    from squall.shared.keys import Keys
    from squall.shared.runlookup import find_run_for

    config = config_from_args(args)
    keys = Keys(config.run.name)
    names = keys.stream_names()
    stream = names.get(args.stream, args.stream)
    if not stream.startswith("squall:"):
        print(f"unknown stream {args.stream!r}: known are {', '.join(names)}", file=sys.stderr)
        return 2
    r = find_run_for(args, config, "peek")
    if r is None:
        return 2
    if args.oldest:
        entries = r.xrange(stream, count=args.n)
    else:
        entries = list(reversed(r.xrevrange(stream, count=args.n)))
    for entry_id, fields in entries:
        out: dict = {"id": entry_id.decode()}
        raw = fields.get(schemas.ENTRY_FIELD)
        if raw is None:  # dead-letter records and other plain-field entries
            out.update({k.decode(): _show(v) for k, v in fields.items()})
        else:
            try:
                out.update(schemas.to_jsonable(schemas.decode(raw)))
            except SchemaError as exc:
                out["undecodable"] = str(exc)
        sys.stdout.write(orjson.dumps(out, default=str).decode() + "\n")
    return 0


def _show(value: bytes) -> str:
    try:
        return value.decode()
    except UnicodeDecodeError:
        return value.hex()
