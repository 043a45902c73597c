#!/usr/bin/env bash
# Store snapshots (issue 31): time of `snapshot create` and `delete`
# through a mount at 10 k, 100 k and 1 M files, and what holding 30
# snapshots costs writes (fio sequential, cp -a of small files) against a
# store with none. Usage: bench/snapshots.sh (as root) [MAX_FILES]
# (default 1000000). Files are put in with `store import` (10 k-file tree
# imported again and again, each copy its own directory), then the store
# is mounted and the command timed as a user runs it. HALT_POLL_NS=N sets
# the guest's halt polling for the run (bench/haltpoll.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
MAX=${1:-1000000}
# Sections to run (default all): create writes copy series ceiling
SECTIONS=${SECTIONS:-create writes copy series ceiling}
want() { [[ " $SECTIONS " == *" $1 "* ]]; }
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target}
cargo build -q --release -p onecopy
O=$CARGO_TARGET_DIR/release/onecopy
cargo build -q --release -p onecopy-fuse --example nullfs
N=$CARGO_TARGET_DIR/release/examples/nullfs
command -v fio >/dev/null || apt-get install -y -qq fio >/dev/null
. bench/haltpoll.sh
work=$(mktemp -d /var/tmp/onecopy-snapbench.XXXXXX)
cleanup() {
    for m in "$work"/mnt*; do fusermount3 -u "$m" 2>/dev/null || true; done
    sleep 1; rm -rf "$work"
    haltpoll_restore
}
trap cleanup EXIT
drop() { sync; echo 3 > /proc/sys/vm/drop_caches; }
ms() { python3 -c "import sys; print(f'{(float(sys.argv[2])-float(sys.argv[1]))*1000:.0f}')" "$@"; }
med() { printf '%s\n' "$@" | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
now() { date +%s.%N; }

# A 10,000-file tree: 100 directories of 100 files of 1-4 KiB.
src=$work/src
python3 - "$src" <<'EOF'
import os, sys, random
root = sys.argv[1]
r = random.Random(31)
for d in range(100):
    os.makedirs(f"{root}/d{d:03}")
    for f in range(100):
        with open(f"{root}/d{d:03}/f{f:03}", "wb") as fh:
            fh.write(r.randbytes(r.randint(1024, 4096)))
EOF

store=$work/store
mkdir -p "$work/mnt"
"$O" store init "$store" >/dev/null
files=0
copies=0
want create && echo "files     create_ms  delete_ms  (through the mount, cold cache, median of 5)"
want create && for target in 10000 100000 1000000; do
    [ "$target" -le "$MAX" ] || break
    while [ "$files" -lt "$target" ]; do
        "$O" store import "$store" "$src" --to "/c$copies" >/dev/null
        copies=$((copies + 1)); files=$((files + 10000))
    done
    "$O" mount "$store" "$work/mnt"
    creates=(); deletes=()
    for i in 1 2 3 4 5; do
        drop
        t0=$(now); "$O" store snapshot create "$work/mnt" "s$target-$i" >/dev/null; t1=$(now)
        creates+=("$(ms "$t0" "$t1")")
        # Something changes between snapshots, as in real use.
        echo "$i" > "$work/mnt/c0/src/d000/f000"
    done
    for i in 1 2 3 4 5; do
        drop
        t0=$(now); "$O" store snapshot delete "$work/mnt" "s$target-$i" >/dev/null; t1=$(now)
        deletes+=("$(ms "$t0" "$t1")")
    done
    fusermount3 -u "$work/mnt"; sleep 1
    printf "%-9s %-10s %-10s (create: %s; delete: %s)\n" "$files" "$(med "${creates[@]}")" \
        "$(med "${deletes[@]}")" "${creates[*]}" "${deletes[*]}"
done

# Writes with 30 snapshots held vs none: the same store content, then
# fio sequential write of 1 GiB and cp -a of the 10 k-file tree, ROUNDS
# (default 5) rounds alternating.
if want writes; then
echo
echo "held  fio_seq_MBps  cp_a_10k_s"
for held in $(for r in $(seq 1 ${ROUNDS:-5}); do echo 0 30; done); do
    s=$work/w$held; m=$work/mnt$held
    rm -rf "$s"; mkdir -p "$m"
    "$O" store init "$s" >/dev/null
    "$O" store import "$s" "$src" --to /base >/dev/null
    "$O" mount "$s" "$m"
    for i in $(seq 1 "$held"); do
        echo "$i" > "$m/base/src/d000/f000"
        "$O" store snapshot create "$m" "h$i" >/dev/null
    done
    drop
    fio --name=seq --filename="$m/seq" --rw=write --bs=1M --size=1G --end_fsync=1 \
        --output-format=json --output="$work/fio$held.json" >/dev/null
    bw=$(python3 -c "import json,sys; print(f\"{json.load(open(sys.argv[1]))['jobs'][0]['write']['bw_bytes']/1e6:.0f}\")" "$work/fio$held.json")
    drop
    t0=$(now); cp -a "$src" "$m/copy"; sync -f "$m/copy"; t1=$(now)
    printf "%-5s %-13s %s\n" "$held" "$bw" "$(python3 -c "print(f'{$t1-$t0:.2f}')")"
    fusermount3 -u "$m"; sleep 1
done
fi

if want copy; then
# copy_file_range inside the mount: cp of a 4 GiB file (incompressible,
# fsync'd), COPIES times (default 5), each to a new file, cold cache, the
# last one's data synced before the next; container bytes before and after.
s=$work/cp; m=$work/mnt-cp; mkdir -p "$m"
"$O" store init "$s" --compress none >/dev/null
"$O" mount "$s" "$m"
head -c 4G /dev/urandom > "$m/big"; sync "$m/big"
before=$(du -sb "$s/containers" | cut -f1)
n=${COPIES:-5}; times=()
for i in $(seq 1 "$n"); do
    drop
    t0=$(now); cp "$m/big" "$m/copy$i"; t1=$(now); sync "$m/copy$i"
    times+=("$(ms "$t0" "$t1")")
done
after=$(du -sb "$s/containers" | cut -f1)
echo
echo "cp of a 4 GiB file inside the mount: ${times[*]} ms, median $(med "${times[@]}") ms; containers $before -> $after bytes (+$((after - before)))"
same=0
for i in $(seq 1 "$n"); do cmp -s "$m/big" "$m/copy$i" && same=$((same + 1)); done
echo "copies identical to the source: $same of $n"
fusermount3 -u "$m"; sleep 1; rm -rf "$s"
fi

# The series' first version and its restore, against the ceiling of any
# FUSE filesystem here: the same tree `rsync -a`'d into the backing disk
# itself, into the null FUSE filesystem (names and attributes in memory,
# writes discarded, reads zeros; crates/fuse/src/null.rs) and into the
# store; then `cp -a` back out of each, cold (the store from a new
# mount; the null keeps its tree only in memory); and restic backup and
# restore of the same tree. ROUNDS (default 3) rounds, medians. The null
# filesystem and the store each over /dev/fuse and over FUSE-over-io_uring
# (null-uring: bench/ffuse-null; onecopy-uring: -o transport=uring).
if want ceiling; then
command -v restic >/dev/null || apt-get install -y -qq restic >/dev/null
command -v rsync >/dev/null || apt-get install -y -qq rsync >/dev/null
cargo build -q --release --manifest-path bench/ffuse-null/Cargo.toml
NU=$CARGO_TARGET_DIR/release/ffuse-null
uring=/sys/module/fuse/parameters/enable_uring
uring_was=$(cat "$uring"); echo Y > "$uring"
trap 'echo "$uring_was" > "$uring"; cleanup' EXIT
tree=$work/ctree; mkdir -p "$tree"
cp -a /usr/include /usr/lib/python3* "$tree/" 2>/dev/null || true
echo
echo "v1 tree: $(find "$tree" -type f | wc -l) files, $(du -sm "$tree" | cut -f1) MiB"
kinds="native null null-uring onecopy onecopy-uring"
echo "round  into: $kinds restic_backup  out: $kinds onecopy-uring-alone restic_restore  (s)"
secs() { python3 -c "import sys; print(f'{float(sys.argv[2])-float(sys.argv[1]):.2f}')" "$@"; }
for r in $(seq 1 ${ROUNDS:-3}); do
    into=(); out=()
    for c in $kinds; do
        d=$work/c-$c; m=$d/mnt; rm -rf "$d"; mkdir -p "$m"
        case $c in
            null) "$N" "$m" & sleep 1 ;;
            null-uring) "$NU" "$m" 2 32 & sleep 1 ;;
            onecopy*) "$O" store init "$d/s" --chunking cdc:16K/64K/256K >/dev/null
                opts=transport=dev; [ "$c" = onecopy-uring ] && opts=transport=uring
                "$O" mount "$d/s" "$m" -o "$opts" ;;
        esac
        drop
        t0=$(now); rsync -a "$tree/" "$m/live/"; [[ $c == onecopy* ]] && "$O" store snapshot create "$m" v1 >/dev/null
        sync -f "$m/live" 2>/dev/null || sync; t1=$(now)
        into+=("$(secs "$t0" "$t1")")
        if [[ $c == onecopy* ]]; then
            # Cold means the mount's own caches too (SQLite's pages, the
            # rows it keeps): a new mount, as after a reboot.
            fusermount3 -u "$m"; sleep 1; "$O" mount "$d/s" "$m" -o "$opts"
        fi
        drop
        t0=$(now)
        if [[ $c == onecopy* ]]; then cp -a "$m/.onecopy/snapshots/v1/live" "$d/out"; else cp -a "$m/live" "$d/out"; fi
        sync; t1=$(now)
        out+=("$(secs "$t0" "$t1")")
        [ "$c" = native ] || { fusermount3 -u "$m"; sleep 1; }
        if [ "$c" = onecopy-uring ]; then
            # The same copy out of the snapshot mounted alone.
            "$O" mount --snapshot v1 "$d/s" "$m" -o transport=uring
            drop
            t0=$(now); cp -a "$m/live" "$d/out2"; sync; t1=$(now)
            alone=$(secs "$t0" "$t1")
            fusermount3 -u "$m"; sleep 1
        fi
        rm -rf "$d"
    done
    export RESTIC_PASSWORD=x; rm -rf "$work/c-restic"
    restic init -q -r "$work/c-restic"
    drop
    t0=$(now); restic -q -r "$work/c-restic" backup "$tree" >/dev/null; t1=$(now)
    drop
    t2=$(now); restic -q -r "$work/c-restic" restore latest --target "$work/c-rout" >/dev/null; sync; t3=$(now)
    rm -rf "$work/c-restic" "$work/c-rout"
    echo "$r  into: ${into[*]} $(secs "$t0" "$t1")  out: ${out[*]} $alone $(secs "$t2" "$t3")"
