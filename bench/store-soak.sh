#!/usr/bin/env bash
# Resource-bound soak of the inline store (issue 11). Usage (root, /dev/fuse):
#   bench/store-soak.sh [DURATION_S] [FILES]      (defaults 3600 and 1000000)
# Creates FILES files through a release mount, then runs DURATION_S seconds
# of mixed operations (checked reads, creates, overwrites, appends, fsyncs,
# cross-directory renames, unlinks, online `store gc` every GC_EVERY s,
# default 300), sampling the mount process's VmRSS/VmHWM/threads/open fds
# every 10 s and the p50/p99/p99.9 latency of each minute's operations
# (bench/store-soak.py). Then: unmount, `store fsck` must be clean, remount,
# a sample of CHECK (default 20000) live files must read exactly as the
# record says, unlinked names must be gone and every directory's entry count
# must match. Prints a summary (RSS/fds bounds, first vs last 10 minutes'
# latency). ONECOPY=path runs that binary; WORK=dir keeps the store there;
# SEED replays the operation sequence.
set -euo pipefail
cd "$(dirname "$0")/.."
DURATION=${1:-3600}
FILES=${2:-1000000}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target}
if [ -z "${ONECOPY:-}" ]; then
    cargo build -q --release -p onecopy
    ONECOPY=$CARGO_TARGET_DIR/release/onecopy
fi
O=$(readlink -f "$ONECOPY")
work=${WORK:-$(mktemp -d /var/tmp/onecopy-soak.XXXXXX)}
mkdir -p "$work/mnt"
log=$work/soak.jsonl
echo "work: $work  log: $log  binary: $O"
mpid=
cleanup() {
    if mountpoint -q "$work/mnt"; then fusermount3 -u "$work/mnt" || fusermount3 -u -z "$work/mnt"; fi
    [ -n "$mpid" ] && wait "$mpid" 2>/dev/null || true
}
trap cleanup EXIT
mount_store() {
    "$O" mount -f "$work/s" "$work/mnt" 2>>"$work/mount.stderr" &
    mpid=$!
    for _ in $(seq 300); do mountpoint -q "$work/mnt" && return 0; sleep 0.1; done
    echo "mount did not appear"; cat "$work/mount.stderr"; exit 1
}
umount_store() {
    fusermount3 -u "$work/mnt"
    wait "$mpid"; local rc=$?; mpid=
    [ "$rc" = 0 ] || { echo "mount exited $rc"; exit 1; }
}
"$O" store init "$work/s" >/dev/null
mount_store
seed=${SEED:-$(date +%s)}
echo "seed: $seed  mount pid: $mpid"
t0=$(date +%s)
python3 bench/store-soak.py --mnt "$work/mnt" --store "$work/s" --onecopy "$O" --pid "$mpid" \
    --files "$FILES" --duration "$DURATION" --gc-every "${GC_EVERY:-300}" --seed "$seed" \
    --out "$log" --record "$work/record.bin"
t1=$(date +%s)
umount_store
echo "unmount: $(( $(date +%s) - t1 )) s"
t2=$(date +%s)
"$O" store fsck "$work/s" > "$work/fsck.txt" 2>&1 || { echo "fsck exited $?:"; cat "$work/fsck.txt"; exit 1; }
echo "fsck: clean in $(( $(date +%s) - t2 )) s"
t3=$(date +%s)
mount_store
echo "remount: $(( $(date +%s) - t3 )) s"
python3 bench/store-soak.py --check --mnt "$work/mnt" --record "$work/record.bin" \
    --out "$log" --seed "$seed" --check-sample "${CHECK:-20000}"
umount_store
! grep -q panicked "$work/mount.stderr"
"$O" store stats "$work/s" | head -20
python3 bench/store-soak.py --summary --out "$log"
echo "total: $(( $(date +%s) - t0 )) s (workload $(( t1 - t0 )) s)"
