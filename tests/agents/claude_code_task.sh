#!/usr/bin/env bash
# Claude Code (the npm CLI `claude`, unchanged) on a small repository task, as a runner's
# `--agent-cmd "bash tests/agents/claude_code_task.sh"`. The task JSON on stdin:
#   {"files": {"path": "content", ...}, "prompt": "...", "test": "shell command", "max_turns": 3,
#    "max_output_tokens": 256, "cli_args": ["--tools", "Read,Edit", ...]}
# The files become a fresh git repository; Claude Code works in it in print mode, pointed at the
# attempt by its own environment (ANTHROPIC_BASE_URL / ANTHROPIC_API_KEY, which the runner sets;
# telemetry, auto-update and other non-essential traffic off; a HOME of its own). The reward on
# stdout is 1 when the task's test command then passes, else 0. Claude Code's own exit status
# and output go to stderr: a refused request (say, a prompt longer than the model's context)
# is the gateway's to report, which fails the attempt with the reason.
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
turns=$(jq -r '.max_turns // 3' <<<"$task")
output_tokens=$(jq -r '.max_output_tokens // 256' <<<"$task") # Claude Code asks for 128k otherwise
mapfile -t cli_args < <(jq -r '.cli_args // [] | .[]' <<<"$task") # more of claude's own flags
cd "$work/repo"
git init -q . && git add -A && git -c user.name=squall -c user.email=squall@localhost commit -qm task

status=0
HOME="$work/home" \
  ANTHROPIC_BASE_URL="${ANTHROPIC_BASE_URL:-${OPENAI_BASE_URL%/v1}}" \
  ANTHROPIC_API_KEY="${ANTHROPIC_API_KEY:-squall}" \
  CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 DISABLE_TELEMETRY=1 DISABLE_AUTOUPDATER=1 \
  DISABLE_ERROR_REPORTING=1 DISABLE_BUG_COMMAND=1 CLAUDE_CODE_MAX_RETRIES=1 \
  CLAUDE_CODE_MAX_OUTPUT_TOKENS="$output_tokens" \
  timeout "${CLAUDE_TIMEOUT_S:-240}" claude -p "$prompt" --max-turns "$turns" \
  --permission-mode acceptEdits --output-format json "${cli_args[@]}" </dev/null >"$work/claude.json" 2>"$work/claude.err" \
  || status=$?
echo "claude exited with $status: $(head -c 2000 "$work/claude.json") $(tail -c 2000 "$work/claude.err")" >&2
if bash -c "$check" >/dev/null 2>&1; then echo 1; else echo 0; fi
