#!/usr/bin/env bash
# FUSE requests and the mount's CPU per small file (issue 33): `cp -a`,
# `rsync -a` and `tar x` (PROGS) of FILES files of 1 KiB (onecopy-workload
# small) into a fresh store's mount (MOUNT_OPTS, e.g. transport=uring),
# cache dropped before each; every request counted with the
# `fuse:fuse_request_send` tracepoint (perf), the mount's CPU from
# /proc/PID/stat before and after. The wall is under the tracer: not a
# speed figure (bench/store.sh gives those).
# Usage (as root): bench/store-requests.sh   FILES=100000 PROGS='cp rsync tar' MOUNT_OPTS= ONECOPY=path
set -euo pipefail
cd "$(dirname "$0")/.."
FILES=${FILES:-100000}
O=${ONECOPY:-$PWD/target/release/onecopy}
W=$PWD/target/release/onecopy-workload
[ -x "$O" ] && [ -x "$W" ] || cargo build --release -q -p onecopy -p onecopy-workload
command -v perf >/dev/null || { echo "needs perf (linux-perf)" >&2; exit 2; }
w=$(mktemp -d /var/tmp/onecopy-requests.XXXXXX)
cleanup() { fusermount3 -u "$w/mnt" 2>/dev/null || true; rm -rf "$w"; }
trap cleanup EXIT
"$W" small --dir "$w/tree" --files "$FILES" >/dev/null
n=$(find "$w/tree" -type f | wc -l)
"$O" store init "$w/s" >/dev/null; mkdir "$w/mnt"; "$O" mount "$w/s" "$w/mnt" ${MOUNT_OPTS:+-o "$MOUNT_OPTS"}
pid=$(cat "$w/s/mount.pid")
tar cf "$w/tree.tar" -C "$w" tree
cpu() { awk '{print $14+$15}' "/proc/$1/stat"; }
for prog in ${PROGS:-cp rsync tar}; do
    case $prog in
        cp) cmd=(cp -a "$w/tree" "$w/mnt/cp") ;;
        rsync) cmd=(rsync -a "$w/tree/" "$w/mnt/rsync") ;;
        tar) mkdir "$w/mnt/tar"; cmd=(tar xf "$w/tree.tar" -C "$w/mnt/tar") ;;
        *) echo "unknown program $prog" >&2; exit 2 ;;
    esac
    sync; echo 3 > /proc/sys/vm/drop_caches
    c0=$(cpu "$pid"); t0=$(date +%s.%N)
    perf record -q -e fuse:fuse_request_send -a -o "$w/perf.data" -- "${cmd[@]}" 2>/dev/null
    sync -f "$w/mnt"; t1=$(date +%s.%N); c1=$(cpu "$pid")
    echo "### ${cmd[0]} ${cmd[1]}${MOUNT_OPTS:+ (-o $MOUNT_OPTS)}"
    python3 -c "import sys; n=int(sys.argv[1]); c=(float(sys.argv[3])-float(sys.argv[2]))/int(sys.argv[6]); w=float(sys.argv[5])-float(sys.argv[4]); print(f'{n} files: wall {w:.1f} s (under perf), mount CPU {c:.2f} s = {c/n*1e6:.0f} us per file')" \
        "$n" "$c0" "$c1" "$t0" "$t1" "$(getconf CLK_TCK)"
    echo "| opcode | requests | per file |"
    echo "|---|---:|---:|"
    perf script -i "$w/perf.data" 2>/dev/null | grep -o "opcode [0-9]* ([A-Z_]*)" | sort | uniq -c | sort -rn |
        awk -v n="$n" '{gsub(/[()]/, "", $4); printf "| `%s` | %d | %.2f |\n", $4, $1, $1/n}'
    perf script -i "$w/perf.data" 2>/dev/null | grep -c "opcode" | awk -v n="$n" '{printf "| all | %d | %.2f |\n", $1, $1/n}'
done
