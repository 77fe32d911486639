#!/usr/bin/env bash
# Emulated LAN hosts for the rudra_zmq benchmarks (bench/lan/table1.py).
#
#   bench/lan/netns.sh up N_HOSTS [RATE] [--prefix P]   build N "hosts"; prints one line per host
#   bench/lan/netns.sh down [--prefix P]                remove what `up` built (idempotent)
#   bench/lan/netns.sh status [--prefix P]              show the hosts, addresses and qdiscs
#
# Layout, for prefix P (default "rzlan"): host i is network namespace P-hI with interface eth0 at
# 10.77.0.(i+1)/24 (and lo up); its veth peer hI sits in P-br, a namespace of its own holding the
# bridge br0, so nothing is added to the root namespace. Each host link is shaped by
# `tc qdisc tbf rate RATE` (default 1gbit) on both ends: eth0 (what the host sends) and hI
# (what it receives), so every host has a full-duplex NIC of RATE. BURST and LATENCY in the
# environment override the tbf burst (default 512kb) and queue latency (default 20ms).
#
# Every namespace is recorded in /run/rudra_zmq_lan/P.ns *before* it is created; `down` kills
# the processes still running inside those namespaces, deletes them and the record, and touches
# nothing else. A failed or interrupted `up` runs `down` itself. Needs root and iproute2.
# Output of `up` (parsed by table1.py):  host I NAMESPACE ADDRESS
set -euo pipefail

STATE_DIR=/run/rudra_zmq_lan
SUBNET=10.77.0
BURST=${BURST:-512kb}
LATENCY=${LATENCY:-20ms}

die() { echo "netns.sh: $*" >&2; exit 2; }

usage() { sed -n '3,6p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

PREFIX=rzlan
ARGS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --prefix) [ $# -ge 2 ] || die "--prefix needs a value"; PREFIX=$2; shift 2 ;;
        --prefix=*) PREFIX=${1#--prefix=}; shift ;;
        -h|--help) usage ;;
        *) ARGS+=("$1"); shift ;;
    esac
done
set -- "${ARGS[@]+"${ARGS[@]}"}"
[[ $PREFIX =~ ^[a-z][a-z0-9]{1,11}$ ]] \
    || die "prefix '$PREFIX' must be 2-12 characters: a lower-case letter, then letters or digits"
STATE=$STATE_DIR/$PREFIX.ns

down() {
    [ -f "$STATE" ] || return 0
    local ns pid
    while read -r ns; do
        [ -n "$ns" ] || continue
        ip netns list | awk '{print $1}' | grep -qx "$ns" || continue
        for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -TERM "$pid" 2>/dev/null || true; done
        for _ in 1 2 3 4 5 6 7 8 9 10; do
            [ -z "$(ip netns pids "$ns" 2>/dev/null)" ] && break
            sleep 0.2
        done
        for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null || true; done
        ip netns delete "$ns"
    done < "$STATE"
    rm -f "$STATE"
}

record_and_add() {   # record a namespace, then create it (so a failure between the two is cleaned)
    echo "$1" >> "$STATE"
    ip netns add "$1"
}

up() {
    local n=${1:-} rate=${2:-1gbit} i br ns
    [[ $n =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] && [ "$n" -le 200 ] \
        || die "up needs N_HOSTS between 1 and 200, got '${n}'"
    [ "$(id -u)" = 0 ] || die "up needs root (ip netns, tc)"
    [ ! -e "$STATE" ] || die "prefix '$PREFIX' is already up ($STATE); run: $0 down --prefix $PREFIX"
    mkdir -p "$STATE_DIR"
    : > "$STATE"
    trap 'rc=$?; trap - EXIT INT TERM; if [ $rc -ne 0 ]; then echo "netns.sh: up failed, removing what it built" >&2; down; fi; exit $rc' EXIT
    trap 'exit 130' INT TERM
    br=$PREFIX-br
    record_and_add "$br"
    ip -n "$br" link set lo up
    ip -n "$br" link add br0 type bridge
    ip -n "$br" link set br0 up
    for ((i = 0; i < n; i++)); do
        ns=$PREFIX-h$i
        record_and_add "$ns"
        ip -n "$ns" link set lo up
        ip -n "$ns" link add eth0 type veth peer name "h$i" netns "$br"
        ip -n "$ns" addr add "$SUBNET.$((i + 1))/24" dev eth0
        ip -n "$br" link set "h$i" master br0
        tc -n "$ns" qdisc add dev eth0 root tbf rate "$rate" burst "$BURST" latency "$LATENCY"
        tc -n "$br" qdisc add dev "h$i" root tbf rate "$rate" burst "$BURST" latency "$LATENCY"
        ip -n "$ns" link set eth0 up
        ip -n "$br" link set "h$i" up
    done
    trap - EXIT INT TERM
    for ((i = 0; i < n; i++)); do echo "host $i $PREFIX-h$i $SUBNET.$((i + 1))"; done
}

status() {
    [ -f "$STATE" ] || { echo "prefix '$PREFIX' is not up"; return 0; }
    local ns
    while read -r ns; do
        echo "== $ns"
        ip -n "$ns" -br addr 2>/dev/null | grep -v '^lo ' || true
        tc -n "$ns" qdisc show 2>/dev/null | grep tbf || true
    done < "$STATE"
}

case "${1:-}" in
    up) shift; up "$@" ;;
    down) down ;;
    status) status ;;
    *) usage ;;
esac
