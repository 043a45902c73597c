#!/usr/bin/env bash
# Peak RSS and wall of incremental runs (issue 9's memory goal): the `many`
# workload (default 1 M files) on one loop btrfs, each configuration run
# cold once (fresh catalog) and then warm ROUNDS times (a copy of its cold
# catalog), configurations alternating, dry run, page cache dropped before
# every run. The tree is made once and reused: it takes minutes.
#
# Usage (root):
#   bench/many-rss.sh CONFIG...
#   CONFIG = label=BINARY[,ARG...]   e.g.  main-64K=/tmp/main,-b,64K
#                                          new-4K=target/release/onecopy
# FILES (default 1000000), ROUNDS (default 2), WORKDIR (default /var/tmp;
# the image and catalogs), KEEP=1 keeps the image for the next call.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target}
cargo build -q --release -p onecopy-workload
W=$CARGO_TARGET_DIR/release/onecopy-workload
w=${WORKDIR:-/var/tmp}/onecopy-many-rss
mkdir -p "$w/mnt"
cleanup() {
    [ "${KEEP:-}" = 1 ] && return
    umount "$w/mnt" 2>/dev/null || true
    rm -rf "$w"
}
trap cleanup EXIT
if ! mountpoint -q "$w/mnt"; then
    [ -f "$w/img" ] || { truncate -s 30G "$w/img"; mkfs.btrfs -q "$w/img" >/dev/null 2>&1; }
    mount -o loop "$w/img" "$w/mnt"
fi
[ -d "$w/mnt/data" ] || "$W" many --dir "$w/mnt/data" --files "${FILES:-1000000}" >/dev/null
run() { # label catalog binary args...
    local label=$1 cat=$2 bin=$3; shift 3
    sync; echo 3 > /proc/sys/vm/drop_caches
    /usr/bin/time -o "$w/time" -f '%e %U %S %M' "$bin" dedupe --dry-run --json --hashfile "$cat" "$@" \
        "$w/mnt/data" > "$w/$label.json" 2>/dev/null || true
    read -r wall user sys peak < <(tail -1 "$w/time")
    printf '| %s | %s | %s | %s | %s | %s |\n' "$label" "$wall" "$user" "$sys" \
        "$(awk -v k="$peak" 'BEGIN { printf "%.1f", k / 1024 }')" "$(cut -d' ' -f1 /proc/loadavg)"
}
printf '| run | wall s | user s | sys s | peak RSS MiB | load |\n|---|---|---|---|---|---|\n'
configs=("$@")
for cfg in "${configs[@]}"; do
    label=${cfg%%=*}; IFS=, read -r -a argv <<< "${cfg#*=}"
    rm -f "$w/$label.cat"*
    run "$label-cold" "$w/$label.cat" "${argv[@]}"
done
for i in $(seq "${ROUNDS:-2}"); do
    for cfg in "${configs[@]}"; do
        label=${cfg%%=*}; IFS=, read -r -a argv <<< "${cfg#*=}"
        cp "$w/$label.cat" "$w/warm.cat"
        run "$label-warm$i" "$w/warm.cat" "${argv[@]}"
        rm -f "$w/warm.cat"*
    done
    # Alternate the order between rounds.
    configs=($(printf '%s\n' "${configs[@]}" | tac))
done
