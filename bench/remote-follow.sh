#!/usr/bin/env bash
# Issue 32's follower goal: "A read-only mount from the bucket on an empty
# cache serves a store of 1 M files within 60 s of starting", on one
# freshly started SeaweedFS (`weed mini` on loopback, its data on this
# machine's disk):
# - the `many` tree (FILES files, default 1,000,000) is generated and
#   `store import`ed into a remote store (encrypted, the default); the
#   import's close pushes the metadata to the bucket;
# - page cache dropped, `onecopy mount --read-only --remote` starts a
#   follower from an empty private cache; timed from before that command
#   until one of the tree's deepest files reads back equal to its source,
#   polled every 0.05 s;
# - then a full `find -type f` of the follower, counted against the source.
#
# Usage: bench/remote-follow.sh (as root); FILES=N, KEEP=1.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "run as root" >&2; exit 2; }
FILES=${FILES:-1000000}
cargo build -q --release -p onecopy
cargo build -q --release -p onecopy-workload
O=$(realpath target/release/onecopy)
W=$(realpath target/release/onecopy-workload)
. bench/weed.sh
work=$(mktemp -d /var/tmp/onecopy-remote-follow.XXXXXX)
export AWS_ACCESS_KEY_ID=benchkey AWS_SECRET_ACCESS_KEY=benchsecret AWS_REGION=us-east-1
export ONECOPY_PASSWORD=bench-passphrase
now() { date +%s.%N; }
secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", b - a }'; }
# The follower's daemon: `onecopy mount /var/tmp/onecopy-follow.XXX MNT -f ...`.
follower() { pgrep -f "mount /var/tmp/onecopy-follow\.[^ ]* $work/mnt -f" || true; }
cleanup() {
    fusermount3 -uz "$work/mnt" 2>/dev/null || true
    for _ in $(seq 100); do [ -z "$(follower)" ] && break; sleep 0.1; done
    [ -f "$work/weed/pid" ] && kill "$(cat "$work/weed/pid")" 2>/dev/null || true
    sleep 1
    [ "${KEEP:-0}" = 1 ] || rm -rf "$work"
}
trap cleanup EXIT
mkdir -p "$work/mnt"
weed_start "$work/weed" bench
ep=http://127.0.0.1:$(cat "$work/weed/s3")

# 1. The tree (generated while weed starts).
t=$(now)
"$W" many --dir "$work/tree" --files "$FILES" >/dev/null
gen=$(secs "$t" "$(now)")
echo "tree of $FILES files generated in $gen s" >&2
# The file to wait for: the last of the deepest ones `find` lists (the
# last one alone may sit near the top), path relative to the tree;
# import puts the tree at /tree in the store.
last=$(find "$work/tree" -type f -printf '%d %P\n' | sort -s -n -k1,1 | tail -1 | cut -d' ' -f2-)
src_count=$(find "$work/tree" -type f | wc -l)
[ "$src_count" = "$FILES" ] || echo "note: the tree holds $src_count files, not $FILES" >&2
echo "file waited for: tree/$last" >&2

# 2. The store in the bucket, the tree imported into it.
for _ in $(seq 120); do
    [ "$(curl -s -o /dev/null -w '%{http_code}' "$ep/bench")" != 000 ] && break
    sleep 0.5
done
"$O" store init "$work/cache" --remote s3://bench/store --endpoint "$ep" >/dev/null
sync; echo 3 > /proc/sys/vm/drop_caches
t=$(now)
"$O" store import "$work/cache" "$work/tree" >"$work/import.out"
imp=$(secs "$t" "$(now)")
echo "import: $(cat "$work/import.out") ($imp s)" >&2
bucket=$(du -sb "$work/weed/data" | cut -f1)
echo "weed's data directory: $((bucket >> 20)) MiB" >&2

# 3. The follower, from an empty cache.
sync; echo 3 > /proc/sys/vm/drop_caches
t0=$(now)
"$O" mount --read-only --remote s3://bench/store --endpoint "$ep" "$work/mnt"
tm=$(now)
while ! cmp -s "$work/mnt/tree/$last" "$work/tree/$last" 2>/dev/null; do
    if [ "$(secs "$t0" "$(now)" | cut -d. -f1)" -ge 600 ]; then
        echo "the follower did not serve tree/$last within 600 s" >&2
        exit 1
    fi
    sleep 0.05
done
t1=$(now)
cache=$(pgrep -af "mount /var/tmp/onecopy-follow\.[^ ]* $work/mnt -f" | awk '{print $4}')
[ -n "$cache" ] && echo "follower's cache after that read: $(($(du -sb "$cache" | cut -f1) >> 20)) MiB" >&2
t=$(now)
count=$(find "$work/mnt" -type f | wc -l)
list=$(secs "$t" "$(now)")
pid=$(follower)

# 4. The table.
echo "| files | tree generation s | import s | follower: mount returned after s | first file served after s | goal s | full listing s | files listed |"
echo "|---:|---:|---:|---:|---:|---:|---:|---:|"
echo "| $FILES | $gen | $imp | $(secs "$t0" "$tm") | $(secs "$t0" "$t1") | 60 | $list | $count |"

# 5. Unmount; the daemon removes its private cache as it exits.
fusermount3 -u "$work/mnt"
for _ in $(seq 600); do [ -z "$(follower)" ] && break; sleep 0.1; done
[ -z "$(follower)" ] || { echo "the follower (pid $pid) did not exit within 60 s" >&2; exit 1; }
if [ "$count" != "$src_count" ]; then
    echo "the follower lists $count files, the tree holds $src_count" >&2
    exit 1
fi
