#!/usr/bin/env bash
# Measures onecopy at several --block-size values on the `near` workload:
# wall time, peak RSS, fingerprint table size, bytes freed, re-homed bytes.
# Usage (as root): bench/blocksize.sh [btrfs|xfs] [SIZE]   (defaults: btrfs 1G)
# The figures behind the default block size in ARCHITECTURE.md.
set -euo pipefail
cd "$(dirname "$0")/.."
FS=${1:-btrfs}
SIZE=${2:-1G}
cargo build -q --release -p onecopy -p onecopy-workload
W=target/release/onecopy-workload
O=target/release/onecopy
work=$(mktemp -d /var/tmp/onecopy-bs.XXXXXX)
cleanup() { umount "$work/mnt" 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT
mkdir -p "$work/mnt"
printf '| block size | wall s | peak RSS MiB | table KiB | freed MiB | re-homed KiB |\n|---|---|---|---|---|---|\n'
for bs in 4K 16K 64K 128K; do
    truncate -s 4G "$work/img"
    if [ "$FS" = btrfs ]; then mkfs.btrfs -q -f "$work/img" >/dev/null; else mkfs.xfs -q -f -m reflink=1 "$work/img"; fi
    mount -o loop,noatime "$work/img" "$work/mnt"
    $W near --dir "$work/mnt/w" --size "$SIZE" --seed 7 >/dev/null
    sync; sleep 1.2; echo 3 > /proc/sys/vm/drop_caches
    /usr/bin/time -f '%e %M' -o "$work/time" $O dedupe --json --no-catalog -b "$bs" "$work/mnt" > "$work/out.json"
    read -r wall rss < "$work/time"
    python3 - "$work/out.json" "$bs" "$wall" "$rss" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(f"| {sys.argv[2]} | {sys.argv[3]} | {int(sys.argv[4]) / 1024:.0f} | {d['plan']['index_memory_bytes'] / 1024:.0f} | {d['bytes_freed'] / 2**20:.1f} | {d['rehome_bytes_written'] / 1024:.0f} |")
PY
    umount "$work/mnt"; rm -f "$work/img"
done
