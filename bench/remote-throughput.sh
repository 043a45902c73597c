#!/usr/bin/env bash
# Issue 32's throughput goals, on one freshly started SeaweedFS (`weed
# mini` on loopback, its data on this machine's disk):
# - the endpoint's own ceiling through the store's S3 client
#   (crates/objects/examples/throughput.rs): 16 MiB objects put one after
#   the other, then read back by ranged GETs one at a time;
# - a sequential write of SIZE_MIB (default 4096) through a remote store's
#   mount, timed from the first byte until the unmount returns (it waits
#   until every container is in the bucket and the metadata is pushed);
# - a cold read of that file from an empty cache (`store init --recover`
#   on a new directory, then a mount, cache dropped).
# The store is encrypted (the default); its containers are 32 MiB.
#
# Usage: bench/remote-throughput.sh (as root); SIZE_MIB=N, KEEP=1.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "run as root" >&2; exit 2; }
SIZE_MIB=${SIZE_MIB:-4096}
cargo build -q --release -p onecopy -p onecopy-objects --example throughput
O=$(realpath target/release/onecopy)
T=$(realpath target/release/examples/throughput)
WEED=${WEED:-$(pyenv which weed 2>/dev/null || command -v weed)}
work=$(mktemp -d /var/tmp/onecopy-remote-throughput.XXXXXX)
export AWS_ACCESS_KEY_ID=benchkey AWS_SECRET_ACCESS_KEY=benchsecret AWS_REGION=us-east-1
export ONECOPY_PASSWORD=bench-passphrase
cleanup() {
    for m in "$work/mnt" "$work/mnt2"; do fusermount3 -uz "$m" 2>/dev/null || true; done
    [ -f "$work/weed.pid" ] && kill "$(cat "$work/weed.pid")" 2>/dev/null || true
    sleep 1
    [ "${KEEP:-0}" = 1 ] || rm -rf "$work"
}
trap cleanup EXIT
ports=$(python3 -c 'import socket
s=[socket.socket() for _ in range(11)]
[x.bind(("127.0.0.1",0)) for x in s]
print(" ".join(str(x.getsockname()[1]) for x in s))')
read -r -a p <<<"$ports"
mkdir -p "$work/weed" "$work/mnt" "$work/mnt2"
S3_BUCKET=bench "$WEED" mini -dir="$work/weed" -ip=127.0.0.1 -ip.bind=127.0.0.1 \
    -s3.port="${p[0]}" -s3.port.iceberg=0 -s3.port.lance=0 -admin.ui=false -master.telemetry=false \
    -filer.localSocket="$work/filer.sock" -s3.localSocket="$work/s3.sock" \
    -master.port="${p[1]}" -master.port.grpc="${p[2]}" -volume.port="${p[3]}" \
    -volume.port.grpc="${p[4]}" -filer.port="${p[5]}" -filer.port.grpc="${p[6]}" \
    -s3.port.grpc="${p[7]}" -webdav.port="${p[8]}" -admin.port="${p[9]}" \
    -admin.port.grpc="${p[10]}" </dev/null >"$work/weed.log" 2>&1 &
echo $! > "$work/weed.pid"
ep=http://127.0.0.1:${p[0]}
for _ in $(seq 120); do "$T" s3://bench/probe "$ep" 1 1 >/dev/null 2>&1 && break; sleep 0.5; done
ceiling=$("$T" s3://bench/ceiling "$ep" 64 16)
echo "endpoint, same client: $ceiling" >&2
head -c $((SIZE_MIB << 20)) /dev/urandom > "$work/big"
"$O" store init "$work/cache" --remote s3://bench/store --endpoint "$ep" >/dev/null
"$O" mount "$work/cache" "$work/mnt"
sync; echo 3 > /proc/sys/vm/drop_caches
t0=$(date +%s.%N)
dd if="$work/big" of="$work/mnt/big" bs=16M status=none
fusermount3 -u "$work/mnt"
while pgrep -f "mount $work/cache $work/mnt" >/dev/null; do sleep 0.1; done
t1=$(date +%s.%N)
"$O" store init "$work/cache2" --recover --remote s3://bench/store --endpoint "$ep" >/dev/null
"$O" mount "$work/cache2" "$work/mnt2"
sync; echo 3 > /proc/sys/vm/drop_caches
t2=$(date +%s.%N)
cat "$work/mnt2/big" > /dev/null
t3=$(date +%s.%N)
cmp "$work/mnt2/big" "$work/big"
fusermount3 -u "$work/mnt2"
python3 - "$SIZE_MIB" "$t0" "$t1" "$t2" "$t3" "$ceiling" <<'EOF'
import re, sys
mib, t0, t1, t2, t3 = float(sys.argv[1]), *map(float, sys.argv[2:6])
put, get = map(float, re.findall(r"([0-9.]+) MiB/s", sys.argv[6]))
w, r = mib / (t1 - t0), mib / (t3 - t2)
print(f"| what | MiB/s | endpoint ceiling MiB/s | ratio |\n|---|---:|---:|---:|")
print(f"| sequential write of {mib:.0f} MiB through the mount, until in the bucket | {w:.0f} | {put:.0f} (PUT) | {w/put:.2f} |")
print(f"| cold read from an empty cache | {r:.0f} | {get:.0f} (ranged GET) | {r/get:.2f} |")
EOF
