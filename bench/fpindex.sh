#!/usr/bin/env bash
# Benchmarks of the fingerprint index (crates/fpindex), figures quoted in
# ARCHITECTURE.md ("Fingerprint index"). Not a test: prints measurements.
#
#   bench/fpindex.sh filters [N]        filter candidates: bits/entry, FPR, ns/lookup
#   bench/fpindex.sh scale [N]          build N entries (default 100 M), then peak RSS
#                                       of a process that opens and queries them,
#                                       as built and after compact()
#   bench/fpindex.sh trace [V] [M]      the seed's experiment: V versions x M fingerprints
#                                       (default 10 x 2 M = 20 M) on tmpfs, this disk
#                                       with O_DIRECT, and a simulated 10 ms device
#
# Work files go to $FPBENCH_DIR (default /var/tmp/fpbench) and /dev/shm.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target}
cargo build -q --release -p onecopy-fpindex --examples
B=$CARGO_TARGET_DIR/release/examples
DIR=${FPBENCH_DIR:-/var/tmp/fpbench}
mkdir -p "$DIR"
peak() { # command... : runs it, prints its output and its peak RSS
    /usr/bin/time -f 'peak RSS %M KiB, wall %e s, user %U s' "$@"
}
case "${1:-}" in
filters)
    "$B/filters" "${2:-20000000}"
    ;;
scale)
    n=${2:-100000000}
    rm -rf "$DIR/scale"
    peak "$B/fpbench" build "$DIR/scale" "$n"
    # As built (several runs), then merged into one run.
    for step in built compact; do
        [ "$step" = compact ] && peak "$B/fpbench" compact "$DIR/scale"
        sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null || true
        peak "$B/fpbench" rss "$DIR/scale" "$n"
        peak "$B/fpbench" query "$DIR/scale" "$n"
        peak "$B/fpbench" negbatch "$DIR/scale" 20000000
    done
    du -sh "$DIR/scale"
    rm -rf "$DIR/scale"
    ;;
trace)
    v=${2:-10}; m=${3:-2000000}
    modes="eager lazy:4 lazy:32 lazy:64 lazy:512 lazy:2048 auto"
    "$B/fpbench" trace /dev/shm/fpbench-trace tmpfs "$v" "$m" $modes
    rm -rf /dev/shm/fpbench-trace
    "$B/fpbench" trace "$DIR/trace" disk "$v" "$m" $modes
    "$B/fpbench" trace "$DIR/trace" slow "$v" "$m" $modes
    rm -rf "$DIR/trace"
    ;;
*)
    sed -n '2,12p' "$0"
    exit 2
    ;;
esac
