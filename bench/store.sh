#!/usr/bin/env bash
# The inline store against the disk it sits on, a null FUSE filesystem on
# the same crate (the ceiling), restic and borg. Usage:
#   bench/store.sh (as root) [SIZE]        (fio data size, default 2G)
# Rows: fio sequential 1 MiB 1st write (unique, incompressible), 2nd write
# (the same bytes again), cold read; cp -a of ~100k small files; ingest of
# successive versions of a tree (cp -a into the mount, and `store import`)
# vs restic and borg; a real tree (REAL_TREE) copied into the mount with
# cp -a and rsync -a vs restic's backup of it; fio 4 KiB sync write
# p99.9 latency idle vs during gc (gc runs while mounted only if the mount
# supports it, else the row says so).
#
# HALT_POLL_NS=N sets the guest's halt polling for the run (bench/haltpoll.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/haltpoll.sh
SIZE=${1:-2G}
# Sections to run (default all): fio small tree restic versions gc
SECTIONS=${SECTIONS:-fio small tree restic versions gc}
want() { [[ " $SECTIONS " == *" $1 "* ]]; }
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target}
cargo build -q --release -p onecopy -p onecopy-workload
cargo build -q --release -p onecopy-fuse --example nullfs
# ONECOPY=path runs another build of onecopy (e.g. to compare before/after).
O=${ONECOPY:-$CARGO_TARGET_DIR/release/onecopy}
W=$CARGO_TARGET_DIR/release/onecopy-workload
N=$CARGO_TARGET_DIR/release/examples/nullfs
# The null filesystem over io_uring (its own Cargo project) and the
# transport itself, on for the run (put back by cleanup).
cargo build -q --release --manifest-path bench/ffuse-null/Cargo.toml
NU=$CARGO_TARGET_DIR/release/ffuse-null
uring_was=$(cat /sys/module/fuse/parameters/enable_uring)
echo Y > /sys/module/fuse/parameters/enable_uring
for t in fio restic borg rsync; do command -v $t >/dev/null || { apt-get install -y -qq fio restic borgbackup rsync >/dev/null; break; }; done
work=$(mktemp -d /var/tmp/onecopy-storebench.XXXXXX)
cleanup() {
    haltpoll_restore
    echo "$uring_was" > /sys/module/fuse/parameters/enable_uring
    for m in "$work"/mnt "$work"/null; do fusermount3 -u "$m" 2>/dev/null || true; done
    sleep 1; rm -rf "$work"
}
trap cleanup EXIT
mkdir -p "$work"/{mnt,null,native}
drop() { sync; echo 3 > /proc/sys/vm/drop_caches; }
mbps() { python3 -c "import json,sys; d=json.load(open(sys.argv[1])); j=d['jobs'][0]; k=sys.argv[2]; print(f\"{j[k]['bw_bytes']/1e6:.0f}\")" "$@"; }
# Every write starts from a dropped page cache, like every read: on this VM
# a write that needs fresh page-cache memory while 2 GiB of another file
# stay cached ran 3x slower in the kernel's copy into the page cache
# (copy_folio_from_iter_atomic: store 2nd write 300 MB/s, 910-930 after a
# drop), which measured the machine's memory, not the filesystem.
fio_seq() { # DIR RW OUT [FILE]
    drop
    fio --name=s --filename="$1/${4:-f}" --size="$SIZE" --rw="$2" --bs=1M --ioengine=psync \
        --refill_buffers --randseed=42 --end_fsync=1 --output-format=json > "$3"
}
# STORE_INIT_ARGS: extra `store init` options (e.g. --index-memtable 256).
# STORE_MOUNT_OPTS: the mount's -o options (e.g. transport=uring).
mount_store() {
    $O store init "$work/s" ${STORE_INIT_ARGS:-} "$@" >/dev/null
    $O mount "$work/s" "$work/mnt" ${STORE_MOUNT_OPTS:+-o "$STORE_MOUNT_OPTS"}
}
# The null filesystem over io_uring on $work/null, in the background
# ($! is its pid), the same way in every section.
null_uring() { $NU "$work/null" 2 32 & }
umount_store() { fusermount3 -u "$work/mnt"; while pgrep -f "mount $work/s" >/dev/null; do sleep 0.2; done; }
# The store's mount process; a process's CPU seconds (utime + stime).
store_pid() { pgrep -f "mount $work/s "; }
cpu_s() { awk '{print ($14 + $15) / 100}' "/proc/$1/stat"; }

