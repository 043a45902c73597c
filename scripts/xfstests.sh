#!/usr/bin/env bash
# xfstests (the Linux filesystem test suite) against the onecopy store
# through FUSE: the generic/quick group, as FSTYP=fuse FUSE_SUBTYP=.onecopy.
#
#   scripts/xfstests.sh [ONECOPY_BINARY] [TEST...]
#
# ONECOPY_BINARY defaults to target/release/onecopy, else target/debug/onecopy.
# TEST... (e.g. generic/013 generic/124) runs only those tests instead of
# the group, to re-run failures.
#
# Run as root. It installs the packages it needs if missing, creates the
# users xfstests switches to (fsgqa, fsgqa2, 123456-fsgqa), unpacks and
# builds xfstests once into a cache (/var/tmp/onecopy-xfstests/<tarball
# digest>/, reused while the tarball is the same), points
# /sbin/mount.fuse.onecopy and /sbin/mount.onecopy at the binary (mount(8)
# runs them for `mount -t fuse.onecopy`; the previous links are put back
# at exit), creates two stores (TEST_DEV, SCRATCH_DEV) and their mount
# points in a private directory /var/tmp/onecopy-xfstests-run.XXXXXX, and
# runs ./check with the exclusions of scripts/xfstests-exclude.txt (plus
# the tests this machine can not run, listed in the output).
# At exit it unmounts, removes the stores and keeps the results
# (results/, check.out, the mount logs) in that directory.
#
# Prints "xfstests generic/quick: N passed, N failed, N not run (N excluded)",
# the failed tests with their result files and the count of mounts refused
# with "store in use"; exits 1 when a test failed, none ran or the run
# timed out, 2 on a set-up error.
#
# Expected runtime on 2 cores: building xfstests ~1-3 min (first run only),
# the generic/quick group ~15-25 min. The whole run is bounded by
# XFSTESTS_TIMEOUT (default 40m), so a hung test can not hang the script.
#
# Environment: XFSTESTS_TARBALL (default
# ../shared/xfstests/xfstests-63a29724.tar.gz beside the checkout, a `git archive` of
# kdave/xfstests unpacking to xfstests/), XFSTESTS_CACHE, XFSTESTS_TIMEOUT.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
ME=scripts/xfstests.sh

die() { echo "$ME: $*" >&2; exit 2; }
[ "$(id -u)" = 0 ] || die "xfstests mounts and switches users; run as root"