done
rm -rf "$tree"
fi

want series || exit 0
# A backup series: 10 versions of a real tree (/usr/include + the Python
# library), each changed in place from the one before (5% of files get
# bytes inserted, 2% appended, 1% deleted, 20 new files), each `rsync -a
# --delete`d into the mount then snapshotted, against `restic backup` of
# the same tree. Then a cold restore of version 5 (cp -a out of its
# snapshot vs restic restore), and forget --keep-last 5 + gc.
# The mount is the default one where the fuse module's enable_uring is
# on (turned on for the run): FUSE over io_uring. SERIES_TRANSPORT=dev
# mounts over /dev/fuse instead.
series_opts=(-o "transport=${SERIES_TRANSPORT:-uring}")
if [ "${SERIES_TRANSPORT:-uring}" = uring ]; then
    uring=/sys/module/fuse/parameters/enable_uring
    uring_was=$(cat "$uring"); echo Y > "$uring"
    trap 'echo "$uring_was" > "$uring"; cleanup' EXIT
fi
command -v restic >/dev/null || apt-get install -y -qq restic >/dev/null
command -v rsync >/dev/null || apt-get install -y -qq rsync >/dev/null
tree=$work/tree; mkdir -p "$tree"
cp -a /usr/include /usr/lib/python3* "$tree/" 2>/dev/null || true
mutate() { python3 bench/mutate-tree.py "$tree" "$1"; }
sums() { (cd "$1" && find . -type f -print0 | sort -z | xargs -0 md5sum) ; }
st=$work/series; sm=$work/mnt-series; mkdir -p "$sm"
"$O" store init "$st" --chunking cdc:16K/64K/256K >/dev/null
"$O" mount "$st" "$sm" "${series_opts[@]}"
export RESTIC_PASSWORD=x
restic init -q -r "$work/restic"
echo
echo "| version | input MiB | onecopy rsync+snapshot s (transport ${SERIES_TRANSPORT:-uring}) | restic backup s |"
echo "|---|---|---|---|"
to=0; tr=0
for v in $(seq 1 10); do
    [ "$v" -gt 1 ] && mutate "$v"
    sums "$tree" > "$work/v$v.sums"
    drop
    t0=$(now); rsync -a --delete "$tree/" "$sm/live/"; "$O" store snapshot create "$sm" "v$v" >/dev/null; t1=$(now)
    drop
    t2=$(now); restic -q -r "$work/restic" backup "$tree" >/dev/null; t3=$(now)
    a=$(python3 -c "print(f'{$t1-$t0:.1f}')"); b=$(python3 -c "print(f'{$t3-$t2:.1f}')")
    to=$(python3 -c "print($to+$a)"); tr=$(python3 -c "print($tr+$b)")
    echo "| v$v | $(du -sm "$tree" | cut -f1) | $a | $b |"
