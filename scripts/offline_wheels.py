"""Collect the wheels an offline machine needs to run squall, for that machine's Python.

GPU nodes are often cut off from PyPI but come with PyTorch (and often transformers) already
installed. This resolves squall and the requirements given against the target's Python version
and platform (pip's own resolver, `--dry-run --report`), leaves out what the target already has
(`--skip`, or a `pip freeze` of it with `--have`), downloads the rest as wheels with squall's own
wheel built from this checkout, and writes `install.sh`, which installs them there with no index:

    python scripts/offline_wheels.py --out .wheelhouse --python-version 3.12 --extras ml,data \
        --skip transformers,tokenizers,safetensors,huggingface-hub,numpy,pyarrow,pandas,accelerate,peft \
        trl==1.16.0 datasets==5.2.0 openai pytest pytest-timeout
    # copy .wheelhouse to the target, then there:
    sh .wheelhouse/install.sh /tmp/site && export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH

install.sh ends with `pip check`, so a package that was skipped but is missing on the target, or
a carried wheel that shadows a version the target's packages need, is named there before
anything runs. docs/gpu.md uses it for the race on a GPU machine.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
# PyTorch brings its CUDA libraries as wheels of their own; a node with torch has them all.
TORCH_STACK = ("torch", "triton", "nvidia-*", "cuda-*")
DEFAULT_PLATFORM = "manylinux_2_28_x86_64"
LEGACY_MANYLINUX = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}


def skipped(name: str, patterns: list[str]) -> bool:
    """Is the canonical `name` one of the canonical patterns ('name' or 'prefix-*')?"""
    return any(
        name == pattern or (pattern.endswith("*") and name.startswith(pattern[:-1])) for pattern in patterns
    )


def names_in_freeze(path: Path) -> list[str]:
    """Distribution names in `pip freeze` output (name==version, name @ url, -e lines ignored)."""
    names = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith(("#", "-")):
            names.append(re.split(r"[=<>@ ;\[]", line, maxsplit=1)[0])
    return names


def platform_tags(platform: str) -> list[str]:
    """A manylinux_2_Y tag and every older one a machine with that glibc also runs.

    pip takes `--platform` literally, and many wheels are tagged only manylinux2014 (glibc 2.17).
    """
    found = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", platform)
    if not found:
        return [platform]
    newest, arch = int(found.group(1)), found.group(2)
    tags = []
    for minor in range(newest, 4, -1):
        tags.append(f"manylinux_2_{minor}_{arch}")
        if minor in LEGACY_MANYLINUX:
            tags.append(f"{LEGACY_MANYLINUX[minor]}_{arch}")
    return tags


def target_options(args: argparse.Namespace) -> list[str]:
    platforms = [option for tag in platform_tags(args.platform) for option in ("--platform", tag)]
    return ["--only-binary=:all:", "--python-version", args.python_version, *platforms]


def build_squall_wheel(out: Path) -> Path:
    # setuptools builds in the source tree; remove only the work folders it adds (an editable
    # install keeps its squall.egg-info there)
    before = {*ROOT.glob("*.egg-info"), ROOT / "build"}
    before = {path for path in before if path.exists()}
    with tempfile.TemporaryDirectory() as build:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "wheel",
                "-q",
                "--no-deps",
                "--no-build-isolation",
                "-w",
                build,
                str(ROOT),
            ],
            capture_output=True,
            text=True,
            cwd=build,
        )
        if done.returncode != 0:
            sys.exit(f"offline_wheels: building squall's wheel failed:\n{done.stderr.strip()}")
        (wheel,) = Path(build).glob("squall-*.whl")
        target = out / wheel.name
        shutil.move(wheel, target)
    for leftover in {*ROOT.glob("*.egg-info"), ROOT / "build"} - before:
        shutil.rmtree(leftover, ignore_errors=True)
    return target


def squall_root(args: argparse.Namespace) -> str:
    return f"squall[{args.extras}]" if args.extras else "squall"


def resolve(args: argparse.Namespace, squall_wheel: Path) -> list[dict]:
    """pip's install report for the target: one entry per distribution, squall's included."""
    with tempfile.TemporaryDirectory() as work:
        report = Path(work) / "report.json"
        command = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--dry-run",
            "--ignore-installed",
            "--report",
            str(report),
            *target_options(args),
            f"{squall_root(args)} @ {squall_wheel.as_uri()}",
            *args.requirements,
        ]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            # a pip.conf's unreachable find-links print one warning per package; keep the rest
            said = [line for line in done.stderr.splitlines() if "is ignored" not in line]
            sys.exit(
                f"offline_wheels: pip could not resolve for Python {args.python_version} on "
                f"{args.platform}:\n" + "\n".join(said) + "\nEvery package must have a wheel for "
                "that target (--only-binary); pin another version of the one named, or pass --platform."
            )
        return json.loads(report.read_text())["install"]


def target_markers(args: argparse.Namespace) -> dict[str, str]:
    """The environment markers of the target, for reading its requirements' conditions."""
    markers = default_environment()
    markers.update(python_version=args.python_version, python_full_version=f"{args.python_version}.0")
    if "linux" in args.platform:
        markers.update(sys_platform="linux", platform_system="Linux", os_name="posix")
    arch = re.search(r"(x86_64|aarch64|ppc64le|s390x|i686|armv7l)$", args.platform)
    if arch:
        markers["platform_machine"] = arch.group(1)
    return markers