ONECOPY=${1:-}
[ $# -gt 0 ] && shift
if [ -z "$ONECOPY" ]; then
    for b in target/release/onecopy target/debug/onecopy; do
        [ -x "$ROOT/$b" ] && { ONECOPY=$ROOT/$b; break; }
    done
fi
[ -n "$ONECOPY" ] && [ -x "$ONECOPY" ] || die "no onecopy binary (build it or pass its path)"
ONECOPY=$(realpath "$ONECOPY")
TESTS=("$@")

TARBALL=${XFSTESTS_TARBALL:-$ROOT/../shared/xfstests/xfstests-63a29724.tar.gz}
CACHE=${XFSTESTS_CACHE:-/var/tmp/onecopy-xfstests}
TIMEOUT=${XFSTESTS_TIMEOUT:-40m}
EXCLUDE=$ROOT/scripts/xfstests-exclude.txt
[ -f "$TARBALL" ] || die "$TARBALL: no xfstests tarball (set XFSTESTS_TARBALL)"

# --- packages: to build xfstests, and what ./check needs at run time ---
need=()
for p in autoconf automake libtool make gcc xfslibs-dev uuid-dev libattr1-dev \
         libacl1-dev libaio-dev liburing-dev libgdbm-dev acl attr gawk \
         xfsprogs bc psmisc fio fuse3; do
    dpkg-query -W -f '${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || need+=("$p")
done
if [ ${#need[@]} -gt 0 ]; then
    echo "$ME: installing ${need[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq "${need[@]}" >/dev/null
fi

# --- the users and groups xfstests' tests switch to ---
getent group fsgqa >/dev/null || groupadd fsgqa
id fsgqa >/dev/null 2>&1 || useradd -m -g fsgqa fsgqa
id fsgqa2 >/dev/null 2>&1 || useradd -m fsgqa2
id 123456-fsgqa >/dev/null 2>&1 || useradd 123456-fsgqa

# --- xfstests, built once per tarball ---
key=$(sha256sum "$TARBALL" | cut -c1-12)
XFS=$CACHE/$key/xfstests
mkdir -p "$CACHE"
build_start=$SECONDS
(
    flock 9
    if [ ! -f "$CACHE/$key/.built" ]; then
        echo "$ME: building xfstests in $CACHE/$key (log: $CACHE/$key/build.log)" >&2
        rm -rf "${CACHE:?}/$key"
        mkdir -p "$CACHE/$key"
        tar -xzf "$TARBALL" -C "$CACHE/$key"
        [ -x "$XFS/check" ] || die "$TARBALL does not unpack to xfstests/"
        if ! make -C "$XFS" -j"$(nproc)" >"$CACHE/$key/build.log" 2>&1; then
            tail -20 "$CACHE/$key/build.log" >&2
            die "building xfstests failed (see $CACHE/$key/build.log)"
        fi
        touch "$CACHE/$key/.built"
    fi
    # xfstests takes a FUSE mount's type to be "fuse" (FSTYP), but a mount
    # with a subtype shows as "fuse.SUBTYPE" in /proc/mounts (onecopy's as
    # fuse.onecopy): map it to "fuse" in _fs_type, as common/rc already
    # does for fuse.glusterfs and fuse.ceph-fuse.
    if ! grep -qF "s/^fuse[.].*/fuse/" "$XFS/common/rc"; then
        sed -i "s|-e 's/fuse.ceph-fuse/ceph-fuse/'|& -e 's/^fuse[.].*/fuse/'|" "$XFS/common/rc"
        grep -qF "s/^fuse[.].*/fuse/" "$XFS/common/rc" || die "could not patch common/rc (_fs_type)"
    fi
) 9>"$CACHE/.lock"
echo "$ME: xfstests ready in $((SECONDS - build_start)) s ($XFS)"

# --- the stores, their mount points and the mount helpers ---
WORK=$(mktemp -d /var/tmp/onecopy-xfstests-run.XXXXXX)
chmod 755 "$WORK"   # the fsgqa users must reach the mount points
HELPERS=(/sbin/mount.fuse.onecopy /sbin/mount.onecopy)
declare -A OLD_LINK=()

unmount() {   # unmount a mount point, aborting its FUSE connection if it hangs
    local mnt=$1 dev
    findmnt -rn --mountpoint "$mnt" >/dev/null || return 0
    timeout 60 umount "$mnt" 2>/dev/null && return 0
    dev=$(findmnt -rn -o MAJ:MIN --mountpoint "$mnt" | head -1)
    [ -n "$dev" ] && echo 1 >"/sys/fs/fuse/connections/${dev#*:}/abort" 2>/dev/null
    umount -l "$mnt" 2>/dev/null || true
}

cleanup() {
    local rc=$? s pid
    cd /
    for s in test scratch; do
        unmount "$WORK/$s"
        # The daemon exits once unmounted; give it the time to close its store.
        # Only a process serving this very store is ever signalled.
        pid=$(cat "$WORK/$s-store/mount.pid" 2>/dev/null || true)
        if [ -n "$pid" ]; then
            for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
            if tr '\0' ' ' 2>/dev/null <"/proc/$pid/cmdline" | grep -qF "$WORK/$s-store"; then
                kill -9 "$pid" 2>/dev/null || true
            fi
        fi
        cp "$WORK/$s-store/mount.log" "$WORK/$s-mount.log" 2>/dev/null || true
        rm -rf "${WORK:?}/$s-store" "${WORK:?}/$s"
    done
    for h in "${HELPERS[@]}"; do
        rm -f "$h"
        [ -n "${OLD_LINK[$h]:-}" ] && ln -s "${OLD_LINK[$h]}" "$h"
    done
    echo "$ME: results kept in $WORK"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

for h in "${HELPERS[@]}"; do
    OLD_LINK[$h]=$(readlink "$h" 2>/dev/null || true)
    [ -e "$h" ] && [ ! -L "$h" ] && die "$h exists and is not a symlink; not replacing it"
    ln -sfn "$ONECOPY" "$h"
done
for s in test scratch; do
    "$ONECOPY" store init "$WORK/$s-store" >/dev/null
    mkdir "$WORK/$s"
done

# TEST_DEV and SCRATCH_DEV are written as the mount shows its source in
# /proc/mounts (onecopy:STORE; the helper accepts that form): xfstests
# finds its mounts with `findmnt -S DEV` and unmounts with `umount DEV`.
# For FSTYP=fuse its "mkfs" of the scratch device mounts it, empties it
# and unmounts it; nothing else is device-specific. No mount options are
# needed: the helper mounts dev,suid (as mount(8) expects by default) and
# allow_other,default_permissions (always).
cat >"$WORK/local.config" <<EOF
export FSTYP=fuse
export FUSE_SUBTYP=.onecopy
export TEST_DEV=onecopy:$WORK/test-store
export TEST_DIR=$WORK/test
export SCRATCH_DEV=onecopy:$WORK/scratch-store
export SCRATCH_MNT=$WORK/scratch
export RESULT_BASE=$WORK/results
EOF
# XFSTESTS_MOUNT_OPTS (e.g. transport=uring): options of every mount.
if [ -n "${XFSTESTS_MOUNT_OPTS:-}" ]; then
    cat >>"$WORK/local.config" <<EOF
export TEST_FS_MOUNT_OPTS="-o $XFSTESTS_MOUNT_OPTS"
export MOUNT_OPTIONS="-o $XFSTESTS_MOUNT_OPTS"
EOF
fi

# The exclusions: the documented ones, plus those this machine can not run.
cp "$EXCLUDE" "$WORK/exclude.txt"
cap_eff=$((0x$(sed -n 's/^CapEff:[[:space:]]*//p' /proc/self/status)))
if (( (cap_eff >> 24 & 1) == 0 )); then
    # No CAP_SYS_RESOURCE (24), as in some containers: these tests'
    # cleanup `ulimit -f unlimited` after `ulimit -f N` fails.
    for t in generic/394 generic/564; do
        echo "$t  # this machine: root without CAP_SYS_RESOURCE can not raise ulimit -f back" \
            >>"$WORK/exclude.txt"
    done
fi

# --- the run ---
if [ ${#TESTS[@]} -gt 0 ]; then
    what=("${TESTS[@]}")
else
    what=(-g generic/quick)
fi
echo "$ME: ./check ${what[*]} on $ONECOPY (timeout $TIMEOUT, output: $WORK/check.out)"
run_start=$SECONDS
set +e
(cd "$XFS" && HOST_OPTIONS=$WORK/local.config \
    timeout -k 60 "$TIMEOUT" ./check -E "$WORK/exclude.txt" "${what[@]}") 2>&1 | tee "$WORK/check.out"
check_rc=${PIPESTATUS[0]}
set -e
run_secs=$((SECONDS - run_start))

# --- the summary ---
words() { sed -n "s/^$1 *//p" "$WORK/check.out" | tail -1 | wc -w; }
ran=$(words 'Ran:')
notrun=$(words 'Not run:')
failed=$(words 'Failures:')
passed=$((ran - notrun - failed))
in_use=$(cat "$WORK"/*-store/mount.log 2>/dev/null | grep -c 'store is in use' || true)
echo
echo "$ME: ran in $((run_secs / 60)) min $((run_secs % 60)) s; mounts refused with" \
     "\"store in use\": $in_use"
if [ "$failed" -gt 0 ]; then
    for t in $(sed -n 's/^Failures: *//p' "$WORK/check.out" | tail -1); do
        echo "  failed: $t ($WORK/results/$t.out.bad, .full)"
    done
fi
if ! grep -q '^Ran:' "$WORK/check.out"; then
    echo "$ME: ./check stopped before running any test (exit $check_rc):"
    grep -E '^(check|common/rc|our local)|failed|not found' "$WORK/check.out" | tail -5 | sed 's/^/  /'
fi
timed_out=false
if [ "$check_rc" = 124 ] || [ "$check_rc" = 137 ]; then
    timed_out=true
    echo "$ME: TIMED OUT after $TIMEOUT; the test running then:" \
         "$(grep -oE '^generic/[0-9]+' "$WORK/check.out" | tail -1)"
fi
label=generic/quick
[ ${#TESTS[@]} -gt 0 ] && label="${TESTS[*]}"
expunged=$(grep -oE '^generic/[0-9]+ +\[expunged\]' "$WORK/check.out" | cut -d' ' -f1 || true)
excluded=$(echo "$expunged" | grep -c . || true)
for t in $expunged; do
    echo "  excluded: $(grep -m1 -E "^$t([^0-9]|$)" "$WORK/exclude.txt")"
done
echo "xfstests $label: $passed passed, $failed failed, $notrun not run ($excluded excluded)"
if [ "$failed" -gt 0 ] || $timed_out || [ "$ran" = 0 ]; then
    exit 1
fi
