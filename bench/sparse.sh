#!/usr/bin/env bash
# Huge sparse files (VM images, thin disks): two SIZE_GIB files holding the
# same 3 MiB of data (1 MiB at 0, at 40% and at the end), the rest holes,
# on a fresh loop filesystem per run. Each CONFIG dedupes them cold (fresh
# files, fresh catalog, page cache dropped), then once more warm (its
# catalog kept). Reports wall, CPU, peak RSS and the space freed (df).
#
# Usage (root):
#   bench/sparse.sh CONFIG...
#   CONFIG = label=BINARY[,ARG...]     onecopy, e.g. new=target/release/onecopy
#          | label=duperemove[,ARG...] duperemove -dr --hashfile (if installed)
# SIZE_GIB (default 64), FS (default "btrfs xfs"), WORKDIR (default
# /var/tmp).
set -euo pipefail
size=$(( ${SIZE_GIB:-64} << 30 ))
w=$(mktemp -d "${WORKDIR:-/var/tmp}/onecopy-sparse.XXXXXX")
cleanup() {
    umount "$w/mnt" 2>/dev/null || true
    rm -rf "$w"
}
trap cleanup EXIT
mkdir -p "$w/mnt"

fresh_fs() { # kind
    umount "$w/mnt" 2>/dev/null || true
    rm -f "$w/img"
    truncate -s 4G "$w/img"
    "mkfs.$1" -q -f "$w/img" >/dev/null 2>&1
    mount -o loop "$w/img" "$w/mnt"
    mkdir "$w/mnt/data"
    python3 - "$w/mnt/data" "$size" <<'EOF'
import os, sys
d, size = sys.argv[1], int(sys.argv[2])
data = bytes((i * 2654435761 >> 13) & 255 for i in range(1 << 20))
for name in ("a", "b"):
    with open(os.path.join(d, name), "wb") as f:
        f.truncate(size)
        for at in (0, size * 2 // 5 // 4096 * 4096, size - (1 << 20)):
            f.seek(at)
            f.write(data)
        os.fsync(f.fileno())
EOF
    sleep 1.1 # not racily clean
}

free_bytes() { df -B1 --output=avail "$w/mnt" | tail -1; }

run() { # label fs pass binary args...
    local label=$1 fs=$2 pass=$3 bin=$4; shift 4
    local cat="$w/$label.catalog" before after cmd
    sync; echo 3 > /proc/sys/vm/drop_caches
    before=$(free_bytes)
    if [ "$(basename "$bin")" = duperemove ]; then
        cmd=("$bin" -dr --hashfile="$cat" "$@" "$w/mnt/data")
    else
        cmd=("$bin" dedupe --hashfile "$cat" "$@" "$w/mnt/data")
    fi
    /usr/bin/time -o "$w/time" -f '%e %U %S %M' "${cmd[@]}" > "$w/out" 2>&1 ||
        { echo "$label failed:"; tail -3 "$w/out"; }
    sync
    after=$(free_bytes)
    read -r wall user sys peak < <(tail -1 "$w/time")
    printf '| %s | %s | %s | %s | %s | %s | %s | %s |\n' "$fs" "$label" "$pass" "$wall" "$user" \
        "$sys" "$(awk -v k="$peak" 'BEGIN { printf "%.1f", k / 1024 }')" \
        "$(awk -v b="$((after - before))" 'BEGIN { printf "%.1f", b / 1048576 }')"
}

echo "two ${SIZE_GIB:-64} GiB sparse files, 3 MiB of data each, the same"
echo
echo '| fs | config | run | wall s | user s | sys s | peak RSS MiB | freed MiB |'
echo '|---|---|---|---:|---:|---:|---:|---:|'
for fs in ${FS:-btrfs xfs}; do
    for config in "$@"; do
        label=${config%%=*}
        IFS=, read -r -a args <<< "${config#*=}"
        bin=${args[0]}
        fresh_fs "$fs"
        rm -f "$w/$label.catalog"*
        run "$label" "$fs" cold "$bin" "${args[@]:1}"
        run "$label" "$fs" warm "$bin" "${args[@]:1}"
    done
done
