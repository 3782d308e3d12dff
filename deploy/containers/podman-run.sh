#!/usr/bin/env bash
# A whole squall run with podman alone (no compose): Redis and every service in a container of
# its own, all on one podman network, where each finds the others by service name (redis,
# inference), as in compose.yaml. CI runs exactly this (tests/test_containers.py); docs/containers.md
# walks through it.
#
#   deploy/containers/podman-run.sh up                 # network, volumes, Redis, then the services
#   deploy/containers/podman-run.sh restart trainer    # SIGTERM (drain), then start it again
#   deploy/containers/podman-run.sh down               # stop: runners drain first, Redis last
#   deploy/containers/podman-run.sh purge              # down, then remove volumes and network
#   deploy/containers/podman-run.sh python ARGS...     # a throw-away container: python3 ARGS
#                                                      # (same mounts; e.g. writing the dataset)
#
# Settings (environment variables):
#   SQUALL_NAME         prefix of every container, volume and of the network   (squall)
#   SQUALL_IMAGE        the CPU image (Containerfile.cpu)            (localhost/squall-cpu:latest)
#   SQUALL_REDIS_IMAGE  a Redis image            (docker.io/library/redis:7.2-bookworm; without a
#                       registry: localhost/squall-redis:latest from Containerfile.redis)
#   SQUALL_SECRETS      the folder `squall acl --host redis --acl-mode 644` wrote (required)
#   SQUALL_RUN_TOML     the run file                                 (deploy/containers/run.toml)
#   SQUALL_APP          optional folder mounted read-only at /opt/squall/app and put on
#                       PYTHONPATH: an agent's code and model (an image FROM squall-cpu is the
#                       other way). The run file names paths inside the containers.
#   SQUALL_RUNNERS      how many runner containers                    (2)
#   SQUALL_TOOLPOOL     1: start a tool pool container too            (0)
#   SQUALL_REDIS_PORT   publish Redis on 127.0.0.1:PORT of the host, so `squall status` can read
#                       the run from outside the containers           (unset: not published)
#
# Credentials reach each container as a file of its own, mounted read-only at
# /run/secrets/redis_url (secrets/<service>.url) and read through SQUALL_RUN__REDIS_URL_FILE: never
# through the image, and never in the container's environment (`podman inspect` shows no password). Each container stops with SIGTERM and gets SIGKILL only
# after its grace period (podman stop -t), which is when squall's services drain and exit 0.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
N=${SQUALL_NAME:-squall}
IMAGE=${SQUALL_IMAGE:-localhost/squall-cpu:latest}
REDIS_IMAGE=${SQUALL_REDIS_IMAGE:-docker.io/library/redis:7.2-bookworm}
RUN_TOML=${SQUALL_RUN_TOML:-$HERE/run.toml}
RUNNERS=${SQUALL_RUNNERS:-2}
TOOLPOOL=${SQUALL_TOOLPOOL:-0}
# Seconds between SIGTERM and SIGKILL: a runner finishes or hands back its attempts within its
# grace_s (30 s by default), the trainer finishes its step and checkpoint.
declare -A GRACE=([runner]=90 [trainer]=300 [inference]=60 [scheduler]=60 [worker]=60 [redis]=30)

fail() { echo "podman-run.sh: $*" >&2; exit 1; }

secrets_dir() {
  [ -n "${SQUALL_SECRETS:-}" ] || fail "set SQUALL_SECRETS to the folder \`squall acl --host redis --acl-mode 644 --out DIR\` wrote"
  [ -r "$SQUALL_SECRETS/users.acl" ] || fail "$SQUALL_SECRETS/users.acl is missing: run squall acl --out $SQUALL_SECRETS --host redis --acl-mode 644"
  echo "$SQUALL_SECRETS"
}

# credentials SECRETS USER: sets CREDS to the options that give a container USER's Redis URL as a
# mounted file (an array, not printed: a `fail` in a subshell would not stop the script).
credentials() {
  local secrets=$1 user=$2
  [ -r "$secrets/$user.url" ] || fail "$secrets/$user.url is missing (written by squall acl since the URL moved out of the environment): run squall acl --out $secrets --host redis --acl-mode 644 again"
  CREDS=(-v "$secrets/$user.url:/run/secrets/redis_url:ro" -e SQUALL_RUN__REDIS_URL_FILE=/run/secrets/redis_url)
}

# The mounts and settings every squall container shares.
common() {
  local args=(--network "$N" -v "$N-runs:/var/lib/squall/runs" -v "$RUN_TOML:/etc/squall/run.toml:ro"
              --env-file "$HERE/squall.env" -e MPLCONFIGDIR=/tmp)
  if [ -n "${SQUALL_APP:-}" ]; then
    args+=(-v "$(cd "$SQUALL_APP" && pwd):/opt/squall/app:ro" -e PYTHONPATH=/opt/squall/app)
  fi
  printf '%s\n' "${args[@]}"
}

# start SERVICE CONTAINER CREDENTIALS [podman run options...] -- squall arguments...
start() {
  local service=$1 name=$2 creds=$3; shift 3
  local opts=()
  while [ "$1" != -- ]; do opts+=("$1"); shift; done
  shift
  local secrets; secrets=$(secrets_dir)
  mapfile -t shared < <(common)
  credentials "$secrets" "$creds"
  local run; run=$(sed -n 's/^SQUALL_RUN__NAME=//p' "$secrets/$creds.env")
  podman run -d --name "$N-$name" --network-alias "$service" "${shared[@]}" "${CREDS[@]}" \
    -e "SQUALL_RUN__NAME=$run" -e SQUALL_RUN__AUTOSTART_REDIS=false \
    --cap-drop ALL --security-opt no-new-privileges --read-only --tmpfs /tmp --tmpfs /var/lib/squall/cache \
    --stop-signal SIGTERM --stop-timeout "${GRACE[$service]}" --restart on-failure:3 \
    --health-cmd "${HEALTH[$service]}" --health-interval 10s --health-retries 3 \
    "${opts[@]}" "$IMAGE" "$@" --config /etc/squall/run.toml >/dev/null
  echo "podman-run.sh: started $N-$name"
}

