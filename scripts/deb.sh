#!/usr/bin/env bash
# Builds the onecopy .deb with cargo-deb, installs it with dpkg -i and checks
# the installed package: `onecopy --version`, man pages, completions, units,
# and a real dedupe on a loop btrfs. Removes the package afterwards.
#
# The package is built from the binary the test suite already built
# (target/debug, `--no-build`), so CI pays no release build; set
# DEB_PROFILE=release for a package to ship (`cargo build --release` first).
set -euo pipefail
cd "$(dirname "$0")/.."

profile=${DEB_PROFILE:-dev}
target=${CARGO_TARGET_DIR:-target}
case $profile in dev) outdir=$target/debug ;; *) outdir=$target/$profile ;; esac

if ! command -v cargo-deb >/dev/null 2>&1; then
    echo "scripts/deb.sh: installing cargo-deb" >&2
    cargo install cargo-deb --locked --quiet
fi
if [ ! -x "$outdir/onecopy" ]; then
    if [ "$profile" = dev ]; then
        cargo test -p onecopy --locked --no-run --quiet
    else
        cargo build -p onecopy --profile "$profile" --locked --quiet
    fi
fi

gen=$outdir/onecopy-generated
rm -rf "$gen"
"$outdir/onecopy" generate man "$gen/man"
"$outdir/onecopy" generate completions "$gen/completions"
deb=$(cargo deb -p onecopy --no-build --profile "$profile" --quiet)
echo "scripts/deb.sh: built $deb ($(du -h "$deb" | cut -f1))" >&2

scratch=$(mktemp -d /var/tmp/onecopy-deb.XXXXXX)
loopdev=""
cleanup() {
    mountpoint -q "$scratch/mnt" && umount "$scratch/mnt"
    [ -n "$loopdev" ] && losetup -d "$loopdev"
    rm -rf "$scratch"
    dpkg -r onecopy >/dev/null 2>&1 || true
}
trap cleanup EXIT

dpkg -i "$deb" >/dev/null
test "$(command -v onecopy)" = /usr/bin/onecopy
test "$(readlink -f /sbin/mount.onecopy)" = /usr/bin/onecopy || {
    echo "scripts/deb.sh: /sbin/mount.onecopy is not the onecopy binary" >&2
    exit 1
}
onecopy --version
for f in /usr/share/man/man1/onecopy-dedupe.1* /usr/share/bash-completion/completions/onecopy \
         /usr/share/zsh/vendor-completions/_onecopy /usr/share/fish/vendor_completions.d/onecopy.fish \
         /lib/systemd/system/onecopy-dedupe@.service /lib/systemd/system/onecopy-dedupe@.timer \
         /lib/systemd/system/onecopy-store@.service /lib/systemd/system/onecopy-watch@.service; do
    test -e "$f" || { echo "scripts/deb.sh: the package lacks $f" >&2; exit 1; }
done

# A dedupe with the installed binary on a fresh loop btrfs.
truncate -s 512M "$scratch/fs.img"
mkfs.btrfs -q "$scratch/fs.img" >/dev/null 2>&1
loopdev=$(losetup --find --show "$scratch/fs.img")
mkdir "$scratch/mnt"
mount "$loopdev" "$scratch/mnt"
head -c 16M /dev/urandom > "$scratch/mnt/a"
cp --reflink=never "$scratch/mnt/a" "$scratch/mnt/b"
sync
ONECOPY_CACHE_DIR=$scratch/cache onecopy dedupe --json "$scratch/mnt" > "$scratch/report.json"
cmp "$scratch/mnt/a" "$scratch/mnt/b"
grep -Eq '"bytes_deduped": *16777216[,}]?' "$scratch/report.json" || {
    echo "scripts/deb.sh: the installed onecopy did not share the copy:" >&2
    cat "$scratch/report.json" >&2
    exit 1
}
echo "scripts/deb.sh: installed package deduped 16 MiB on a loop btrfs" >&2
