#!/usr/bin/env bash
# An Azure Blob Storage emulator for easyckpt's az:// tests: Microsoft's Azurite (the blob service alone) on
# 127.0.0.1, from the npm registry, installed on first use into ~/.cache/easyckpt/azurite-VERSION (node and npm
# needed; Azurite 3.37.0 asks for node >= 22 and runs on 20).
#
#     scripts/azure-server.sh install            install Azurite into the cache (once)
#     scripts/azure-server.sh start [DIR]        start (or find running); print AZURE_STORAGE_CONNECTION_STRING=
#     scripts/azure-server.sh stop [DIR]         stop the server this script started in DIR, then remove DIR
#     scripts/azure-server.sh status [DIR]
#     scripts/azure-server.sh server-stop|server-start [DIR]   the server alone, its blobs kept in DIR/data
#
# DIR (default ${TMPDIR:-/tmp}/easyckpt-azure) holds the blobs (--location), the log and the PID; stop signals
# only that PID (checked against its command line), SIGTERM, then SIGKILL once
# Azurite has said it closed (it saves its metadata then, and its process sometimes stays). AZ_PORT: the port (10000). The account is Azurite's well-known development account.
set -euo pipefail

VERSION=3.37.0
cmd=${1:-start}
dir=$(realpath -m -- "${2:-${TMPDIR:-/tmp}/easyckpt-azure}")
port=${AZ_PORT:-10000}
cache=${AZURITE_CACHE:-$HOME/.cache/easyckpt/azurite-$VERSION}
stamp=$dir/.easyckpt-azure-server
key="Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="

say() { echo "azure-server: $*" >&2; }
fail() { say "error: $*"; exit 1; }
case $dir in /|/tmp|/root|/home|/var|/usr) fail "refusing DIR=$dir" ;; esac

install() {
    [[ -x $cache/node_modules/.bin/azurite-blob ]] && return 0
    command -v npm >/dev/null || fail "npm is not installed (apt-get install -y nodejs npm)"
    say "installing azurite@$VERSION into $cache"
    mkdir -p "$cache"
    timeout 600 npm install --no-audit --no-fund --loglevel=error --prefix "$cache" "azurite@$VERSION" >&2 \
        || fail "npm install azurite@$VERSION failed"
}
mine() { [[ -r /proc/$1/cmdline ]] && tr '\0' ' ' <"/proc/$1/cmdline" | grep -qF -- "$dir/data"; }
answering() { python3 -c "import sys, urllib.request, urllib.error
try: urllib.request.urlopen('http://127.0.0.1:$port/devstoreaccount1?comp=list', timeout=5)
except urllib.error.HTTPError: pass" 2>/dev/null; }
env_line() {
    echo "AZURE_STORAGE_CONNECTION_STRING=DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;AccountKey=$key;BlobEndpoint=http://127.0.0.1:$port/devstoreaccount1;"
}

server_start() {
    local pid t0
    pid=$(cat "$dir/pid" 2>/dev/null || true)
    if [[ -n $pid ]] && mine "$pid"; then answering && return 0; fi
    install
    # the server's 60 s begin once it is installed (a first npm install took 56 s of them on a loaded machine: the
    # README's test command on a fresh machine then failed every az:// test, and left the server running)
    t0=$SECONDS
    setsid node "$cache/node_modules/azurite/dist/src/blob/main.js" --blobHost 127.0.0.1 --blobPort "$port" \
        --location "$dir/data" --silent --skipApiVersionCheck --loose >>"$dir/server.log" 2>&1 </dev/null &
    echo $! >"$dir/pid"
    until answering; do
        mine "$!" || fail "the server exited: $(tail -5 "$dir/server.log")"
        (( SECONDS - t0 < 60 )) || { server_stop; fail "no answer on port $port after 60 s"; }
        sleep 0.2
    done
}

server_stop() {     # SIGTERM; once Azurite says it closed (its blobs and metadata saved) the process may linger: KILL
    local pid i closed
    pid=$(cat "$dir/pid" 2>/dev/null) || return 0
    mine "$pid" || return 0
    closed=$(grep -c "successfully closed" "$dir/server.log" || true)
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < 60; i++)); do
        mine "$pid" || return 0
        (( $(grep -c "successfully closed" "$dir/server.log" || true) > closed )) && break
        sleep 0.25
    done
    (( i == 60 )) && say "$pid did not close in 15 s after SIGTERM: SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
    for ((i = 0; i < 40; i++)); do mine "$pid" || return 0; sleep 0.25; done
    fail "$pid still running after SIGKILL"
}

case $cmd in
    install) install ;;
    start)
        [[ -e $dir && ! -e $stamp ]] && fail "$dir exists and was not made by this script"
        mkdir -p "$dir/data" && touch "$stamp"
        server_start && env_line ;;
    stop)
        [[ -e $dir ]] || exit 0
        [[ -e $stamp ]] || fail "$dir was not made by this script: not touching it"
        server_stop && rm -rf -- "$dir" && say "stopped; $dir removed" ;;
    status)
        [[ -e $stamp ]] || { say "no server in $dir"; exit 1; }
        answering && env_line ;;
    server-stop) [[ -e $stamp ]] || fail "no server in $dir"; server_stop ;;
    server-start) [[ -e $stamp ]] || fail "no server in $dir"; server_start ;;
    *) fail "unknown command $cmd (install, start, stop, status, server-stop, server-start)" ;;
esac
