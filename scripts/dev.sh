#!/usr/bin/env bash
# One entry point for a fresh machine: it creates the virtualenv, installs the project with all
# extras, starts the local RabbitMQ if none answers, then runs what was asked.
#
#   scripts/dev.sh main     a real confirmed publish against the local broker (the main job)
#   scripts/dev.sh test     the whole test suite (what .ci/run calls); builds the matrix venvs first
#   scripts/dev.sh venvs [LEG...]  build (or check) the version-matrix venvs only
#   scripts/dev.sh rabbitmq4  build (or check) the cached RabbitMQ 4 root (scripts/rabbitmq4.sh)
#   scripts/dev.sh bench    the benchmark (benchmarks/run.py)
#   scripts/dev.sh check    the static checks (ruff; mypy strict over src, tests, examples, benchmarks)
#   scripts/dev.sh coverage [PYTEST ARGS...]  the broker-less suite under coverage, then the
#                           figures per module (no broker, Spark or disposable node needed)
#   scripts/dev.sh run CMD  any command inside the environment
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# This checkout's cache directory (its venvs), unless RELIABLE_AMQP_VENV / RELIABLE_AMQP_MATRIX_DIR
# say otherwise: scripts/paths.sh.
source "$ROOT/scripts/paths.sh"
VENV=$RELIABLE_AMQP_VENV
# The version matrix (tests/matrix): NAME:PYTHON:CONSTRAINTS[:EXTRAS], each a venv
# $MATRIX_DIR/venv-NAME with .[EXTRAS], by default .[aio,dev] (no Spark: small and quick to
# build). An empty CONSTRAINTS means "what pip resolves there"; constraints/lowest.txt pins every
# runtime dependency to its lower bound. PYTHON root/X.Y is Debian testing's pythonX.Y in the
# RabbitMQ 4 root (scripts/rabbitmq4.sh): that leg's venv is built and run inside the root,
# through $MATRIX_DIR/venv-NAME/host-python. The django6 and django-lowest venvs are not legs of
# tests/matrix: tests/outbox/test_stacks.py runs its Django tests with them (Django 6 needs
# Python >= 3.12; the outbox-django extra's lower bound), beside the main venv's Django.
MATRIX_DIR=$RELIABLE_AMQP_MATRIX_DIR
MATRIX_LEGS=("py3.10:3.10:" "py3.13:3.13:" "py3.14:root/3.14:" "lowest:3.10:constraints/lowest.txt"
    "django6:3.13:constraints/django6.txt:outbox,outbox-django"
    "django-lowest:3.10:constraints/django-lowest.txt:outbox,outbox-django")
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
        local extras=dev,aio,spark,otel,outbox,outbox-mysql,outbox-sqlalchemy,outbox-django
        extras+=,outbox-asyncpg,outbox-dev   # every extra pyproject.toml declares
        log "installing reliable-amqp[$extras] (editable) from $ROOT"
        "$VENV/bin/pip" install -q -e "$ROOT[$extras]"
        echo "$stamp" > "$VENV/.reliable-amqp-stamp"
    fi
}

