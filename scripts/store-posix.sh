#!/usr/bin/env bash
# POSIX conformance (pjdfstest) and random I/O (fsx, 100,000 operations) of
# the onecopy store through a real FUSE mount. Run by scripts/test.sh as
# root; installs the two tools with cargo if they are missing.
# Usage: scripts/store-posix.sh [ONECOPY_BINARY]
# MOUNT_OPTS=transport=uring runs both over FUSE over io_uring.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
ONECOPY=${1:-${CARGO_TARGET_DIR:-target}/debug/onecopy}
# Absolute: the script changes directory (into the mount, then to /).
ONECOPY=$(realpath "$ONECOPY")
FSX_OPS=${FSX_OPS:-100000}
# A new fsx seed each run (printed, so a failure can be replayed with
# FSX_SEED=N): the same seed every time tests one sequence of operations.
FSX_SEED=${FSX_SEED:-$(( $(od -An -N4 -tu4 /dev/urandom) + 1 ))}
# pjdfstest's summary must be exactly this: the 16 skips are the tests
# that need what a FUSE mount in CI does not offer (see below); a test
# that starts to pass or to be skipped is a change to explain here.
PJD_WANT="0 failed, 16 skipped, 382 passed, 0 expected failures, 398 total"
export PATH="$HOME/.cargo/bin:$PATH"
command -v pjdfstest >/dev/null || cargo install --locked pjdfstest --version 0.2.2
command -v fsx >/dev/null || cargo install --locked fsx --version 0.3.2

work=$(mktemp -d /var/tmp/onecopy-posix.XXXXXX)
cleanup() {
    cd /
    fusermount3 -u "$work/mnt" 2>/dev/null || true
    for _ in $(seq 50); do pgrep -f "mount $work/store" >/dev/null || break; sleep 0.2; done
    rm -rf "$work"
}
trap cleanup EXIT
mkdir -p "$work/mnt"
chmod 755 "$work"   # pjdfstest switches to other users, who must reach the mount
"$ONECOPY" store init "$work/store" >/dev/null
"$ONECOPY" mount "$work/store" "$work/mnt" ${MOUNT_OPTS:+-o "$MOUNT_OPTS"}
echo "store-posix: mounted ${MOUNT_OPTS:+with -o $MOUNT_OPTS}"

# fsx: random reads, writes, truncates, mmap, fallocate, hole punching,
# copy_file_range, sendfile, fsync on a file of up to 8 MiB.
echo "fsx: seed $FSX_SEED (replay with FSX_SEED=$FSX_SEED)"
(cd "$work" && fsx -q -N "$FSX_OPS" -S "$FSX_SEED" -f "$ROOT/scripts/fsx-store.toml" -P "$work" "$work/mnt/fsx.dat") ||
    { echo "fsx: failed with seed $FSX_SEED (replay with FSX_SEED=$FSX_SEED)" >&2; exit 1; }
echo "fsx: $FSX_OPS operations, seed $FSX_SEED, no miscompare"

# pjdfstest: every test runs. The 16 it skips need what a FUSE mount in
# CI does not offer: a remount read-only (erofs_*), a second filesystem
# (exdev_*) and the link_count_max setting.
mkdir -p "$work/mnt/pjd"
cd "$work/mnt/pjd"
pjdfstest -c "$ROOT/scripts/pjdfstest-store.toml" -p "$work/mnt/pjd"  \
    > "$work/pjd.log" 2>&1 || { grep -E 'FAILED|Summary' "$work/pjd.log"; exit 1; }
summary=$(grep Summary "$work/pjd.log")
echo "pjdfstest $summary"
if [ "$summary" != "Summary: $PJD_WANT" ]; then
    echo "scripts/store-posix.sh: pjdfstest counts changed; expected: $PJD_WANT" >&2
    exit 1
fi
cd /
fusermount3 -u "$work/mnt"
for _ in $(seq 100); do pgrep -f "mount $work/store" >/dev/null || break; sleep 0.2; done
"$ONECOPY" store fsck "$work/store"
