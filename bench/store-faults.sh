#!/usr/bin/env bash
# The store fault suite's long runs (issue 11): many more kill -9 points
# and power cuts than CI runs. Usage (root, /dev/fuse):
#   bench/store-faults.sh [KILLS] [REPEATS]
# KILLS (default 500) kill -9 points of the mixed workload per repeat,
# split between fixed and CDC chunking (tests/store_faults.rs
# kill_9_at_random_points_of_a_mixed_workload); each repeat also runs the
# power-loss tests of crates/store/tests/power_loss.rs (100 cuts) and the
# other fault cases. Every seed is printed (ONECOPY_FAULT_SEED replays one).
set -euo pipefail
cd "$(dirname "$0")/.."
KILLS=${1:-500}
REPEATS=${2:-1}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target}
log=$(mktemp /var/tmp/onecopy-store-faults.XXXXXX.log)
echo "log: $log"
for r in $(seq 1 "$REPEATS"); do
    start=$(date +%s)
    ONECOPY_FAULT_KILLS=$KILLS cargo test -q --release -p onecopy --test store_faults \
        -- --nocapture --test-threads=1 2>&1 | tee -a "$log" | grep -E "SEED|kills|test result|panicked" || true
    cargo test -q --release -p onecopy-store --test power_loss -- --nocapture 2>&1 \
        | tee -a "$log" | grep -E "SEED|test result|panicked" || true
    echo "repeat $r: $KILLS kills in $(( $(date +%s) - start )) s"
done
! grep -q "panicked\|FAILED" "$log"