# Each service answers /health on a fixed port inside its own container (its network namespace
# is its own, so every container can use the same port).
PROBE="python3 -c 'import sys, urllib.request as u; u.urlopen(sys.argv[1], timeout=3)'"
declare -A HEALTH=(
  [scheduler]="$PROBE http://127.0.0.1:9100/health"
  [trainer]="$PROBE http://127.0.0.1:9100/health"
  [runner]="$PROBE http://127.0.0.1:9100/ready"
  [inference]="$PROBE http://127.0.0.1:8000/health"
  [worker]="$PROBE http://127.0.0.1:9100/health"
)

wait_redis() {
  local deadline=$((SECONDS + 60))
  until podman exec "$N-redis" sh -c 'redis-cli --no-auth-warning -u "$(cat /run/secrets/redis_url)" ping' 2>/dev/null | grep -q PONG; do
    [ $SECONDS -lt $deadline ] || { podman logs --tail 20 "$N-redis" >&2; fail "Redis ($N-redis) did not answer PING within 60 s"; }
    sleep 1
  done
}

up() {
  local secrets; secrets=$(secrets_dir)
  [ -r "$RUN_TOML" ] || fail "no run file at $RUN_TOML (set SQUALL_RUN_TOML)"
  podman network exists "$N" || podman network create "$N" >/dev/null
  podman volume exists "$N-runs" || podman volume create "$N-runs" >/dev/null
  podman volume exists "$N-redis-data" || podman volume create "$N-redis-data" >/dev/null
  local publish=()
  [ -z "${SQUALL_REDIS_PORT:-}" ] || publish=(-p "127.0.0.1:$SQUALL_REDIS_PORT:6379")
  # The health check and wait_redis log in as the read-only monitor user (the default user is off).
  credentials "$secrets" monitor
  podman run -d --name "$N-redis" --network "$N" --network-alias redis "${publish[@]}" \
    -v "$N-redis-data:/data" -v "$secrets/users.acl:/etc/redis/users.acl:ro" \
    "${CREDS[@]}" --stop-signal SIGTERM --stop-timeout "${GRACE[redis]}" \
    --health-cmd 'redis-cli --no-auth-warning -u "$(cat /run/secrets/redis_url)" ping | grep -q PONG' --health-interval 5s \
    "$REDIS_IMAGE" redis-server --dir /data --bind 0.0.0.0 --protected-mode no --appendonly yes \
    --appendfsync everysec --aclfile /etc/redis/users.acl --maxmemory-policy noeviction >/dev/null
  wait_redis
  echo "podman-run.sh: started $N-redis"
  start scheduler scheduler scheduler -e SQUALL_SCHEDULER__METRICS_PORT=9100 -- scheduler
  start inference inference inference -e SQUALL_INFERENCE__HOST=0.0.0.0 -e SQUALL_INFERENCE__PORT=8000 \
    -e SQUALL_INFERENCE__NODE=inference-0 -- inference
  start_trainer
  [ "$TOOLPOOL" = 0 ] || start worker worker worker -e SQUALL_WORKER__HTTP_HOST=0.0.0.0 -e SQUALL_WORKER__HTTP_PORT=9100 -- worker
  local i
  for i in $(seq 1 "$RUNNERS"); do
    start runner "runner-$i" runner -e SQUALL_RUNNER__METRICS_PORT=9100 -- runner
  done
}

start_trainer() { start trainer trainer trainer -e SQUALL_TRAINER__METRICS_PORT=9100 -- trainer; }

# stop CONTAINER: SIGTERM, wait its grace period, print its exit code.
stop() {
  local name=$N-$1
  podman container exists "$name" || return 0
  podman stop -t "${GRACE[${1%%-*}]}" "$name" >/dev/null
  echo "podman-run.sh: $name exited $(podman inspect -f '{{.State.ExitCode}}' "$name")"
  podman rm "$name" >/dev/null
}

down() {
  local name
  # Runners first (they hand back what they hold), then the rest, Redis last (it writes its AOF).
  for name in $(podman ps -a --format '{{.Names}}' | grep "^$N-runner-" | sed "s/^$N-//"); do stop "$name"; done
  for name in worker scheduler trainer inference redis; do stop "$name"; done
}

case ${1:-} in
  up) up ;;
  down) down ;;
  purge)
    down
    podman volume rm -f "$N-runs" "$N-redis-data" >/dev/null 2>&1 || true
    podman network rm -f "$N" >/dev/null 2>&1 || true ;;
  restart)
    [ "${2:-}" = trainer ] || fail "restart knows the trainer only (runners: down/up)"
    stop trainer; start_trainer ;;
  python)
    shift
    podman network exists "$N" || podman network create "$N" >/dev/null
    mapfile -t shared < <(common)
    podman run --rm "${shared[@]}" --entrypoint python3 "$IMAGE" "$@" ;;
  *) fail "usage: $0 up | down | purge | restart trainer | python ARGS..." ;;
esac