def needed(entries: list[dict], roots: list[str], patterns: list[str], markers: dict) -> set[str]:
    """The distributions reachable from the roots without passing through a skipped one.

    A package the target has brings what it needs, so what only it needs (torch's sympy and
    networkx, say) is left out too; what squall or a requirement also needs directly stays.
    """
    requires = {
        canonicalize_name(entry["metadata"]["name"]): entry["metadata"].get("requires_dist", [])
        for entry in entries
    }
    keep: set[str] = set()
    seen: set[tuple[str, frozenset]] = set()
    stack = [(canonicalize_name(root.name), frozenset(root.extras)) for root in map(Requirement, roots)]
    while stack:
        name, extras = stack.pop()
        if (name, extras) in seen or name not in requires:
            continue
        seen.add((name, extras))
        if skipped(name, patterns):
            continue
        keep.add(name)
        for text in requires[name]:
            requirement = Requirement(text)
            wanted_here = requirement.marker is None or any(
                requirement.marker.evaluate({**markers, "extra": extra}) for extra in (extras or {""})
            )
            if wanted_here:
                stack.append((canonicalize_name(requirement.name), frozenset(requirement.extras)))
    return keep


def download(args: argparse.Namespace, specs: list[str], out: Path) -> None:
    if not specs:
        return
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            *target_options(args),
            "-d",
            str(out),
            *specs,
        ],
        check=True,
    )


INSTALL_SH = """#!/bin/sh
# Installs the wheels beside this file with no index into the folder given (default
# /tmp/squall-site), then checks that each of them finds its dependencies, there or among the
# interpreter's own packages. Use: sh install.sh [FOLDER] [PYTHON]; then
# export PYTHONPATH=FOLDER PATH=FOLDER/bin:$PATH.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
site=${1:-/tmp/squall-site}
python=${2:-python3}
"$python" -m pip install -q --upgrade --no-index --no-deps --target "$site" "$here"/*.whl
# pip check also reports the machine's own faults; only lines about the wheels here stop it
PYTHONPATH="$site" "$python" -m pip check > "$site/pip-check.txt" 2>&1 || true
if tr '_.' '--' < "$site/pip-check.txt" | grep -i -f "$here/names.txt"; then
  echo "install.sh: a wheel here misses a dependency on this machine (add it to the wheelhouse:"
  echo "offline_wheels.py without it in --skip), or shadows a version the machine's packages"
  echo "need (add that one to --skip); then install again"
  exit 1
fi
echo "install.sh: $(ls "$here"/*.whl | wc -l) wheels installed in $site, their dependencies met"
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("requirements", nargs="*", help="more requirements beside squall")
    parser.add_argument("--out", type=Path, default=ROOT / ".wheelhouse")
    parser.add_argument("--python-version", default="3.12", help="the target's Python, e.g. 3.12")
    parser.add_argument("--platform", default=DEFAULT_PLATFORM, help="the target's wheel platform tag")
    parser.add_argument("--extras", default="ml", help="squall's extras to install (comma-separated)")
    parser.add_argument(
        "--skip",
        default="",
        help="comma-separated distributions the target has already ('name' or 'prefix-*'): "
        "they are left out, with what only they need; the torch stack always is",
    )
    parser.add_argument("--have", type=Path, help="`pip freeze` of the target: skip all of it")
    args = parser.parse_args()

    args.out = args.out.resolve()
    names = [*TORCH_STACK, *filter(None, args.skip.split(","))]
    if args.have:
        names += names_in_freeze(args.have)
    patterns = [canonicalize_name(name) for name in names]
    if args.out.exists():
        shutil.rmtree(args.out)
    args.out.mkdir(parents=True)

    squall_wheel = build_squall_wheel(args.out)
    entries = resolve(args, squall_wheel)
    roots = [squall_root(args), *args.requirements]
    keep = needed(entries, roots, patterns, target_markers(args))
    pins = {canonicalize_name(e["metadata"]["name"]): e["metadata"]["version"] for e in entries}
    wanted = sorted(name for name in keep if name != "squall")
    download(args, [f"{name}=={pins[name]}" for name in wanted], args.out)
    (args.out / "install.sh").write_text(INSTALL_SH)
    # install.sh's patterns for the `pip check` lines that are about the wheels here: one of
    # them lacks a dependency, or replaced a version the machine's own packages need
    (args.out / "names.txt").write_text(
        "".join(f"^{name} \nyou have {name} \n" for name in ["squall", *wanted])
    )
    left_out = sorted(f"{name}=={pins[name]}" for name in pins if name not in keep)
    (args.out / "left-out.txt").write_text("".join(f"{line}\n" for line in left_out))
    wheels = sorted(args.out.glob("*.whl"))
    size = sum(wheel.stat().st_size for wheel in wheels)
    print(
        f"offline_wheels: {len(wheels)} wheels, {size / 2**20:.1f} MiB in {args.out} for Python "
        f"{args.python_version} on {args.platform}; left out as already there "
        f"({len(left_out)}): {args.out / 'left-out.txt'}"
    )


if __name__ == "__main__":
    main()
