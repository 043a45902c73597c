#!/usr/bin/env bash
# Matching granularity side by side (issue 9): the same workload deduped by
# several onecopy configurations, each on its own fresh loop filesystem with
# byte-identical data, cold cache. Reports wall, CPU, peak RSS, bytes freed
# (df, after commit) and what the run reported, and the block table's home.
#
# Usage (root):
#   bench/granularity.sh WORKLOAD FS [GEN_ARGS...] -- CONFIG...
#   CONFIG = label=BINARY[,ARG...]   e.g.  old-64K=/tmp/old
#                                          old-4K=/tmp/old,-b,4K
#                                          new=target/release/onecopy
# GEN_ARGS go to onecopy-workload (e.g. --size 1G, --files 1000000).
# DRY=1 runs every configuration with --dry-run --no-catalog (memory and
# time of matching without touching the filesystem; freed is then the
# run's estimate). WORKDIR (default /var/tmp) holds the images.
set -euo pipefail
cd "$(dirname "$0")/.."
WL=$1 FS=$2; shift 2
gen=()
while [ $# -gt 0 ] && [ "$1" != -- ]; do gen+=("$1"); shift; done
[ "${1:-}" = -- ] && shift
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target}
cargo build -q --release -p onecopy-workload
W=$CARGO_TARGET_DIR/release/onecopy-workload
work=$(mktemp -d "${WORKDIR:-/var/tmp}/onecopy-gran.XXXXXX")
loop=
cleanup() {
    umount "$work/mnt" 2>/dev/null || true
    [ -n "$loop" ] && losetup -d "$loop" 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT
mkdir -p "$work/mnt"
img_size=${IMAGE_SIZE:-12G}
printf '| config | wall s | user s | sys s | peak RSS MiB | freed MiB (df) | freed MiB (report) | table | table KiB | disk reads |\n|---|---|---|---|---|---|---|---|---|---|\n'
for cfg in "$@"; do
    label=${cfg%%=*}
    IFS=, read -r -a argv <<< "${cfg#*=}"
    bin=${argv[0]}; extra=("${argv[@]:1}")
    rm -f "$work/img"; truncate -s "$img_size" "$work/img"
    loop=$(losetup -f --show --direct-io=on "$work/img")
    if [ "$FS" = btrfs ]; then mkfs.btrfs -q -f "$loop" >/dev/null; else mkfs.xfs -q -f -m reflink=1 "$loop" >/dev/null; fi
    mount -o noatime "$loop" "$work/mnt"
    "$W" "$WL" --dir "$work/mnt/data" --seed 1 "${gen[@]}" > "$work/gen.json"
    sync -f "$work/mnt"; [ "$FS" = btrfs ] && btrfs filesystem sync "$work/mnt" >/dev/null
    sleep 1
    used0=$(df -B1 --output=used "$work/mnt" | tail -1)
    sync; echo 3 > /proc/sys/vm/drop_caches
    if [ -n "${DRY:-}" ]; then extra+=(--dry-run --no-catalog); else extra+=(--hashfile "$work/h.sqlite"); fi
    rm -f "$work"/h.sqlite*
    echo "$label: $(cat /proc/loadavg)" >&2
    /usr/bin/time -f '%e %U %S %M' -o "$work/time" "$bin" dedupe --json "${extra[@]}" "$work/mnt/data" > "$work/out.json" || true
    sync -f "$work/mnt"; [ "$FS" = btrfs ] && btrfs filesystem sync "$work/mnt" >/dev/null
    sleep 1
    used1=$(df -B1 --output=used "$work/mnt" | tail -1)
    cp "$work/out.json" "/var/tmp/gran-$WL-$FS-$label.json"
    read -r wall user sys rss < "$work/time"
    python3 - "$work/out.json" "$label" "$wall" "$user" "$sys" "$rss" "$used0" "$used1" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
label, wall, user, sys_, rss, u0, u1 = sys.argv[2:]
p = d["plan"]
home = "disk" if p.get("index_spilled") else "RAM"
freed = (int(u0) - int(u1)) / 2**20
print(f"| {label} (-b {d['block_size'] // 1024}K) | {wall} | {user} | {sys_} | {int(rss) / 1024:.1f} | {freed:.1f} | {d['bytes_freed'] / 2**20:.1f} | {home} | {p['index_memory_bytes'] / 1024:.0f} | {p.get('index_disk_reads', 0)} |")
PY
    umount "$work/mnt"; losetup -d "$loop"; loop=
done
