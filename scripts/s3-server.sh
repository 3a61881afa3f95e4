#!/usr/bin/env bash
# A real S3 server for easyckpt's object-storage tests: a one-node Ceph cluster (one monitor, one memstore
# OSD) and its RADOS Gateway on 127.0.0.1, from Debian's packages:
#     apt-get install -y --no-install-recommends ceph-mon ceph-osd radosgw
#
#     scripts/s3-server.sh start [DIR]    start (or find running) and print ENDPOINT=, ACCESS_KEY=, SECRET_KEY=
#     scripts/s3-server.sh stop [DIR]     stop the daemons this script started in DIR, then remove DIR
#     scripts/s3-server.sh status [DIR]
#     scripts/s3-server.sh gateway-stop|gateway-start [DIR]   the gateway alone (a store that goes away and
#                                                           comes back; the objects stay in the cluster)
#     scripts/s3-server.sh gateway-pause|gateway-resume [DIR] the gateway frozen (SIGSTOP) and thawed: a store
#                                                           that takes connections and never answers (a hang)
#
# DIR (default ${TMPDIR:-/tmp}/easyckpt-s3) holds the configuration, data, logs and the daemons' PIDs; stop
# signals only those PIDs (checked against their command lines, in case a PID was reused). Every wait is
# bounded and says what it waits for. Settings: S3_PORT (7480), S3_MON_PORT (27200, +1 for msgr v1: below the
# kernel's ephemeral ports, where a daemon's own closed connection in TIME-WAIT could hold it for a minute),
# S3_STORE_BYTES (memstore's cap, 4 GiB). Progress goes to stderr; stdout has the three KEY=VALUE lines.
#
# Three facts the configuration depends on: with authentication off, radosgw must talk to the monitor in
# "crc" mode (its built-in default asks for "secure" and then retries "get_initial_auth_request returned
# -13" forever); ceph-osd keeps its freed 4 MiB object buffers unless glibc's mmap threshold is fixed
# (MALLOC_MMAP_THRESHOLD_), growing to twice the bytes stored; and beast sends a reply's headers and body as
# two writes, so without tcp_nodelay Nagle holds the body until the client's delayed ACK: every GET and LIST
# took 40-50 ms more (a small GET 50 ms, 1.9 ms with it; a HEAD or PUT, which carry no body back, 2-5 ms).
set -euo pipefail

cmd=${1:-start}
dir=$(realpath -m -- "${2:-${TMPDIR:-/tmp}/easyckpt-s3}")
port=${S3_PORT:-7480}
mon_port=${S3_MON_PORT:-27200}
store_bytes=${S3_STORE_BYTES:-$((4 << 30))}
conf=$dir/ceph.conf
stamp=$dir/.easyckpt-s3-server

say() { echo "s3-server: $*" >&2; }
fail() { say "error: $*"; exit 1; }
case $dir in /|/tmp|/root|/home|/var|/usr) fail "refusing DIR=$dir" ;; esac

# until SECONDS WHAT CMD...: run CMD (itself bounded) every half second until it succeeds
until_ok() {
    local limit=$1 what=$2 t0=$SECONDS; shift 2
    say "waiting up to ${limit}s for $what"
    until "$@" >/dev/null 2>&1; do
        (( SECONDS - t0 < limit )) || { say "gave up after ${limit}s waiting for $what"; return 1; }
        sleep 0.5
    done
}

