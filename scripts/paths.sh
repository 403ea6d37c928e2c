# Where a checkout's venvs live; sourced by scripts/dev.sh and scripts/spark_cluster.sh after
# they set ROOT (the checkout). Each checkout has a cache directory of its own,
# ~/.cache/reliable-amqp/<checkout's directory name>-<8 hex digits of sha256 of its path>, so two
# clones never share a venv (a venv's stamp names its checkout: a shared one was rebuilt by
# whichever clone ran last). RELIABLE_AMQP_VENV (the main venv) and RELIABLE_AMQP_MATRIX_DIR
# (the directory of the matrix's venv-* venvs) override the defaults; both are exported, so the
# tests (tests/matrix, tests/outbox/test_stacks.py) find the venvs this checkout built. The
# RabbitMQ 4 root names no checkout and stays shared between clones:
# ~/.cache/reliable-amqp/rabbitmq4 (RELIABLE_AMQP_RABBITMQ4_DIR, scripts/rabbitmq4.sh).
RELIABLE_AMQP_CACHE=$HOME/.cache/reliable-amqp
# The physical path: a checkout reached through a symbolic link is still one checkout.
CHECKOUT_CACHE=$(cd "$ROOT" && pwd -P)
CHECKOUT_CACHE=$RELIABLE_AMQP_CACHE/$(basename "$CHECKOUT_CACHE")-$(printf '%s' "$CHECKOUT_CACHE" | sha256sum | cut -c1-8)
export RELIABLE_AMQP_VENV=${RELIABLE_AMQP_VENV:-$CHECKOUT_CACHE/venv}
export RELIABLE_AMQP_MATRIX_DIR=${RELIABLE_AMQP_MATRIX_DIR:-$CHECKOUT_CACHE}
