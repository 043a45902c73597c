#!/usr/bin/env bash
# The store's scale cases at full size (issue 11, hostile input). Usage
# (root, /dev/fuse):
#   bench/store-scale.sh [ENTRIES] [DEPTH]     (defaults 1000000 and 10000)
# Runs crates/cli/tests/store_scale.rs in release: a directory of ENTRIES
# files through a real mount (create, readdir count and names, lookups of
# present and absent names, 1% renames and 1% unlinks, remount, fsck, the
# same checks cold) and a DEPTH-level tree built and removed with *at
# calls. Prints each phase's time and the mount's peak RSS (CI runs
# 100,000 entries and 10,000 levels in debug).
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target}
ONECOPY_SCALE_ENTRIES=${1:-1000000} ONECOPY_SCALE_DEPTH=${2:-10000} \
    cargo test -q --release -p onecopy --test store_scale -- --nocapture --test-threads=1
