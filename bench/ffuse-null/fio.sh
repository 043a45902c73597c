#!/usr/bin/env bash
# fio sequential 1 MiB writes (as bench/store.sh's fio section) into the
# fuser and the fractal-fuse null filesystems, alternated. Usage:
# bench/ffuse-null/fio.sh ROUNDS [SIZE]  (env NULLFS, FFUSE override the binaries)
set -euo pipefail
cd "$(dirname "$0")/../.."
T=${CARGO_TARGET_DIR:-target}
W=${W:-$T/release/onecopy-workload}
NULLFS=${NULLFS:-$T/release/examples/nullfs}
FFUSE=${FFUSE:-bench/ffuse-null/target/release/ffuse-null}
[ "$(cat /sys/module/fuse/parameters/enable_uring)" = Y ] ||
    { echo "echo Y > /sys/module/fuse/parameters/enable_uring first (as root)" >&2; exit 2; }
ROUNDS=${1:-3}; SIZE=${2:-2G}
work=${WORK:-/var/tmp/ffuse}; mkdir -p "$work/null"
drop() { sync; echo 3 > /proc/sys/vm/drop_caches; }
for r in $(seq 1 "$ROUNDS"); do
    for c in fuser ffuse; do
        if [ $c = fuser ]; then "$NULLFS" "$work/null" & else "$FFUSE" "$work/null" ${FFUSE_ARGS:-} 2>/dev/null & fi
        pid=$!; sleep 1; drop
        fio --name=s --filename="$work/null/f" --size="$SIZE" --rw=write --bs=1M --ioengine=psync \
            --refill_buffers --randseed=42 --end_fsync=1 --output-format=json > "$work/fio.json"
        cpu=$(awk '{print ($14+$15)/100}' /proc/$pid/stat)
        fusermount3 -u "$work/null"; wait $pid || true
        mbps=$(python3 -c "import json; print(round(json.load(open('$work/fio.json'))['jobs'][0]['write']['bw_bytes']/1e6))")
        echo "fio $c round $r write_MBps $mbps daemon_cpu $cpu load $(cut -d' ' -f1 /proc/loadavg)"
    done
done