if want fio; then
echo "## fio sequential 1 MiB, $SIZE, incompressible (MB/s)"
# Columns: the disk; the null filesystem over /dev/fuse (fuser) and over
# io_uring (bench/ffuse-null); the store over each transport (1st write,
# 2nd write of the same bytes to another file, remount, cold read).
fio_seq "$work/native" write "$work/n1.json"; drop
fio --name=s --filename="$work/native/f" --size="$SIZE" --rw=read --bs=1M --ioengine=psync --output-format=json > "$work/nr.json"
for t in dev uring; do
    case $t in dev) $N "$work/null" & ;; uring) null_uring ;; esac
    sleep 1
    fio_seq "$work/null" write "$work/null1-$t.json"
    drop; fio --name=s --filename="$work/null/f" --size="$SIZE" --rw=read --bs=1M --ioengine=psync --output-format=json > "$work/nullr-$t.json"
    fusermount3 -u "$work/null"; wait || true
    STORE_MOUNT_OPTS=transport=$t mount_store
    fio_seq "$work/mnt" write "$work/s1-$t.json"
    fio_seq "$work/mnt" write "$work/s2-$t.json" g
    umount_store; drop; $O mount "$work/s" "$work/mnt" -o transport=$t
    fio --name=s --filename="$work/mnt/f" --size="$SIZE" --rw=read --bs=1M --ioengine=psync --output-format=json > "$work/sr-$t.json"
    $O store stats "$work/s" | grep -E 'dedupe|written'
    umount_store; rm -rf "$work/s"
done
# The disk is measured again after the store: a virtual disk's speed
# drifts (this VM's wrote 2 GiB at 400-1,300 MB/s minutes apart), and a
# native figure taken only before the store would credit or blame the
# store for the drift. The ratio is to the mean of the two.
rm -f "$work/native/f"
fio_seq "$work/native" write "$work/n1b.json"; drop
fio --name=s --filename="$work/native/f" --size="$SIZE" --rw=read --bs=1M --ioengine=psync --output-format=json > "$work/nrb.json"
pct() { python3 -c "import sys; a,b,s=map(float,sys.argv[1:]); print(f'{100*s/((a+b)/2):.0f}%')" "$@"; }
n1=$(mbps "$work/n1.json" write); n1b=$(mbps "$work/n1b.json" write)
nr=$(mbps "$work/nr.json" read); nrb=$(mbps "$work/nrb.json" read)
row() { # NAME KIND NULL-FILE STORE-FILE NATIVE-A NATIVE-B
    local d u; d=$(mbps "$work/$4-dev.json" "$2"); u=$(mbps "$work/$4-uring.json" "$2")
    echo "| $1 | ${5:--}${6:+ / $6} | $(mbps "$work/$3-dev.json" "$2") / $(mbps "$work/$3-uring.json" "$2") | $d | $u | ${5:+$(pct "$5" "$6" "$d") / $(pct "$5" "$6" "$u")} |"
}
echo "| | native (before / after the stores) | null FUSE (/dev/fuse / io_uring) | store, /dev/fuse | store, io_uring | store / native mean (/dev/fuse / io_uring) |"
echo "|---|---:|---:|---:|---:|---:|"
row "1st write" write null1 s1 "$n1" "$n1b"
row "2nd write (duplicate)" write null1 s2
row "cold read" read nullr sr "$nr" "$nrb"
rm -f "$work/native/f"
fi

# cp -a of TREE into each configuration, cache dropped before each copy,
# ending with a sync of the target; configurations rotate over ROUNDS
# rounds (default 2). native: the disk; null / null-uring: a filesystem
# keeping names and attributes only, over /dev/fuse (fuser, one reading
# thread, which beats two for many small files: bench/notes/store-transport.md)
# and over io_uring (bench/ffuse-null); store / store-uring: the store over
# each transport. Mount CPU (utime + stime) is per file copied.
copies() { # TREE
    local tree=$1 nfiles; nfiles=$(find "$tree" -type f | wc -l)
    : > "$work/copy-times"
    for r in $(seq 1 "${ROUNDS:-2}"); do
        for c in native null null-uring store store-uring; do
            local dst pid= t0 t1 cpu=0
            case $c in
                native) dst=$work/native/t ;;
                null) $N "$work/null" 1 & pid=$!; sleep 1; dst=$work/null/t ;;
                null-uring) null_uring; pid=$!; sleep 1; dst=$work/null/t ;;
                store) STORE_MOUNT_OPTS=transport=dev mount_store; pid=$(store_pid); dst=$work/mnt/t ;;
                store-uring) STORE_MOUNT_OPTS=transport=uring mount_store; pid=$(store_pid); dst=$work/mnt/t ;;
            esac
            drop; t0=$(date +%s.%N); cp -a "$tree" "$dst"; sync -f "$(dirname "$dst")"; t1=$(date +%s.%N)
            [[ -n $pid ]] && cpu=$(cpu_s "$pid")
            case $c in
                native) rm -rf "$dst" ;;
                null*) fusermount3 -u "$work/null"; wait "$pid" || true ;;
                store*) $O store stats "$work/s" | grep -E 'stored|ratio' | tr '\n' ' ' > "$work/copy-stats"; umount_store; rm -rf "$work/s" ;;
            esac
            echo "$c $t0 $t1 $cpu" >> "$work/copy-times"
        done
    done
    python3 - "$work/copy-times" "$nfiles" <<'PY'
