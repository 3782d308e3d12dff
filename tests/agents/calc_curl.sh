#!/usr/bin/env bash
# The calculator agent in bash: curl for HTTP, jq for JSON, awk for arithmetic; no Python.
# Run by a runner as `--agent-cmd "bash tests/agents/calc_curl.sh"`: the task JSON on stdin
# ({"question", "answer"}), the attempt's endpoint in OPENAI_BASE_URL / OPENAI_API_KEY /
# OPENAI_MODEL, the reward (1 or 0: is the last integer of the final reply the answer?) on stdout.
# The first call asks for a tool call (tool_choice "required"); later calls let the model choose.
set -euo pipefail

task=$(cat)
question=$(jq -r '.question' <<<"$task")
answer=$(jq -r '.answer' <<<"$task")
seed=$(jq -c '.seed // null' <<<"$task") # a task may fix the sampling seed (tests do, to repeat a run)
url="${OPENAI_BASE_URL%/}/chat/completions"
tools='[{"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic",
  "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]'
messages=$(jq -cn --arg q "$question" \
  '[{role: "system", content: "Solve the problem. Reply with the number."}, {role: "user", content: $q}]')
choice='"required"'

calculate() { # one arithmetic expression; anything but digits, + - * / % ( ) . and spaces is refused
  if [[ "$1" =~ ^[0-9+*/%().\ -]+$ ]]; then
    awk "BEGIN { print ($1) }" 2>&1 || echo "error: cannot evaluate $1"
  else
    echo "error: not an arithmetic expression: $1"
  fi
}

content=""
for _ in 1 2 3 4; do
  body=$(jq -cn --arg model "${OPENAI_MODEL:-policy}" --argjson messages "$messages" \
    --argjson tools "$tools" --argjson choice "$choice" --argjson seed "$seed" \
    '{model: $model, messages: $messages, tools: $tools, tool_choice: $choice, max_tokens: 64}
     + (if $seed == null then {} else {seed: $seed} end)')
  reply=$(curl -sS --fail-with-body --max-time 60 -H "content-type: application/json" \
    -H "authorization: Bearer ${OPENAI_API_KEY:-none}" --data-binary "$body" "$url")
  message=$(jq -c '.choices[0].message' <<<"$reply")
  messages=$(jq -c --argjson m "$message" '. + [$m]' <<<"$messages")
  content=$(jq -r '.content // ""' <<<"$message")
  calls=$(jq -c '.tool_calls // [] | .[]' <<<"$message")
  [ -z "$calls" ] && break
  while IFS= read -r call; do
    id=$(jq -r '.id' <<<"$call")
    expression=$(jq -r '.function.arguments | fromjson? | .expression // ""' <<<"$call")
    result=$(calculate "$expression")
    messages=$(jq -c --arg id "$id" --arg r "$result" '. + [{role: "tool", tool_call_id: $id, content: $r}]' <<<"$messages")
  done <<<"$calls"
  choice='"auto"'
done

last=$(grep -oE -- '-?[0-9]+' <<<"$content" | tail -n 1 || true)
if [ -n "$last" ] && [ "$last" = "$answer" ]; then echo 1; else echo 0; fi
