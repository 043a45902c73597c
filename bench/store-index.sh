#!/usr/bin/env bash
# The store's fingerprint index: mount CPU and peak RSS, and recovery after
# kill -9. Usage (as root):
#   bench/store-index.sh cpu [SIZE] [CHUNKING]   fio 1st + 2nd write through a mount:
#                                                MB/s, CPU s of the mount, VmHWM
#   bench/store-index.sh kill [SECONDS]          kill -9 of the mount SECONDS into a
#                                                1 GiB 4 KiB-chunk write; remount time, fsck
# ONECOPY=path runs another build (compare before/after alternately).
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target}
if [[ -z ${ONECOPY:-} ]]; then cargo build -q --release -p onecopy; fi
O=${ONECOPY:-$CARGO_TARGET_DIR/release/onecopy}
work=$(mktemp -d /var/tmp/onecopy-storeindex.XXXXXX)
cleanup() { fusermount3 -u "$work/mnt" 2>/dev/null || true; sleep 0.5; rm -rf "$work"; }
trap cleanup EXIT
mkdir -p "$work/mnt"
fio_w() { # NAME SIZE -> MB/s
    fio --name=s --filename="$work/mnt/$1" --size="$2" --rw=write --bs=1M --ioengine=psync \
        --refill_buffers --randseed=42 --end_fsync=1 --output-format=json |
        python3 -c "import json,sys; print(round(json.load(sys.stdin)['jobs'][0]['write']['bw_bytes']/1e6))"
}
wait_gone() { while kill -0 "$1" 2>/dev/null; do sleep 0.2; done; }
case ${1:-cpu} in
cpu)
    SIZE=${2:-2G}; CH=${3:-fixed:64K}
    $O store init "$work/s" --chunking "$CH" >/dev/null
    $O mount "$work/s" "$work/mnt"; pid=$(cat "$work/s/mount.pid")
    cpu() { awk '{printf "%.2f", ($14+$15)/100}' "/proc/$pid/stat"; }
    c0=$(cpu); w1=$(fio_w a "$SIZE"); c1=$(cpu); w2=$(fio_w b "$SIZE"); c2=$(cpu)
    hwm=$(awk '/VmHWM/ {print int($2/1024)}' "/proc/$pid/status")
    fusermount3 -u "$work/mnt"; wait_gone "$pid"
    python3 -c "import sys; c0,c1,c2=map(float,sys.argv[1:4]); print(f'1st {sys.argv[4]} MB/s {c1-c0:.2f} CPU s; 2nd {sys.argv[5]} MB/s {c2-c1:.2f} CPU s; VmHWM {sys.argv[6]} MiB; load {sys.argv[7]}')" \
        "$c0" "$c1" "$c2" "$w1" "$w2" "$hwm" "$(cut -d' ' -f1 /proc/loadavg)"
    $O store stats "$work/s" | grep -E '^chunks|index'
    du -sh "$work/s/index" "$work/s/meta.sqlite"
    ;;
kill)
    $O store init "$work/s" --chunking fixed:4K >/dev/null
    $O mount "$work/s" "$work/mnt"; pid=$(cat "$work/s/mount.pid")
    fio_w a 1G >/dev/null 2>&1 & fpid=$!
    sleep "${2:-6}"; kill -9 "$pid"; wait "$fpid" 2>/dev/null || true
    fusermount3 -u "$work/mnt" 2>/dev/null || umount -l "$work/mnt" 2>/dev/null || true
    sleep 1
    t0=$(date +%s.%N); $O mount "$work/s" "$work/mnt"; t1=$(date +%s.%N)
    pid=$(cat "$work/s/mount.pid"); fusermount3 -u "$work/mnt"; wait_gone "$pid"
    t2=$(date +%s.%N); out=$($O store fsck "$work/s" | tail -1); t3=$(date +%s.%N)
    python3 -c "import sys; a,b,c,d=map(float,sys.argv[1:5]); print(f'remount after kill {b-a:.2f} s; fsck {d-c:.2f} s: {sys.argv[5]}')" \
        "$t0" "$t1" "$t2" "$t3" "$out"
    $O store stats "$work/s" | grep -E '^chunks|index entries'
    ;;
*) echo "usage: $0 cpu [SIZE] [CHUNKING] | kill [SECONDS]" >&2; exit 2 ;;
esac