import sys, statistics
t, cpu = {}, {}
for line in open(sys.argv[1]):
    k, a, b, c = line.split()
    t.setdefault(k, []).append(float(b) - float(a)); cpu.setdefault(k, []).append(float(c))
n, files = statistics.median(t["native"]), int(sys.argv[2])
ceiling = min(statistics.median(t["null"]), statistics.median(t["null-uring"]))
print(f"{files} files; medians of {len(t['native'])} rounds; ratios of medians")
print("| | rounds (s) | median | x native | x fastest null | mount CPU per file |")
print("|---|---|---:|---:|---:|---:|")
for k in t:
    m = statistics.median(t[k])
    c = f"{statistics.median(cpu[k]) / files * 1e6:.0f} us" if k != "native" else "-"
    print(f"| {k} | {' / '.join(f'{x:.1f}' for x in t[k])} | {m:.1f} | {m / n:.2f} | {m / ceiling:.2f} | {c} |")
PY
    echo "  store: $(cat "$work/copy-stats")"
}

if want small; then
echo "## cp -a of small files (s)"
$W small --dir "$work/tree" --files 100000 >/dev/null 2>&1 || $W small --dir "$work/tree" >/dev/null
copies "$work/tree"
rm -rf "$work/tree"
fi

if want tree; then
echo "## cp -a of a real tree (s)"
# The Linux 6.1 source as Debian ships it (package linux-source-6.1: about
# 78,600 files, 1.2 GB, from a few bytes to a few MB): a real tree of the
# size the goal names, where the synthetic `small` tree is its worst case
# (every file 1 KiB). TREE=DIR copies another tree instead; the download
# is kept in /var/tmp/onecopy-bench-linux for later runs.
tree=${TREE:-}
if [[ -z $tree ]]; then
    tree=/var/tmp/onecopy-bench-linux/linux-source-6.1
    if [[ ! -d $tree ]]; then
        mkdir -p /var/tmp/onecopy-bench-linux && (cd /var/tmp/onecopy-bench-linux &&
            apt-get download -qq linux-source-6.1 && dpkg-deb -x linux-source-6.1_*.deb deb &&
            tar xf deb/usr/src/linux-source-6.1.tar.xz && rm -rf deb linux-source-6.1_*.deb)
    fi
fi
echo "$(du -sm --apparent-size "$tree" | cut -f1) MiB"
copies "$tree"
fi

if want restic; then
echo "## a real tree into the mount (cp -a, rsync -a) vs restic backup"
# REAL_TREE (default: the Python installations under ~/.pyenv/versions,
# about 112,000 files and 2.4 GB here; else /usr): copied into a fresh
# store's mount over each transport by cp -a and by rsync -a (ended by a
# sync of the mount, the daemon's CPU counted), and backed up by restic
# into a fresh repository on the same disk; cache dropped before each,
# configurations rotated over ROUNDS rounds (default 1). Stored bytes:
# the store's directory after unmount (with its metadata reserve, a
# fixed 4-64 MiB file: space.rs), restic's repository. The floor of any
# FUSE filesystem: the same cp -a and rsync -a into the null filesystem
# over io_uring (null-cp, null-rsync), which keeps names and attributes
# only.
real=${REAL_TREE:-}
if [[ -z $real ]]; then
    real=/usr; [[ -d $HOME/.pyenv/versions ]] && real=$HOME/.pyenv/versions
