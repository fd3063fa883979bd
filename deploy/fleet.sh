#!/usr/bin/env bash
# A local fleet: N `inferd serve` replicas behind HAProxy (deploy/haproxy.cfg), in the foreground.
#
#   deploy/fleet.sh [up] [SERVE_ARGS...]    replicas on 127.0.0.1:PORT+1..PORT+N, the balancer on
#                                           PORT; Ctrl-C drains the replicas, then stops HAProxy
#                                           (a second Ctrl-C stops everything at once)
#   deploy/fleet.sh config BIND ADDR...     print deploy/haproxy.cfg listening on BIND with one
#                                           server line per replica ADDR (host:port)
#
# Environment: FLEET_REPLICAS (3), FLEET_PORT (8000), INFERD (.venv/bin/inferd), FLEET_DIR (where
# the rendered config, the stats socket and the replicas' logs go; default
# ${TMPDIR:-/tmp}/inferd-fleet). SERVE_ARGS go to every replica after the fleet's own
# (--host, --port, --threads: the cores shared out), so they override them.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
TEMPLATE="$HERE/haproxy.cfg"

render() {  # render BIND ADDR...: the template with its bind default and replica lines replaced
    local bind="$1"; shift
    local servers="" i=0 addr
    for addr in "$@"; do
        i=$((i + 1))
        servers+="    server r$i $addr"$'\n'
    done
    awk -v bind="$bind" -v servers="$servers" '
        /^[ \t]*bind / { sub(/bind .*/, "bind \"${INFERD_LB_BIND-" bind "}\"") }
        /# replicas: begin/ { print; printf "%s", servers; skip = 1; next }
        /# replicas: end/ { skip = 0 }
        !skip { print }' "$TEMPLATE"
}

need_haproxy() {
    command -v haproxy >/dev/null && return
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "fleet: installing haproxy (apt-get)" >&2
        DEBIAN_FRONTEND=noninteractive apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq haproxy >&2
        command -v haproxy >/dev/null && return
    fi
    echo "fleet: haproxy is not installed: run 'sudo apt-get install haproxy' (Debian/Ubuntu; 2.6 or later)" >&2
    exit 1
}

ready() {  # ready PORT: GET /ready answers 200 (bash's /dev/tcp: no curl needed)
    local code
    exec 3<>"/dev/tcp/127.0.0.1/$1" || return 1
    printf 'GET /ready HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n' >&3
    read -r _ code _ <&3 || code=""
    exec 3<&-
    [ "$code" = 200 ]
}

up() {
    need_haproxy
    local n="${FLEET_REPLICAS:-3}" port="${FLEET_PORT:-8000}"
    local inferd="${INFERD:-.venv/bin/inferd}" dir="${FLEET_DIR:-${TMPDIR:-/tmp}/inferd-fleet}"
    local threads i p addrs=()
    threads=$(( $(nproc) / n > 0 ? $(nproc) / n : 1 ))
    mkdir -p "$dir"
    # NOTE: job control puts each replica and HAProxy in a process group of its own, so Ctrl-C
    # reaches this script alone, which then signals each once (a second signal would make a
    # draining replica stop at once). The log pipes ignore SIGINT so they outlive the drain.
    set -m
    trap 'stop 0' INT TERM
    for ((i = 1; i <= n; i++)); do
        p=$((port + i))
        addrs+=("127.0.0.1:$p")
        # each replica's log goes to its file and, prefixed, to the terminal
        "$inferd" serve --host 127.0.0.1 --port "$p" --threads "$threads" "$@" \
            2> >(trap '' INT; tee "$dir/r$i.log" | sed -u "s/^/r$i | /" >&2) &
        REPLICAS+=($!)
    done
    echo "fleet: $n replicas ($threads torch threads each) starting; logs in $dir" >&2
    for ((i = 1; i <= n; i++)); do
        until ready $((port + i)) 2>/dev/null; do
            kill -0 "${REPLICAS[i - 1]}" 2>/dev/null || { echo "fleet: replica r$i exited; see $dir/r$i.log" >&2; stop 1; }
            sleep 0.2
        done
    done
    # HAProxy 2.6 counts a server up until its checks fail: start it once every replica is ready
    render "127.0.0.1:$port" "${addrs[@]}" > "$dir/haproxy.cfg"
    # -db: in the foreground, its log (a line per request, each health change) on stdout; its
    # stderr repeats the health changes as warnings, so it goes to a file (shown if it exits)
    INFERD_LB_STATS="$dir/haproxy.sock" haproxy -db -f "$dir/haproxy.cfg" 2> "$dir/haproxy.err" \
        > >(trap '' INT; tee "$dir/haproxy.log" | sed -u "s/^/lb | /") &
    BALANCER=$!
    echo "fleet: ready: http://127.0.0.1:$port/v1 (the balancer) -> ${addrs[*]}; stats socket" \
         "$dir/haproxy.sock; Ctrl-C stops" >&2
    wait "$BALANCER" || true
    echo "fleet: the balancer exited:" >&2
    cat "$dir/haproxy.err" >&2
    BALANCER=""
    stop 1
}

REPLICAS=()
BALANCER=""
STOPPING=0

stop() {  # stop CODE: drain the replicas (SIGTERM, each exits once its requests finish), then HAProxy
    [ "$STOPPING" = 0 ] || return 0
    STOPPING=1
    trap 'kill -KILL "${REPLICAS[@]}" $BALANCER 2>/dev/null; exit 130' INT TERM  # a second Ctrl-C
    echo "fleet: draining the replicas (SIGTERM), then stopping the balancer" >&2
    kill -TERM "${REPLICAS[@]}" 2>/dev/null || true
    wait "${REPLICAS[@]}" 2>/dev/null || true
    if [ -n "$BALANCER" ]; then
        kill -TERM "$BALANCER" 2>/dev/null || true
        wait "$BALANCER" 2>/dev/null || true
    fi
    echo "fleet: stopped" >&2
    exit "$1"
}

case "${1:-up}" in
    config) shift; [ $# -ge 2 ] || { echo "usage: $0 config BIND ADDR..." >&2; exit 2; }; render "$@" ;;
    up) shift || true; up "$@" ;;
    -*) up "$@" ;;
    *) echo "usage: $0 [up] [SERVE_ARGS...] | $0 config BIND ADDR..." >&2; exit 2 ;;
esac
