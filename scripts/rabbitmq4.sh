#!/usr/bin/env bash
# RabbitMQ 4 beside the machine's broker, from Debian's own packages: a minimal Debian 13 (trixie)
# root made by debootstrap, with rabbitmq-server installed into it, cached under
# ~/.cache/reliable-amqp/rabbitmq4/ and rebuilt only when this recipe changes. The nodes run from
# the root under chroot (tests/harness/rabbitmq4.py); nothing here touches the machine's
# RabbitMQ (5672/25672/4369) or its packages. The same root carries Debian testing's python3.14
# (and its venv module), the interpreter of the version matrix's py3.14 leg (scripts/dev.sh):
# the machine's own Debian has no 3.14 and its C library is too old to run testing's binary.
#
#   scripts/rabbitmq4.sh ensure    build the root unless the cached one matches; print its path
#   scripts/rabbitmq4.sh versions  print the versions installed in it (rabbitmq-server, erlang,
#                                  python3.14)
#   scripts/rabbitmq4.sh rebuild   throw the cached root away and build it again
#   scripts/rabbitmq4.sh exec [--bind DIR]... [--] CMD [ARG...]
#                                  run CMD inside the root, in the current directory, with this
#                                  checkout, /tmp and each DIR bind-mounted at their own paths
#                                  (and the machine's DNS and CA certificates, for pip)
#
# Which RabbitMQ: Debian testing's rabbitmq-server (4.3.x, Erlang/OTP 29, Khepri) installed with
# apt -t testing into the trixie root, because 4.3 is what a user installing RabbitMQ 4 today
# gets (4.0 is out of community support); RABBITMQ4_SUITE=trixie takes trixie's own 4.0.5
# (Erlang 27) instead. testing's Release file is read with check-valid-until=no, so a mirror's
# stale Valid-Until cannot break the build.
#
# Needs root (debootstrap, chroot) and deb.debian.org. A cold build takes about a minute or two.
set -euo pipefail


REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE=${RELIABLE_AMQP_RABBITMQ4_DIR:-$HOME/.cache/reliable-amqp/rabbitmq4}
SUITE=${RABBITMQ4_SUITE:-testing}
MIRROR=${RABBITMQ4_MIRROR:-http://deb.debian.org/debian}
# Bump when the steps below change in a way that needs a new root (2: python3.14 added).
RECIPE_VERSION=2
# Debian testing's Python 3.14 (ca-certificates: pip inside the root verifies PyPI's certificate)
# (trixie itself has 3.13 only: with RABBITMQ4_SUITE=trixie the py3.14 leg fails, loudly).
PYTHON_PACKAGES="python3.14 python3.14-venv ca-certificates"
[ "$SUITE" != "trixie" ] || PYTHON_PACKAGES="ca-certificates"
RECIPE="recipe=$RECIPE_VERSION base=trixie packages-from=$SUITE mirror=$MIRROR"

log() { printf '[rabbitmq4] %s\n' "$*" >&2; }

ensure_debootstrap() {
    if command -v debootstrap >/dev/null 2>&1; then
        return
    fi
    log "installing debootstrap"
    apt-get install -y -qq debootstrap >/dev/null 2>&1 \
        || { apt-get update -qq && apt-get install -y -qq debootstrap >/dev/null; }
}

# Run a command inside the root with /proc and /dev mounted in a private mount namespace: the
# mounts vanish with the command, so nothing is left mounted on the host if a step fails.
in_root() {
    local root=$1
    shift
    unshare --mount --propagation private -- /bin/sh -c '
        root=$1; shift
        mount -t proc proc "$root/proc"
        mount --rbind /dev "$root/dev"
        exec chroot "$root" "$@"' in_root "$root" "$@"
}

build() {
    local target=$CACHE/root work=$CACHE/root.new started=$SECONDS
    ensure_debootstrap
    rm -rf "$work"
    mkdir -p "$CACHE"
    log "debootstrap trixie (minbase) into $work"
    debootstrap --variant=minbase trixie "$work" "$MIRROR" >"$CACHE/build.log" 2>&1 \
        || { tail -30 "$CACHE/build.log" >&2; log "debootstrap failed"; return 1; }
    log "debootstrap done in $((SECONDS - started)) s"
    # No service may start inside the root while packages install.
    printf '#!/bin/sh\nexit 101\n' >"$work/usr/sbin/policy-rc.d"
    chmod 755 "$work/usr/sbin/policy-rc.d"
    printf '127.0.0.1 localhost\n::1 localhost ip6-localhost ip6-loopback\n' >"$work/etc/hosts"
    local target_release=()
    if [ "$SUITE" != "trixie" ]; then
        echo "deb [check-valid-until=no] $MIRROR $SUITE main" \
            >"$work/etc/apt/sources.list.d/$SUITE.list"
        target_release=(-t "$SUITE")
    fi
    log "apt-get install rabbitmq-server $PYTHON_PACKAGES from $SUITE"
    {
        in_root "$work" apt-get update -q
        # shellcheck disable=SC2086  # PYTHON_PACKAGES is a list of package names
        DEBIAN_FRONTEND=noninteractive in_root "$work" apt-get install -y -q \
            --no-install-recommends "${target_release[@]}" rabbitmq-server $PYTHON_PACKAGES
        in_root "$work" apt-get clean
    } >>"$CACHE/build.log" 2>&1 \
        || { tail -30 "$CACHE/build.log" >&2; log "installing the packages failed"; return 1; }
    rm -rf "$work"/var/lib/apt/lists/*
    # shellcheck disable=SC2086
    in_root "$work" dpkg-query -W -f '${Package} ${Version}\n' rabbitmq-server erlang-base \
        $PYTHON_PACKAGES >"$work/.reliable-amqp-versions"
    echo "$RECIPE" >"$work/.reliable-amqp-stamp"
    rm -rf "$target"
    mv "$work" "$target"
    log "built $target in $((SECONDS - started)) s: $(tr '\n' ' ' <"$target/.reliable-amqp-versions")"
}

ensure() {
    mkdir -p "$CACHE"
    exec 8>"$CACHE/.lock"
    flock 8
    if [ "$(cat "$CACHE/root/.reliable-amqp-stamp" 2>/dev/null)" != "$RECIPE" ]; then
        build
    fi
    exec 8>&-
    echo "$CACHE/root"
}

# Run a command in the root as `exec` describes: a private mount namespace holds the bind mounts,
# so they vanish with the command; the caller's environment and working directory carry over.
exec_in_root() {
    local binds=("$REPO" /tmp) root source
    while [ $# -gt 0 ]; do
        case "$1" in
            --bind) binds+=("$(realpath -m "$2")"); shift 2 ;;
            --) shift; break ;;
            *) break ;;
        esac
    done
    [ $# -gt 0 ] || { echo "usage: scripts/rabbitmq4.sh exec [--bind DIR]... [--] CMD..." >&2; exit 2; }
    root=$(ensure)
    for source in "${binds[@]}"; do
        mkdir -p "$source" "$root$source"
    done
    # The machine's resolver and CA bundle (which may hold a local CA): pip in the root needs both.
    local files=(/etc/resolv.conf /etc/ssl/certs/ca-certificates.crt)
    for source in "${files[@]}"; do
        mkdir -p "$(dirname "$root$source")"
        [ -e "$root$source" ] || touch "$root$source"
    done
    exec unshare --mount --propagation private -- /bin/sh -c '
        root=$1 cwd=$2 nbinds=$3; shift 3
        mount -t proc proc "$root/proc"
        mount --rbind /dev "$root/dev"
        while [ "$nbinds" -gt 0 ]; do
            mount --bind "$1" "$root$1"; shift; nbinds=$((nbinds - 1))
        done
        exec chroot "$root" /bin/sh -c '"'"'cd "$0" && exec "$@"'"'"' "$cwd" "$@"' \
        exec_in_root "$root" "$PWD" $((${#binds[@]} + ${#files[@]})) "${binds[@]}" "${files[@]}" "$@"
}

cmd=${1:-ensure}
case "$cmd" in
    ensure)
        ensure
        ;;
    versions)
        ensure >/dev/null
        cat "$CACHE/root/.reliable-amqp-versions"
        ;;
    rebuild)
        mkdir -p "$CACHE"
        rm -rf "$CACHE/root"
        ensure
        ;;
    exec)
        shift
        exec_in_root "$@"
        ;;
    *)
        echo "usage: scripts/rabbitmq4.sh ensure|versions|rebuild|exec" >&2
        exit 2
        ;;
esac