# The newest interpreter of a minor version: pyenv's, else pythonX.Y on PATH; for root/X.Y, the
# root's /usr/bin/pythonX.Y (the root is built or checked first). Fails, never skips.
find_python() {
    local version=$1 found root
    if [[ $version == root/* ]]; then
        root=$(bash "$ROOT/scripts/rabbitmq4.sh" ensure) || return 1
        found=/usr/bin/python${version#root/}
        if [ ! -x "$root$found" ]; then
            log "$found is not in the RabbitMQ 4 root $root (scripts/rabbitmq4.sh installs it)"
            return 1
        fi
        echo "$found"
        return
    fi
    found=$(ls -d "$HOME"/.pyenv/versions/"$version".*/bin/python "$HOME/.pyenv/versions/$version/bin/python" 2>/dev/null | sort -V | tail -1)
    if [ -z "$found" ]; then
        found=$(command -v "python$version" || true)
    fi
    if [ -z "$found" ] || ! "$found" -c 'import sys' 2>/dev/null; then
        log "Python $version not found (looked for ~/.pyenv/versions/$version*/bin/python and python$version on PATH): the version matrix (tests/matrix) needs it"
        return 1
    fi
    echo "$found"
}

# One matrix venv, rebuilt when pyproject.toml, its constraints, the checkout or the interpreter
# changed. A lock keeps two concurrent runs from installing into the same venv at once.
ensure_matrix_venv() {
    local name=$1 version=$2 constraints=$3 extras=${4:-aio,dev}
    local venv="$MATRIX_DIR/venv-$name" python stamp in=()
    python=$(find_python "$version") || return 1
    mkdir -p "$MATRIX_DIR"
    if [[ $version == root/* ]]; then
        # Every step below runs inside the root, where the venv is bind-mounted at its own path.
        in=(bash "$ROOT/scripts/rabbitmq4.sh" exec --bind "$venv" --)
    fi
    exec 9>"$MATRIX_DIR/.venv-$name.lock"
    flock 9
    # Only what pip reads: [build-system] and [project] (a new pytest marker rebuilds nothing).
    stamp="$(awk '/^\[/ { keep = /^\[(build-system|project)[].]/ } keep' "$ROOT/pyproject.toml" \
        | sha256sum | cut -c1-16)"
    stamp+=" ${constraints:+$(sha256sum "$ROOT/$constraints" | cut -c1-16)}"
    [ "$extras" = aio,dev ] || stamp+=" [$extras]"   # the legs' stamps stay as they were
    stamp+=" $ROOT"
    stamp+=" $("${in[@]}" "$python" -c 'import sys; print(sys.version.split()[0])')"
    if [ "$(cat "$venv/.reliable-amqp-stamp" 2>/dev/null)" = "$stamp" ]; then
        exec 9>&-; return 0
    fi
    local started=$SECONDS
    log "building $venv (Python $version, .[$extras]${constraints:+, $constraints})"
    if [ "$(awk '{print $NF}' "$venv/.reliable-amqp-stamp" 2>/dev/null)" != "${stamp##* }" ]; then
        "${in[@]}" "$python" -m venv --clear "$venv"   # new or another interpreter: start afresh
    fi
    rm -f "$venv/.reliable-amqp-stamp"
    "${in[@]}" "$venv/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
    if [ -n "$constraints" ]; then
        "${in[@]}" "$venv/bin/python" -m pip install -q --disable-pip-version-check \
            -c "$ROOT/$constraints" -e "$ROOT[$extras]"
    else  # what pip resolves today, even in a venv built earlier
        "${in[@]}" "$venv/bin/python" -m pip install -q --disable-pip-version-check \
            --upgrade --upgrade-strategy eager -e "$ROOT[$extras]"
    fi
    if [ ${#in[@]} -gt 0 ]; then
        # What tests/matrix runs from the machine: the venv's python, inside the root.
        printf '#!/bin/sh\nexec bash %q exec --bind %q -- %q "$@"\n' \
            "$ROOT/scripts/rabbitmq4.sh" "$venv" "$venv/bin/python" >"$venv/host-python"
        chmod 755 "$venv/host-python"
    fi
    echo "$stamp" > "$venv/.reliable-amqp-stamp"
    log "built $venv in $((SECONDS - started)) s"
    exec 9>&-
}

# Build the matrix venvs (all, or the named legs) in parallel; any failure fails the run.
ensure_matrix() {
    local leg name version constraints extras pids=() names=() failed=0 i
    for leg in "${MATRIX_LEGS[@]}"; do
        IFS=: read -r name version constraints extras <<<"$leg"
        if [ $# -gt 0 ] && [[ " $* " != *" $name "* ]]; then
            continue
        fi
        mkdir -p "$MATRIX_DIR"
        ensure_matrix_venv "$name" "$version" "$constraints" "$extras" \
            >"$MATRIX_DIR/venv-$name.log" 2>&1 &
        pids+=($!); names+=("$name")
    done
    for i in "${!pids[@]}"; do
        if ! wait "${pids[$i]}"; then
            failed=1
            log "the matrix venv ${names[$i]} could not be built:"
            tail -20 "$MATRIX_DIR/venv-${names[$i]}.log" >&2
        else
            grep -h '^\[dev\]' "$MATRIX_DIR/venv-${names[$i]}.log" >&2 || true
        fi
    done
    return "$failed"
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

# Partitioned consumers (Consumer(..., partitions=N)) need the consistent-hash exchange: enabled
# on the local broker when it is not (a broker elsewhere is its operator's to set up).
ensure_hash_plugin() {
    if [ "$AMQP_HOST" != "127.0.0.1" ] && [ "$AMQP_HOST" != "localhost" ]; then
        return
    fi
    if ! command -v rabbitmq-plugins >/dev/null 2>&1; then
        return  # not a local RabbitMQ (LavinMQ has the exchange built in)
    fi
    if ! rabbitmq-plugins -q is_enabled rabbitmq_consistent_hash_exchange >/dev/null 2>&1; then
        log "enabling rabbitmq_consistent_hash_exchange on the local broker"
        rabbitmq-plugins -q enable rabbitmq_consistent_hash_exchange >/dev/null
    fi
}

ensure_broker() {
    if broker_answers; then
        ensure_hash_plugin; return
    fi
    if [ "$AMQP_HOST" != "127.0.0.1" ] && [ "$AMQP_HOST" != "localhost" ]; then
        log "no broker answers at $AMQP_HOST:$AMQP_PORT"; exit 1
    fi
    log "no broker at $AMQP_HOST:$AMQP_PORT: starting the local RabbitMQ"
    rabbitmq-server -detached || true
    for _ in $(seq 1 90); do
        if broker_answers && rabbitmqctl -q await_startup >/dev/null 2>&1; then
            log "broker is up"; ensure_hash_plugin; return
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
        ensure_venv; ensure_java; ensure_broker; ensure_matrix
        # RabbitMQ 4 for tests/rabbitmq4 and tests/cluster: cached, a stamp check when current.
        bash "$ROOT/scripts/rabbitmq4.sh" ensure >/dev/null
        cd "$ROOT"
        set +e
        # No test may skip here (tests/conftest.py turns a skip into a failure): a broker that
        # does not answer, a missing tool or interpreter must fail CI, not thin it out quietly.
        # RELIABLE_AMQP_TEST_WORKERS=N runs the suite on N pytest-xdist workers (default 2; 0 is
        # one process), each test module one unit of work, and Spark, the clusters and the
        # version matrix one unit together, handed out first (tests/conftest.py LANE): a lone
        # process leaves a core idle about 40% of the run.
        # --durations: the 30 longest steps end the log, where the suite's budget is watched.
        # Byte-code: an environment with PYTHONDONTWRITEBYTECODE=1 (this machine's) has every
        # Python the suite starts (the CLI, children, the matrix's legs: hundreds) compile the
        # library again; the compiled files go to the cache directory instead, not the tree.
        export PYTHONPYCACHEPREFIX="${PYTHONPYCACHEPREFIX:-$MATRIX_DIR/pycache}"
        unset PYTHONDONTWRITEBYTECODE
        RELIABLE_AMQP_NO_SKIP=1 "$VENV/bin/python" -m pytest --durations=30 \
            -n "${RELIABLE_AMQP_TEST_WORKERS:-2}" --dist loadgroup --no-loadscope-reorder "$@"
        rc=$?
        set -e
        # pytest exits 5 when no test ran: that is a failure here.
        [ "$rc" -eq 5 ] && log "no tests ran" && exit 1
        exit "$rc"
        ;;
    venvs)
        ensure_matrix "$@"
        ;;
    rabbitmq4)
        exec bash "$ROOT/scripts/rabbitmq4.sh" "${@:-ensure}"
        ;;
    bench)
        ensure_venv; ensure_java; ensure_broker
        cd "$ROOT"
        exec "$VENV/bin/python" benchmarks/run.py "$@"
        ;;
    check)
        # Static checks: ruff (lint and format) everywhere, mypy strict over src/ (pyproject's
        # [tool.mypy]) and over tests/, examples/ and benchmarks/. Test directories are checked
        # one at a time: each has its own conftest.py, and mypy takes two as one duplicate module.
        ensure_venv
        cd "$ROOT"
        "$VENV/bin/ruff" check src tests examples benchmarks
        "$VENV/bin/ruff" format --check src tests examples benchmarks
        "$VENV/bin/mypy"
        for dir in tests/*/; do
            [ -n "$(ls "$dir"*.py 2>/dev/null)" ] || continue
            MYPYPATH=tests "$VENV/bin/mypy" --strict --python-version 3.10 "$dir"
        done
        MYPYPATH=tests "$VENV/bin/mypy" --strict --python-version 3.10 tests/*.py examples benchmarks
        ;;
    coverage)
        # The tests that need no broker, Spark or disposable node, traced by coverage (statement
        # coverage of src/reliable_amqp), then one line per module and the adapters' total.
        # These tests must hold under tracing (three times slower) on a loaded machine: they
        # wait on events, not on fixed delays. PYTEST ARGS narrow or widen the run.
        ensure_venv
        cd "$ROOT"
        data=$(mktemp -d)
        trap 'rm -rf "$data"' EXIT
        set +e
        COVERAGE_FILE="$data/.coverage" RELIABLE_AMQP_NO_SKIP=1 "$VENV/bin/python" -m coverage run \
            --source=reliable_amqp -m pytest -p no:cacheprovider \
            -m "not broker and not spark and not faults and not slow" "$@"
        rc=$?
        set -e
        # spark/ is left out of the table: its tests need Spark and are not in this run.
        COVERAGE_FILE="$data/.coverage" "$VENV/bin/python" -m coverage report --skip-empty \
            --omit='*/reliable_amqp/spark/*'
        adapters=$(COVERAGE_FILE="$data/.coverage" "$VENV/bin/python" -m coverage report \
            --include='*/reliable_amqp/_sync/*,*/reliable_amqp/_async/*' --format=total)
        log "adapters (_sync and _async together): ${adapters}% of statements"
        [ "$rc" -eq 5 ] && log "no tests ran" && exit 1
        exit "$rc"
        ;;
    run)
        ensure_venv; ensure_broker
        cd "$ROOT"
        PATH="$VENV/bin:$PATH" exec "$@"
        ;;
    *)
        echo "usage: scripts/dev.sh main|test|check|coverage|venvs [LEG...]|rabbitmq4|bench|run CMD..." >&2; exit 2
        ;;
esac