fi
files=$(find "$real" -type f | wc -l)
echo "$real: $files files, $(du -sm --apparent-size "$real" | cut -f1) MiB"
export RESTIC_PASSWORD=x
: > "$work/real-times"
for r in $(seq 1 "${ROUNDS:-1}"); do
    for c in restic null-cp null-rsync cp-dev cp-uring rsync-uring; do
        pid= cpu=0 dst=$work/mnt/t
        case $c in
            restic) restic init -q -r "$work/restic" ;;
            null-*) null_uring; sleep 1; dst=$work/null/t ;;
            *-dev) STORE_MOUNT_OPTS=transport=dev mount_store; pid=$(store_pid) ;;
            *-uring) STORE_MOUNT_OPTS=transport=uring mount_store; pid=$(store_pid) ;;
        esac
        drop; t0=$(date +%s.%N)
        case $c in
            restic) restic -q -r "$work/restic" backup "$real" >/dev/null ;;
            *cp*) cp -a "$real" "$dst"; sync -f "$(dirname "$dst")" ;;
            *rsync*) rsync -a "$real/" "$dst"; sync -f "$(dirname "$dst")" ;;
        esac
        t1=$(date +%s.%N)
        if [[ $c == null-* ]]; then
            fusermount3 -u "$work/null"; wait || true; mib=- res=0
        elif [[ -n $pid ]]; then
            cpu=$(cpu_s "$pid"); umount_store
            mib=$(du -sm "$work/s" | cut -f1); res=$(du -sm "$work/s/reserve" 2>/dev/null | cut -f1)
            rm -rf "$work/s"
        else
            mib=$(du -sm "$work/restic" | cut -f1); res=0; rm -rf "$work/restic"
        fi
        echo "$c $t0 $t1 $cpu $mib ${res:-0}" >> "$work/real-times"
    done
done
python3 - "$work/real-times" "$files" <<'PY'
import sys, statistics
t, cpu, mib, res = {}, {}, {}, {}
for line in open(sys.argv[1]):
    k, a, b, c, m, r = line.split()
    t.setdefault(k, []).append(float(b) - float(a)); cpu[k] = float(c); mib[k] = m; res[k] = r
r, files = statistics.median(t["restic"]), int(sys.argv[2])
print("| | rounds (s) | median | x restic | stored MiB (of which the store's fixed reserve) | mount CPU per file |")
print("|---|---|---:|---:|---:|---:|")
for k in t:
    m = statistics.median(t[k])
    c = f"{cpu[k] / files * 1e6:.0f} us" if k != "restic" and not k.startswith("null") else "-"
    stored = "-" if k.startswith("null") else f"{mib[k]} ({res[k]})"
    print(f"| {k} | {' / '.join(f'{x:.1f}' for x in t[k])} | {m:.1f} | {m / r:.2f} | {stored} | {c} |")
PY
fi

if want versions; then
echo "## ingest of successive versions (stored MiB, seconds)"
# Successive versions of a real tree (/usr/include + /usr/lib/python3*):
# each version inserts a few bytes into 5% of the files (shifting what
# follows), appends to 2%, deletes 1% and adds a few new files.
mkdir -p "$work/versions/v1"
cp -a /usr/include /usr/lib/python3* "$work/versions/v1/" 2>/dev/null || true
for i in 2 3 4; do
    cp -a "$work/versions/v$((i-1))" "$work/versions/v$i"
    python3 bench/mutate-tree.py "$work/versions/v$i" "$i"
done
# COMPRESS_SWEEP (e.g. "lz4 auto auto:6 zstd"): `store import` of the
# versions into a fresh store per --compress setting: stored MiB, wall and
# CPU seconds of the four imports (the cache dropped before each setting).
for c in ${COMPRESS_SWEEP:-}; do
    $O store init "$work/sw" --chunking cdc:16K/64K/256K --compress "$c" >/dev/null; drop
    /usr/bin/time -o "$work/sw.time" -f '%e %U %S' bash -c \
        'for i in 1 2 3 4; do "$0" store import "$1" "$2/v$i" >/dev/null; done' "$O" "$work/sw" "$work/versions"
    read -r e u y < <(tail -1 "$work/sw.time")
    echo "| --compress $c | $(du -sm "$work/sw" | cut -f1) MiB | containers $(du -sm "$work/sw/containers" | cut -f1) MiB | wall $e s | CPU $(python3 -c "print(round($u+$y, 2))") s | load $(cut -d' ' -f1 /proc/loadavg) |"
    rm -rf "$work/sw"
