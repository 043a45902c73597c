#!/usr/bin/env bash
# cp -a of a small-file tree into: native (the backing ext4), onecopy's
# fuser null filesystem (crates/fuse/examples/nullfs, as bench/store.sh
# mounts it) and the fractal-fuse null filesystem of this directory (FUSE
# over io_uring), alternated in rotating order, page cache dropped before
# each copy, time including a final `sync`. As root, enable_uring = Y.
# Build first (README.md, "FUSE over io_uring"). Usage:
#   bench/ffuse-null/bench.sh FILES ROUNDS  (CONFIGS="native fuser ffuse" default;
#   env NULLFS, FFUSE, W, ONECOPY override the binaries)
#   HALT_POLL_NS=N: the guest's halt polling for the run (bench/haltpoll.sh)
set -euo pipefail
cd "$(dirname "$0")/../.."
. bench/haltpoll.sh
trap haltpoll_restore EXIT
T=${CARGO_TARGET_DIR:-target}
W=${W:-$T/release/onecopy-workload}
NULLFS=${NULLFS:-$T/release/examples/nullfs}
O=${ONECOPY:-$T/release/onecopy}
FFUSE=${FFUSE:-bench/ffuse-null/target/release/ffuse-null}
[ "$(cat /sys/module/fuse/parameters/enable_uring)" = Y ] ||
    { echo "echo Y > /sys/module/fuse/parameters/enable_uring first (as root)" >&2; exit 2; }
FILES=${1:-100000}; ROUNDS=${2:-3}
work=${WORK:-/var/tmp/ffuse}
mkdir -p "$work"/{null,native}
tree=$work/tree-$FILES
[ -d "$tree" ] || "$W" small --dir "$tree" --files "$FILES" >/dev/null
drop() { sync; echo 3 > /proc/sys/vm/drop_caches; }
cpu() { awk '{print ($14+$15)/100}' "/proc/$1/stat"; }
run() { # CONFIG ROUND
    local dst pid=
    case $1 in
        native) dst=$work/native/t ;;
        fuser) "$NULLFS" "$work/null" & pid=$!; dst=$work/null/t ;;
        fuser1) "$NULLFS" "$work/null" 1 & pid=$!; dst=$work/null/t ;;
        ffuse) "$FFUSE" "$work/null" ${FFUSE_ARGS:-} 2>/dev/null & pid=$!; dst=$work/null/t ;;
        ffuse-nowb) NULL_WRITEBACK=0 "$FFUSE" "$work/null" 2>/dev/null & pid=$!; dst=$work/null/t ;;
        ffuse-1w) "$FFUSE" "$work/null" 1 2>/dev/null & pid=$!; dst=$work/null/t ;;
        ffuse-q256) "$FFUSE" "$work/null" 2 256 2>/dev/null & pid=$!; dst=$work/null/t ;;
        store) # the onecopy store itself (fuser), as bench/store.sh mounts it
            "$O" store init "$work/s" >/dev/null; "$O" mount "$work/s" "$work/null"
            pid=$(cat "$work/s/mount.pid"); dst=$work/null/t ;;
        store1) # the same with one FUSE worker thread
            "$O" store init "$work/s" >/dev/null; "$O" mount "$work/s" "$work/null" -o threads=1
            pid=$(cat "$work/s/mount.pid"); dst=$work/null/t ;;
    esac
    sleep 1; drop
    local t0 t1 t2 c=-
    t0=$(date +%s.%N); cp -a "$tree" "$dst"; t1=$(date +%s.%N)
    [ "$1" = native ] || sync -f "$work/null"; sync; t2=$(date +%s.%N)
    if [ -n "$pid" ]; then c=$(cpu $pid); fusermount3 -u "$work/null"
        while kill -0 "$pid" 2>/dev/null; do sleep 0.2; done; rm -rf "$work/s"
    else rm -rf "$dst"; fi
    python3 -c "import sys; a,b,c=map(float,sys.argv[1:4]); print(f'{sys.argv[4]} round {sys.argv[5]} files {sys.argv[6]} wall {c-a:.2f} cp {b-a:.2f} daemon_cpu {sys.argv[7]} load {sys.argv[8]}')" \
        "$t0" "$t1" "$t2" "$1" "$2" "$FILES" "$c" "$(cut -d' ' -f1 /proc/loadavg)"
}
# CONFIGS: also fuser1 (one worker thread), ffuse-nowb (no writeback
# cache), ffuse-1w (one worker), ffuse-q256 (fractal-fuse's default queue
# depth; 32 otherwise), store, store1 (one worker thread).
read -ra configs <<< "${CONFIGS:-native fuser ffuse}"
n=${#configs[@]}
for r in $(seq 1 "$ROUNDS"); do
    for i in $(seq 0 $((n - 1))); do run "${configs[$(( (i + r) % n ))]}" "$r"; done
done
