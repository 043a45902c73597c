#!/usr/bin/env bash
# FUSE requests and the mount's CPU per small file (issue 33): `cp -a`,
# `rsync -a` and `tar x` (PROGS) of FILES files of 1 KiB (onecopy-workload
# small) into a fresh store's mount (MOUNT_OPTS, e.g. transport=uring),
# cache dropped before each; every request counted with the
# `fuse:fuse_request_send` tracepoint (perf), the mount's CPU from
# /proc/PID/stat before and after. The wall is under the tracer: not a
# speed figure (bench/store.sh gives those). TREE=DIR copies that tree
# instead (FILES is then its file count); LATENCY=1 also records
# `fuse:fuse_request_end` and gives each opcode's mean, median, 90th
# percentile and summed latency
# (bench/fuse_requests.py); INIT_ARGS are passed to `store init` (e.g.
# "--chunking cdc:16K/64K/256K"). Only the mount's own connection counts.
# Usage (as root): bench/store-requests.sh   FILES=100000 PROGS='cp rsync tar' MOUNT_OPTS= ONECOPY=path TREE= LATENCY= INIT_ARGS=
set -euo pipefail
cd "$(dirname "$0")/.."
FILES=${FILES:-100000}
O=${ONECOPY:-$PWD/target/release/onecopy}
W=$PWD/target/release/onecopy-workload
[ -x "$O" ] || cargo build --release -q -p onecopy
[ -n "${TREE:-}" ] || [ -x "$W" ] || cargo build --release -q -p onecopy-workload
command -v perf >/dev/null || { echo "needs perf (linux-perf)" >&2; exit 2; }
[ -d /sys/kernel/tracing/events ] || mount -t tracefs nodev /sys/kernel/tracing
w=$(mktemp -d /var/tmp/onecopy-requests.XXXXXX)
cleanup() { fusermount3 -u "$w/mnt" 2>/dev/null || true; rm -rf "$w"; }
trap cleanup EXIT
if [ -n "${TREE:-}" ]; then
    cp -a "$TREE" "$w/tree"
else
    "$W" small --dir "$w/tree" --files "$FILES" >/dev/null
fi
n=$(find "$w/tree" -type f | wc -l)
# shellcheck disable=SC2086 # INIT_ARGS is a list of arguments
"$O" store init "$w/s" ${INIT_ARGS:-} >/dev/null; mkdir "$w/mnt"; "$O" mount "$w/s" "$w/mnt" ${MOUNT_OPTS:+-o "$MOUNT_OPTS"}
pid=$(cat "$w/s/mount.pid")
# The kernel's dev_t of the mount, the tracepoints' "connection".
read -r major minor < <(stat -c '%Hd %Ld' "$w/mnt")
conn=$(( (major << 20) | minor ))
events=(-e fuse:fuse_request_send)
[ -n "${LATENCY:-}" ] && events+=(-e fuse:fuse_request_end)
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
    perf record -q "${events[@]}" -a -o "$w/perf.data" -- "${cmd[@]}" 2>/dev/null
    sync -f "$w/mnt"; t1=$(date +%s.%N); c1=$(cpu "$pid")
    echo "### ${cmd[0]} ${cmd[1]}${MOUNT_OPTS:+ (-o $MOUNT_OPTS)}"
    python3 -c "import sys; n=int(sys.argv[1]); c=(float(sys.argv[3])-float(sys.argv[2]))/int(sys.argv[6]); w=float(sys.argv[5])-float(sys.argv[4]); print(f'{n} files: wall {w:.1f} s (under perf), mount CPU {c:.2f} s = {c/n*1e6:.0f} us per file')" \
        "$n" "$c0" "$c1" "$t0" "$t1" "$(getconf CLK_TCK)"
    perf script -i "$w/perf.data" 2>/dev/null | python3 bench/fuse_requests.py "$n" "$conn"
done