done
echo "| total | | $(python3 -c "print(round($to, 1))") | $(python3 -c "print(round($tr, 1))") |"
fusermount3 -u "$sm"; sleep 1
echo
# The store's metadata reserve (DIR/reserve, 4-64 MiB of allocated blocks
# kept free for commits on a full disk) holds no data: left out.
echo "stored MiB: onecopy $(du -sm --exclude=reserve "$st" | cut -f1) (containers $(du -sm "$st/containers" | cut -f1); reserve $(du -sm "$st/reserve" | cut -f1) not counted), restic $(du -sm "$work/restic" | cut -f1)"
"$O" mount "$st" "$sm" "${series_opts[@]}"
drop
t0=$(now); cp -a "$sm/.onecopy/snapshots/v5/live" "$work/restore-onecopy"; t1=$(now)
snap5=$(restic -q -r "$work/restic" snapshots --json | python3 -c "import json,sys; print(json.load(sys.stdin)[4]['short_id'])")
drop
t2=$(now); restic -q -r "$work/restic" restore "$snap5" --target "$work/restore-restic" >/dev/null; t3=$(now)
mib=$(du -sm "$work/restore-onecopy" | cut -f1)
echo "cold restore of v5 ($mib MiB): onecopy cp -a $(python3 -c "print(f'{$t1-$t0:.1f}')") s, restic restore $(python3 -c "print(f'{$t3-$t2:.1f}')") s"
diff <(sums "$work/restore-onecopy") "$work/v5.sums" >/dev/null && echo "v5 restored from the snapshot: every file's md5 matches"
fusermount3 -u "$sm"; sleep 1
"$O" mount --snapshot v5 "$st" "$sm" "${series_opts[@]}"
drop
t0=$(now); cp -a "$sm/live" "$work/restore-alone"; t1=$(now)
echo "cold restore of v5 mounted alone (mount --snapshot v5, cp -a): $(python3 -c "print(f'{$t1-$t0:.1f}')") s"
diff <(sums "$work/restore-alone") "$work/v5.sums" >/dev/null && echo "v5 restored from the snapshot mounted alone: every file's md5 matches"
fusermount3 -u "$sm"; sleep 1; drop
t0=$(now); "$O" store snapshot restore "$st" v5 "$work/restore-offline" >/dev/null; t1=$(now)
echo "cold restore of v5 without a mount (store snapshot restore): $(python3 -c "print(f'{$t1-$t0:.1f}')") s"
diff <(sums "$work/restore-offline/live") "$work/v5.sums" >/dev/null && echo "v5 restored offline: every file's md5 matches"
"$O" mount "$st" "$sm" "${series_opts[@]}"
"$O" store snapshot list "$sm"
before=$("$O" store stats "$st" --json | python3 -c "import json,sys; print(json.load(sys.stdin)['stored_bytes'])")
"$O" store forget "$sm" --keep-last 5 | tail -1
"$O" store gc "$st"
after=$("$O" store stats "$st" --json | python3 -c "import json,sys; print(json.load(sys.stdin)['stored_bytes'])")
echo "forget --keep-last 5 + gc: stored bytes $before -> $after (freed $((before - after)))"
for v in 6 10; do
    diff <(sums "$sm/.onecopy/snapshots/v$v/live") "$work/v$v.sums" >/dev/null && echo "v$v intact after forget + gc"
done
fusermount3 -u "$sm"; sleep 1
"$O" store fsck "$st" | tail -1