done
# STORE_INIT_ARGS (e.g. --compress zstd) apply to both stores below.
$O store init "$work/s" --chunking cdc:16K/64K/256K ${STORE_INIT_ARGS:-} >/dev/null; $O mount "$work/s" "$work/mnt"
ts=0; t0=$(date +%s.%N)
for i in 1 2 3 4; do cp -a "$work/versions/v$i" "$work/mnt/v$i"; done; sync -f "$work/mnt"
ts=$(python3 -c "import time,sys; print(f'{time.time()-float(sys.argv[1]):.1f}')" $t0)
umount_store; sstore=$(du -sm "$work/s" | cut -f1)
echo "store breakdown (KiB): containers $(du -sk "$work/s/containers" | cut -f1), meta.sqlite $(du -skc "$work"/s/meta.sqlite* | tail -1 | cut -f1), index $(du -sk "$work/s/index" | cut -f1)"
$O store stats "$work/s" | sed 's/^/  /'
# The same versions into a second, fresh store with `store import` (no FUSE).
$O store init "$work/si" --chunking cdc:16K/64K/256K ${STORE_INIT_ARGS:-} >/dev/null; t0=$(date +%s.%N)
for i in 1 2 3 4; do $O store import "$work/si" "$work/versions/v$i" >/dev/null; done
ti=$(python3 -c "import time,sys; print(f'{time.time()-float(sys.argv[1]):.1f}')" $t0); si=$(du -sm "$work/si" | cut -f1)
$O store fsck "$work/si" | tail -1 | sed 's/^/  import store fsck: /'
export RESTIC_PASSWORD=x BORG_PASSPHRASE=x BORG_UNKNOWN_UNENCRYPTED_REPO_ACCESS_IS_OK=yes
restic init -q -r "$work/restic"; t0=$(date +%s.%N)
for i in 1 2 3 4; do restic -q -r "$work/restic" backup "$work/versions/v$i" >/dev/null; done
tr=$(python3 -c "import time,sys; print(f'{time.time()-float(sys.argv[1]):.1f}')" $t0); sr=$(du -sm "$work/restic" | cut -f1)
borg init -e none "$work/borg"; t0=$(date +%s.%N)
for i in 1 2 3 4; do borg create "$work/borg::v$i" "$work/versions/v$i"; done
tb=$(python3 -c "import time,sys; print(f'{time.time()-float(sys.argv[1]):.1f}')" $t0); sb=$(du -sm "$work/borg" | cut -f1)
echo "| input MiB | onecopy store (cp -a into the mount) | onecopy store import | restic | borg |"
echo "|---|---|---|---|---|"
echo "| $(du -sm "$work/versions" | cut -f1) | $sstore MiB, ${ts}s | $si MiB, ${ti}s | $sr MiB, ${tr}s | $sb MiB, ${tb}s |"
echo "load: $(uptime)"
rm -rf "$work/versions" "$work/restic" "$work/borg" "$work/s" "$work/si"
fi

if want gc; then
echo "## fio 4 KiB O_DSYNC random writes, p99.9 completion latency (us): idle vs during online gc"
lat() { python3 -c "import json,sys; j=json.load(open(sys.argv[1]))['jobs'][0]['write']['clat_ns']['percentile']; print(f\"{j['99.900000']/1000:.0f}\")" "$1"; }
fio4k() { fio --name=l --filename="$work/mnt/lat" --size=256M --rw=randwrite --bs=4k --ioengine=psync \
    --sync=dsync --time_based --runtime=20 --randseed=3 --output-format=json > "$1"; }
mount_store
for i in 1 2 3 4 5 6; do
    fio --name=g --filename="$work/mnt/garbage$i" --size=128M --rw=write --bs=1M --refill_buffers \
        --randseed=$((100+i)) --output-format=terse >/dev/null
done
fio --name=k --filename="$work/mnt/keep" --size=256M --rw=randwrite --bs=64k --refill_buffers --output-format=terse >/dev/null
rm -f "$work"/mnt/garbage*; sleep 1
fio4k "$work/idle.json"
( sleep 2; $O store gc "$work/s" > "$work/gc.txt" ) &
fio4k "$work/gc.json"; wait
echo "| idle p99.9 | during gc p99.9 | gc |"
echo "|---:|---:|---|"
echo "| $(lat "$work/idle.json") | $(lat "$work/gc.json") | $(cat "$work/gc.txt") |"
umount_store
fi
