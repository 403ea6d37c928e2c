#!/usr/bin/env bash
# One entry point for a fresh machine: it creates the virtualenv, installs the project with all
# extras, starts the local RabbitMQ if none answers, then runs what was asked.
#
#   scripts/dev.sh main     a real confirmed publish against the local broker (the main job)
#   scripts/dev.sh test     the whole test suite (what .ci/run calls)
#   scripts/dev.sh bench    the benchmark (benchmarks/run.py)
#   scripts/dev.sh run CMD  any command inside the environment
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${RELIABLE_AMQP_VENV:-$HOME/.cache/reliable-amqp/venv}
AMQP_HOST=${AMQP_TEST_HOST:-127.0.0.1}
AMQP_PORT=${AMQP_TEST_PORT:-5672}

log() { printf '[dev] %s\n' "$*" >&2; }

ensure_venv() {
    if [ ! -x "$VENV/bin/python" ]; then
        log "creating virtualenv in $VENV"
        python3 -m venv "$VENV"
        "$VENV/bin/pip" install -q --upgrade pip
    fi
    # Reinstall when pyproject.toml changed or the editable install points at another checkout.
    local stamp
    stamp="$(sha256sum "$ROOT/pyproject.toml" | cut -c1-16) $ROOT"
    if [ "$(cat "$VENV/.reliable-amqp-stamp" 2>/dev/null)" != "$stamp" ]; then
        log "installing reliable-amqp[dev,aio,spark] (editable) from $ROOT"
        "$VENV/bin/pip" install -q -e "$ROOT[dev,aio,spark]"
        echo "$stamp" > "$VENV/.reliable-amqp-stamp"
    fi
}

ensure_java() {
    if ! command -v java >/dev/null 2>&1; then
        log "installing a Java runtime for PySpark"
        apt-get update -qq && apt-get install -y -qq openjdk-17-jre-headless >/dev/null
    fi
}

broker_answers() {
    "$VENV/bin/python" - "$AMQP_HOST" "$AMQP_PORT" <<'PY'
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2).close()
except OSError:
    sys.exit(1)
PY
}

ensure_broker() {
    if broker_answers; then
        return
    fi
    if [ "$AMQP_HOST" != "127.0.0.1" ] && [ "$AMQP_HOST" != "localhost" ]; then
        log "no broker answers at $AMQP_HOST:$AMQP_PORT"; exit 1
    fi
    log "no broker at $AMQP_HOST:$AMQP_PORT: starting the local RabbitMQ"
    rabbitmq-server -detached || true
    for _ in $(seq 1 90); do
        if broker_answers && rabbitmqctl -q await_startup >/dev/null 2>&1; then
            log "broker is up"; return
        fi
        sleep 1
    done
    log "the broker did not come up within 90 s"; exit 1
}

cmd=${1:-}
shift || true
case "$cmd" in
    main)
        ensure_venv; ensure_broker
        exec "$VENV/bin/python" "$ROOT/examples/quickstart.py" "$@"
        ;;
    test)
        ensure_venv; ensure_java; ensure_broker
        cd "$ROOT"
        set +e
        "$VENV/bin/python" -m pytest "$@"
        rc=$?
        set -e
        # pytest exits 5 when no test ran: that is a failure here.
        [ "$rc" -eq 5 ] && log "no tests ran" && exit 1
        exit "$rc"
        ;;
    bench)
        ensure_venv; ensure_java; ensure_broker
        cd "$ROOT"
        exec "$VENV/bin/python" benchmarks/run.py "$@"
        ;;
    run)
        ensure_venv; ensure_broker
        cd "$ROOT"
        PATH="$VENV/bin:$PATH" exec "$@"
        ;;
    *)
        echo "usage: scripts/dev.sh main|test|bench|run CMD..." >&2; exit 2
        ;;
esac