mine() { [[ -r /proc/$1/cmdline ]] && tr '\0' ' ' <"/proc/$1/cmdline" | grep -qF -- "$conf"; }
pids() { local f; for f in "$dir"/pids/*; do [[ -s $f ]] && echo "$(basename "$f") $(cat "$f")"; done; }
answering() { python3 -c "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:$port/', timeout=5).status != 200)"; }
ceph_cli() { timeout 30 ceph -c "$conf" --connect-timeout 20 "$@"; }
osd_in() { ceph_cli osd dump -f json | python3 -c 'import json, sys
osds = json.load(sys.stdin)["osds"]; sys.exit(0 if osds and osds[0]["up"] == 1 and osds[0]["in"] == 1 else 1)'; }
keep_pid() { until_ok 20 "$1's pid file" test -s "$dir/run/$1.pid"; cp "$dir/run/$1.pid" "$dir/pids/$1"; }

stop() {
    [[ -e $dir ]] || return 0
    [[ -e $stamp ]] || fail "$dir was not made by this script: not touching it"
    local name pid i
    for name in client.rgw.easyckpt osd.0 mon.a; do            # the gateway first, the monitor last
        pid=$(cat "$dir/pids/$name" 2>/dev/null) || continue
        mine "$pid" || continue
        kill -TERM "$pid" 2>/dev/null || true
        for ((i = 0; i < 40; i++)); do mine "$pid" || break; sleep 0.25; done
        mine "$pid" && { say "$name ($pid) ignored SIGTERM for 10 s: SIGKILL"; kill -KILL "$pid" 2>/dev/null || true; }
    done
    rm -rf -- "$dir"
    say "stopped; $dir removed"
}

status() {
    [[ -e $stamp ]] || { say "no server in $dir"; return 1; }
    local name pid
    while read -r name pid; do mine "$pid" && say "$name ($pid) running" || say "$name ($pid) gone"; done < <(pids)
    answering && cat "$dir/s3.env"
}

start() {
    local tool
    for tool in ceph-mon ceph-osd radosgw radosgw-admin ceph monmaptool; do
        command -v "$tool" >/dev/null || fail "$tool is missing: apt-get install -y --no-install-recommends ceph-mon ceph-osd radosgw"
    done
    if [[ -e $stamp && -s $dir/s3.env ]] && answering; then
        say "already running in $dir"; cat "$dir/s3.env"; return 0
    fi
    [[ -e $dir ]] && { say "cleaning up what an earlier start left in $dir"; stop; }
    mkdir -p "$dir"/{run,log,pids,mon.a,osd.0,rgw}
    touch "$stamp"
    trap 'if (($? != 0)); then say "start failed; logs:"; tail -n 20 "$dir"/log/*.log >&2 || true; stop; fi' EXIT

    local fsid; fsid=$(cat /proc/sys/kernel/random/uuid)
    cat >"$conf" <<EOF
[global]
fsid = $fsid
mon host = [v2:127.0.0.1:$mon_port,v1:127.0.0.1:$((mon_port + 1))]
public addr = 127.0.0.1
ms bind ipv6 = false
auth cluster required = none
auth service required = none
auth client required = none
run dir = $dir/run
crash dir = $dir/run
log file = $dir/log/\$name.log
pid file = $dir/run/\$name.pid
admin socket = $dir/run/\$name.asok
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
osd crush chooseleaf type = 0
mon allow pool size one = true
mon warn on pool no redundancy = false
mon max pg per osd = 1000
[mon]
mon data = $dir/mon.\$id
mon data avail warn = 2
mon data avail crit = 1
[osd]
osd data = $dir/osd.\$id
osd objectstore = memstore
memstore device bytes = $store_bytes
osd op num shards = 2
osd op num threads per shard = 2
[client.rgw.easyckpt]
rgw frontends = beast endpoint=127.0.0.1:$port tcp_nodelay=1
ms mon client mode = crc
rgw data = $dir/rgw
rgw gc obj min wait = 30
rgw gc processor period = 30
EOF
    monmaptool --create --fsid "$fsid" --addv a "[v2:127.0.0.1:$mon_port,v1:127.0.0.1:$((mon_port + 1))]" \
        "$dir/monmap" >/dev/null
    timeout 60 ceph-mon -c "$conf" -i a --mkfs --monmap "$dir/monmap" </dev/null >>"$dir/log/setup.log" 2>&1
    timeout 60 ceph-mon -c "$conf" -i a </dev/null >>"$dir/log/setup.log" 2>&1
    keep_pid mon.a
    until_ok 60 "the monitor" ceph_cli mon stat

    local uuid; uuid=$(cat /proc/sys/kernel/random/uuid)
    [[ $(ceph_cli osd new "$uuid") == 0 ]] || fail "the new OSD is not osd.0"
    timeout 120 ceph-osd -c "$conf" -i 0 --mkfs --osd-uuid "$uuid" </dev/null >>"$dir/log/setup.log" 2>&1
    MALLOC_MMAP_THRESHOLD_=1048576 timeout 120 ceph-osd -c "$conf" -i 0 </dev/null >>"$dir/log/setup.log" 2>&1
    keep_pid osd.0
    until_ok 120 "osd.0 up and in" osd_in

    timeout 60 radosgw -c "$conf" -n client.rgw.easyckpt </dev/null >>"$dir/log/setup.log" 2>&1
    keep_pid client.rgw.easyckpt
    until_ok 180 "the gateway on 127.0.0.1:$port" answering

    local key secret
    key=$(python3 -c 'import secrets, string; print("".join(secrets.choice(string.ascii_uppercase + string.digits) for _ in range(20)))')
    secret=$(python3 -c 'import secrets; print(secrets.token_hex(20))')
    timeout 60 radosgw-admin -c "$conf" user create --uid=easyckpt --display-name=easyckpt \
        --access-key="$key" --secret-key="$secret" >/dev/null 2>>"$dir/log/setup.log"
    printf 'ENDPOINT=http://127.0.0.1:%s\nACCESS_KEY=%s\nSECRET_KEY=%s\n' "$port" "$key" "$secret" >"$dir/s3.env"
    trap - EXIT
    say "ready in $dir"
    cat "$dir/s3.env"
}

# The gateway alone, the cluster (and the objects in it) left running: a store that goes away and comes back
gateway_stop() {
    [[ -e $stamp ]] || fail "no server in $dir"
    local pid i; pid=$(cat "$dir/pids/client.rgw.easyckpt" 2>/dev/null) || fail "no gateway pid in $dir"
    mine "$pid" || { say "the gateway is not running"; return 0; }
    kill -TERM "$pid"
    for ((i = 0; i < 40; i++)); do mine "$pid" || break; sleep 0.25; done
    mine "$pid" && { say "the gateway ($pid) ignored SIGTERM for 10 s: SIGKILL"; kill -KILL "$pid" 2>/dev/null || true; }
    say "gateway stopped"
}

gateway_start() {
    [[ -e $stamp ]] || fail "no server in $dir"
    answering 2>/dev/null && { say "the gateway already answers"; return 0; }
    rm -f "$dir/run/client.rgw.easyckpt.pid"
    timeout 60 radosgw -c "$conf" -n client.rgw.easyckpt </dev/null >>"$dir/log/setup.log" 2>&1
    keep_pid client.rgw.easyckpt
    until_ok 180 "the gateway on 127.0.0.1:$port" answering
    say "gateway started"
}

# The gateway frozen: the kernel still takes connections on its port, nothing answers them (a hung gateway,
# a partitioned network), until gateway-resume
gateway_signal() {   # SIGNAL WORD
    [[ -e $stamp ]] || fail "no server in $dir"
    local pid; pid=$(cat "$dir/pids/client.rgw.easyckpt" 2>/dev/null) || fail "no gateway pid in $dir"
    mine "$pid" || fail "the gateway is not running"
    kill "-$1" "$pid"
    say "gateway $2"
}

case $cmd in
    start) start ;;
    stop) stop ;;
    status) status ;;
    gateway-stop) gateway_stop ;;
    gateway-start) gateway_start ;;
    gateway-pause) gateway_signal STOP paused ;;
    gateway-resume) gateway_signal CONT resumed ;;
    *) fail "usage: $0 start|stop|status|gateway-stop|gateway-start|gateway-pause|gateway-resume [DIR]" ;;
esac
