#!/usr/bin/env bash
# The Codex CLI (`codex`, npm, unchanged) on a small repository task, as a runner's
# `--agent-cmd "bash tests/agents/codex_task.sh"`: the same task JSON as claude_code_task.sh.
# Codex is pointed at the attempt by its own configuration: a model provider named squall whose
# base_url is OPENAI_BASE_URL, on the Responses wire API, key from OPENAI_API_KEY, in a
# CODEX_HOME of its own. The reward on stdout is 1 when the task's test then passes, else 0.
set -euo pipefail

task=$(cat)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/repo" "$work/home"
while IFS= read -r path; do
  mkdir -p "$(dirname "$work/repo/$path")"
  jq -r --arg p "$path" '.files[$p]' <<<"$task" >"$work/repo/$path"
done < <(jq -r '.files | keys[]' <<<"$task")
prompt=$(jq -r '.prompt' <<<"$task")
check=$(jq -r '.test' <<<"$task")
cat >"$work/home/config.toml" <<TOML
model = "${OPENAI_MODEL:-policy}"
model_provider = "squall"
model_reasoning_effort = "none"

[model_providers.squall]
name = "squall"
base_url = "${OPENAI_BASE_URL}"
env_key = "OPENAI_API_KEY"
wire_api = "responses"
request_max_retries = 0
stream_max_retries = 0
TOML
cd "$work/repo"
git init -q . && git add -A && git -c user.name=squall -c user.email=squall@localhost commit -qm task

status=0
HOME="$work/home" CODEX_HOME="$work/home" \
  timeout "${CODEX_TIMEOUT_S:-240}" codex exec --skip-git-repo-check --sandbox workspace-write "$prompt" \
  </dev/null >"$work/codex.out" 2>"$work/codex.err" || status=$?
echo "codex exited with $status: $(tail -c 2000 "$work/codex.out") $(tail -c 2000 "$work/codex.err")" >&2
if bash -c "$check" >/dev/null 2>&1; then echo 1; else echo 0; fi
