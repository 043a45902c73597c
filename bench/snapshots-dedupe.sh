#!/usr/bin/env bash
# Out-of-band dedupe on btrfs with many read-only snapshots (issue 34):
# onecopy with 0, 10 and 100 snapshots of a real tree, against the same
# run without snapshots and against duperemove; what a second run reads
# after one more snapshot; and whether the report's "will be freed when
# snapshots are deleted" figure is what deleting them frees.
#
# Usage: bench/snapshots-dedupe.sh (as root)
#   TREE=DIR        the real tree (default ~/.pyenv/versions/3.11.7 if
#                   present, else the newest /usr/lib/python3.*)
#   SNAPS="0 10 100"          snapshot counts for onecopy --no-catalog; a
#                   count may repeat ("0 100 0 100 0 100"): then a table
#                   of medians follows, and ratios are to the median N=0
#   DUPEREMOVE_SNAPS="0 10"   the same for duperemove (it reads every
#                   snapshot's files: 100 would take hours); "" skips it
#   INCR_SNAPS=10   snapshots for the incremental run; "" skips it
#   DUPEREMOVE_ARGS extra duperemove options (default none; its default
#                   block size, 128K, skips every smaller file: "-b 4k"
#                   matches at onecopy's granularity)
#   IMAGE_SIZE=12G  the sparse loop image (the tree twice must fit)
#   ONECOPY=PATH    the onecopy binary (default target/release/onecopy,
#                   built with cargo if absent); copied into the work dir
#   SMALL=1         smoke run: two 1-6 MiB subdirectories of TREE,
#                   SNAPS="0 3", DUPEREMOVE_SNAPS="0 3", INCR_SNAPS=3
#   KEEP=1          keep the work directory (logs, JSON reports) at exit
#
# Workload, for every cell (tool, N): a FRESH btrfs (sparse image in
# /var/tmp/onecopy-snapbench.XXXXXX, `losetup --direct-io=on`, mkfs.btrfs,
# mount -o noatime), a subvolume `live` holding the tree twice as byte
# copies (`cp -a --reflink=never TREE live/a`, then `live/b`), N read-only
# snapshots of `live` (`btrfs subvolume snapshot -r MNT/live MNT/snap-I`),
# sync, caches dropped, then the tool on the whole mount:
#   onecopy:    onecopy dedupe --no-catalog --json MNT
#   duperemove: duperemove -dr -q --hashfile=WORK/dr.hash [DUPEREMOVE_ARGS] MNT
# After a run with N > 0 the snapshots are deleted (`btrfs subvolume
# delete`, `btrfs subvolume sync` until the cleaner is done, sync) and the
# drop in used space is measured: onecopy's bytes_pinned_by_snapshots
# should match it within 2% (the measured figure also holds the
# snapshots' own metadata; it is printed as it is).
# Incremental: a fresh fs with INCR_SNAPS snapshots, `onecopy dedupe
# --json --hashfile WORK/catalog.db MNT`, one more snapshot, caches
# dropped, the same command again (goal: < 1% of the data read).
#
# Measured: wall, CPU (user+sys), peak RSS and "File system inputs" x 512
# (the process's actual reads; the tool's binary and libraries are read
# back into the cache after the drop, so their pages are not counted)
# from /usr/bin/time -v; onecopy's JSON
# (bytes_read, bytes_same_extents, files_scanned, files_read,
# dedupe_ioctls, bytes_deduped, bytes_freed, fs_free_delta,
# bytes_pinned_by_snapshots, pinning_snapshots: "-" when absent); used
# space (statvfs, and btrfs filesystem usage's Data and Metadata "Used")
# before, after, and after the snapshots are deleted. Physical data =
# `btrfs filesystem du -s --raw MNT/live` Total, before any snapshot (the
# snapshots add no data). Issue 34's goals: bytes read <= 1.1x physical,
# wall <= 1.3x and peak RSS <= 1.2x the N=0 run.
#
# Output: markdown on stdout, progress on stderr; the markdown is also
# saved as bench/results/snapshots-dedupe-TIME.md. A failing command
# stops the run with its log tail (exit 1); a onecopy run that ends
# "done in part" (exit 1, errors in its JSON) is reported and makes the
# script exit 1 after the report.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "run as root (loop devices, mount, drop_caches)" >&2; exit 2; }
SMALL=${SMALL:-0}
if [ "$SMALL" = 1 ]; then d=3; else d=10; fi
SNAPS=${SNAPS-0 $d $([ "$SMALL" = 1 ] || echo 100)}
DUPEREMOVE_SNAPS=${DUPEREMOVE_SNAPS-0 $d}
INCR_SNAPS=${INCR_SNAPS-$d}
IMAGE_SIZE=${IMAGE_SIZE:-12G}
read -ra DR_ARGS <<< "${DUPEREMOVE_ARGS:-}"
if [ -z "${TREE:-}" ]; then
    TREE=$HOME/.pyenv/versions/3.11.7
    [ -d "$TREE" ] || TREE=$(ls -d /usr/lib/python3* 2>/dev/null | sort -V | tail -1)
fi
[ -d "$TREE" ] || { echo "TREE=$TREE is not a directory" >&2; exit 2; }
TREE=$(realpath "$TREE")
ONECOPY=${ONECOPY:-${CARGO_TARGET_DIR:-target}/release/onecopy}
[ -x "$ONECOPY" ] || cargo build -q --release -p onecopy
command -v mkfs.btrfs >/dev/null || apt-get install -y -qq btrfs-progs >/dev/null
[ -x /usr/bin/time ] || apt-get install -y -qq time >/dev/null
if [ -n "$DUPEREMOVE_SNAPS" ] && ! command -v duperemove >/dev/null; then
    apt-get install -y -qq duperemove >/dev/null
fi

work=$(mktemp -d /var/tmp/onecopy-snapbench.XXXXXX)
IMG=$work/fs.img MNT=$work/mnt
teardown() { # unmount and detach every loop device on the image
    if mountpoint -q "$MNT"; then umount "$MNT" || umount -l "$MNT"; fi
    [ -f "$IMG" ] || return 0
    losetup -j "$IMG" | cut -d: -f1 | while read -r dev; do losetup -d "$dev"; done
}
cleanup() {
    teardown || true
    if [ "${KEEP:-0}" = 1 ]; then echo "kept $work" >&2; else rm -rf "$work"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM
mkdir -p "$work"/{log,time,mnt}
cp "$ONECOPY" "$work/onecopy"   # a rebuild during the run changes nothing
O=$work/onecopy
log() { echo "[$(date +%T)] $*" >&2; }
drop() { sync; echo 3 > /proc/sys/vm/drop_caches; }
warm() { cat "$1" $(ldd "$1" 2>/dev/null | grep -o '/[^ ]*' || true) > /dev/null; } # BIN
settle() { sync -f "$MNT"; btrfs filesystem sync "$MNT"; sleep 1; btrfs filesystem sync "$MNT"; }

# Helpers in Python: the SMALL subset, /usr/bin/time -v's report, used
# space, one row of results, the report.
H=$work/h.py
cat > "$H" <<'PY'
import json, os, re, shutil, subprocess, sys
cmd, args = sys.argv[1], sys.argv[2:]

from timev import timev  # wall s, CPU s, peak RSS MiB, FS inputs bytes

def find(d, key):  # a key anywhere in the JSON report
    if isinstance(d, dict):
        if key in d: return d[key]
        for x in d.values():
            r = find(x, key)
            if r is not None: return r
    return None

if cmd == "subset":  # TREE DEST: the first two subdirectories of 1-6 MiB and >= 20 files
    tree, dest = args
    size, count = {}, {}
    for d, dirs, files in os.walk(tree, topdown=False):
        reg = [os.lstat(os.path.join(d, f)) for f in files]
        reg = [s for s in reg if (s.st_mode & 0o170000) == 0o100000]
        size[d] = sum(s.st_size for s in reg) + sum(size.get(os.path.join(d, x), 0) for x in dirs)
        count[d] = len(reg) + sum(count.get(os.path.join(d, x), 0) for x in dirs)
    picked = []
    for d, dirs, files in os.walk(tree):
        dirs.sort()
        if d != tree and 1 << 20 <= size[d] <= 6 << 20 and count[d] >= 20:
            picked.append(d); dirs[:] = []
            if len(picked) == 2: break
    if not picked: sys.exit(f"no subdirectory of 1-6 MiB with 20 files in {tree}")
    for p in picked:
        shutil.copytree(p, os.path.join(dest, os.path.relpath(p, tree)), symlinks=True)
    print(" + ".join(os.path.relpath(p, tree) for p in picked))
elif cmd == "time":  # TIMEFILE
    w, c, r, i = timev(args[0]); print(f"{w:.2f} {c:.2f} {r:.0f} {i / 1048576:.1f}")
elif cmd == "used":  # MNT: statvfs used, btrfs Data used, Metadata used (bytes)
    s = os.statvfs(args[0]); out = {"Data": 0, "Metadata": 0}
    u = subprocess.run(["btrfs", "filesystem", "usage", "-b", args[0]], capture_output=True, text=True, check=True).stdout
    for m in re.finditer(r"^(Data|Metadata),\S+: Size:(\d+), Used:(\d+)", u, re.M):
        out[m.group(1)] += int(m.group(3))
    print((s.f_blocks - s.f_bfree) * s.f_frsize, out["Data"], out["Metadata"])
elif cmd == "row":  # ROWS key=value...: one result row (time=FILE and json=FILE are read)
    row = {}
    for a in args[1:]:
        k, v = a.split("=", 1)
        if k == "time":
            row["wall"], row["cpu"], row["rss"], row["inputs"] = timev(v)
        elif k == "json":
            try:
                j = json.load(open(v))
            except (OSError, ValueError):
                j = {}
            for f in ("bytes_read", "bytes_same_extents", "files_scanned", "files_read", "files_known",
                      "files_same_extents", "dedupe_ioctls", "bytes_deduped", "bytes_freed", "fs_free_delta",
                      "bytes_pinned_by_snapshots", "pinning_snapshots", "exit_code"):
                row[f] = find(j, f)
            row["errors"] = [f"{e.get('path')}: {e.get('error')}" for e in j.get("errors", [])]
        elif k in ("u0", "u1", "u2"):  # used space: "statvfs data meta"
            row[k] = [int(x) for x in v.split()]
        else:
            row[k] = int(v) if re.fullmatch(r"-?\d+", v) else v
    with open(args[0], "a") as f:
        f.write(json.dumps(row) + "\n")
elif cmd == "report":  # ROWS TREE_DESC FILES APPARENT VERSIONS...
    rows = [json.loads(l) for l in open(args[0])]
    tree, nfiles, apparent, over, drver, kernel, image = args[1:]
    mib = lambda b: "-" if b is None else f"{b / 1048576:.1f}"
    rat = lambda a, b: "-" if a is None or not b else f"{a / b:.2f}"
    dash = lambda x: "-" if x is None else str(x)
    status = lambda r: "22 (no candidates)" if r["tool"] == "duperemove" and r["rc"] == 22 else str(r["rc"])
    print(f"## Out-of-band dedupe with read-only btrfs snapshots (issue 34)\n")
    print(f"Tree: {tree}, copied twice as byte copies into subvolume `live` ({nfiles} files, "
          f"{int(apparent) / 1048576:.1f} MiB apparent per copy). {over}; {drver}; kernel {kernel}; "
          f"loop btrfs on a {image} sparse image (`losetup --direct-io=on`), fresh per row. "
          "Cache dropped before every timed command.\n")
    full = [r for r in rows if r["kind"] == "full"]
    med = lambda xs: sorted(xs)[len(xs) // 2]
    # Ratios against the median N=0 run (SNAPS may repeat a count).
    base = {}
    for t in {r["tool"] for r in full}:
        zero = [r for r in full if r["tool"] == t and r["n"] == 0]
        if zero:
            base[t] = {"wall": med([r["wall"] for r in zero]), "rss": med([r["rss"] for r in zero])}
    print("| tool | snapshots | wall s | CPU s | peak RSS MiB | bytes read MiB (JSON) | FS inputs MiB | physical MiB "
          "| read / physical (JSON, inputs) | wall / N=0 | RSS / N=0 | dedupe calls | freed MiB | pinned by snapshots MiB "
          "| freed on deleting snapshots MiB | measured / pinned | exit |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in (r for r in rows if r["kind"] == "full"):
        b = base.get(r["tool"]); n = r["n"]
        freed = r["u0"][0] - r["u1"][0]
        deleted = r["u1"][0] - r["u2"][0] if "u2" in r else None
        pinned = r.get("bytes_pinned_by_snapshots")
        print(f"| {r['tool']} | {n} | {r['wall']:.2f} | {r['cpu']:.2f} | {r['rss']:.0f} | {mib(r.get('bytes_read'))} "
              f"| {mib(r['inputs'])} | {mib(r['phys'])} | {rat(r.get('bytes_read'), r['phys'])}, {rat(r['inputs'], r['phys'])} "
              f"| {rat(r['wall'], b and b['wall'])} | {rat(r['rss'], b and b['rss'])} | {dash(r.get('dedupe_ioctls'))} "
              f"| {mib(freed)} | {mib(pinned)} | {mib(deleted)} | {rat(deleted, pinned)} | {status(r)} |")
    cells = sorted({(r["tool"], r["n"]) for r in full})
    if any(sum(1 for r in full if (r["tool"], r["n"]) == c) > 1 for c in cells):
        print("\nMedians over the repeated rows (the ratios above are to the median N=0 row):\n")
        print("| tool | snapshots | runs | wall s | CPU s | peak RSS MiB | wall / N=0 | RSS / N=0 |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for t, n in cells:
            rs = [r for r in full if (r["tool"], r["n"]) == (t, n)]
            w, c, m = med([r["wall"] for r in rs]), med([r["cpu"] for r in rs]), med([r["rss"] for r in rs])
            b = base.get(t)
            print(f"| {t} | {n} | {len(rs)} | {w:.2f} | {c:.2f} | {m:.0f} | {rat(w, b and b['wall'])} | {rat(m, b and b['rss'])} |")
    oc = [r for r in rows if r["tool"] == "onecopy"]
    print("\nonecopy's own report:\n")
    print("| run | snapshots | files scanned | files read | files same extents | files known | bytes same extents MiB "
          "| bytes deduped MiB | bytes freed MiB | fs_free_delta MiB | pinned MiB | pinning snapshots | errors |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in oc:
        run = "--no-catalog" if r["kind"] == "full" else f"catalog, run {r['run']}"
        print(f"| {run} | {r['n']} | {dash(r['files_scanned'])} | {dash(r['files_read'])} | {dash(r['files_same_extents'])} "
              f"| {dash(r['files_known'])} | {mib(r['bytes_same_extents'])} | {mib(r['bytes_deduped'])} | {mib(r['bytes_freed'])} "
              f"| {mib(r['fs_free_delta'])} | {mib(r['bytes_pinned_by_snapshots'])} | {dash(r['pinning_snapshots'])} | {len(r['errors'])} |")
    inc = [r for r in rows if r["kind"] == "incr"]
    if inc:
        print(f"\nIncremental (catalog `--hashfile`), {inc[0]['n']} snapshots; run 2 after one more snapshot:\n")
        print("| run | wall s | CPU s | peak RSS MiB | bytes read MiB | FS inputs MiB | files read | files known "
              "| bytes same extents MiB | read / physical (JSON, inputs) | exit |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in inc:
            print(f"| {r['run']} | {r['wall']:.2f} | {r['cpu']:.2f} | {r['rss']:.0f} | {mib(r['bytes_read'])} | {mib(r['inputs'])} "
                  f"| {dash(r['files_read'])} | {dash(r['files_known'])} | {mib(r['bytes_same_extents'])} "
                  f"| {rat(r['bytes_read'], r['phys'])}, {rat(r['inputs'], r['phys'])} | {r['rc']} |")
    print("\n- physical = `btrfs filesystem du -s --raw MNT/live` Total after the copies, before any snapshot "
          "(files of at most 2048 bytes are inline in metadata and counted there, never read by onecopy).")
    print("- freed = used space (statvfs, after sync) before - after the run; freed on deleting snapshots = "
          "used after the run - used after `btrfs subvolume delete` of every snapshot and `btrfs subvolume sync` "
          "(includes the snapshots' own metadata).")
    print("- FS inputs = /usr/bin/time -v \"File system inputs\" x 512: what the process read from the "
          "block device (data and metadata), its binary and libraries excepted (read into the cache after the drop).")
    for r in rows:
        if "u2" in r:
            dd, dm = r["u1"][1] - r["u2"][1], r["u1"][2] - r["u2"][2]
            print(f"- {r['tool']}, {r['n']} snapshots: deleting them freed {mib(dd)} MiB of data and "
                  f"{mib(dm)} MiB of metadata (btrfs filesystem usage, Used)")
    for r in oc:
        if r["errors"]:
            print(f"- onecopy ({r['kind']}, {r['n']} snapshots) reported {len(r['errors'])} errors, first: {r['errors'][0]}")
PY
py() { PYTHONPATH="$PWD/bench" python3 "$H" "$@"; }

# A command under /usr/bin/time -v: LABEL OK_CODES CMD... (output in
# log/LABEL.{out,err}; OK_CODES like "0 1"); sets rc.
timed() {
    local label=$1 ok=$2; shift 2
    rc=0
    /usr/bin/time -v -o "$work/time/$label" "$@" >"$work/log/$label.out" 2>"$work/log/$label.err" || rc=$?
    [[ " $ok " == *" $rc "* ]] && return 0
    echo "FAILED ($label, exit $rc): $*" >&2; tail -20 "$work/log/$label.err" >&2; exit 1
}
oc_run() { # LABEL ARGS...: onecopy dedupe --json; exit 1 ("done in part") only with its report
    local label=$1; shift
    timed "$label" "0 1" "$O" dedupe --json "$@" "$MNT"
    [ "$rc" = 0 ] && return 0
    partial=1
    python3 -c 'import json, sys; json.load(open(sys.argv[1]))' "$work/log/$label.out" 2>/dev/null && return 0
    echo "FAILED ($label, exit 1 without a JSON report)" >&2; tail -20 "$work/log/$label.err" >&2; exit 1
}
fresh_fs() {
    teardown; rm -f "$IMG"; truncate -s "$IMAGE_SIZE" "$IMG"
    local dev; dev=$(losetup --find --show --direct-io=on "$IMG")
    mkfs.btrfs -q -f "$dev" >/dev/null
    mount -o noatime "$dev" "$MNT"
}
snapshot() { btrfs subvolume snapshot -r "$MNT/live" "$MNT/$1" >/dev/null; } # NAME
populate() { # N: a fresh fs, the tree twice in `live`, N snapshots; sets phys
    fresh_fs
    btrfs subvolume create "$MNT/live" >/dev/null
    cp -a --reflink=never "$SRC" "$MNT/live/a"
    cp -a --reflink=never "$SRC" "$MNT/live/b"
    settle
    phys=$(btrfs filesystem du -s --raw "$MNT/live" | awk 'NR == 2 { print $1 }')
    for i in $(seq 1 "$1"); do snapshot "snap-$i"; done
    settle
}
delete_snaps() { # frees what only the snapshots held; waits for the cleaner
    btrfs subvolume delete -c "$MNT"/snap-* >/dev/null
    btrfs subvolume sync "$MNT" >/dev/null
    settle
}
used() { py used "$MNT"; }
partial=0
cell() { # TOOL N: one row of the main table
    local tool=$1 n=$2 label=$1-$2 u0 u1 u2=
    log "$tool, $n snapshots: fresh fs"
    populate "$n"; u0=$(used)
    if [ "$tool" = onecopy ]; then
        drop; warm "$O"; oc_run "$label" --no-catalog
    else
        rm -f "$work/dr.hash"; drop; warm "$(command -v duperemove)"
        timed "$label" "0 22" duperemove -dr -q --hashfile="$work/dr.hash" "${DR_ARGS[@]}" "$MNT"
    fi
    settle; u1=$(used)
    log "  $(py time "$work/time/$label" | awk '{print $1 " s wall, " $2 " s CPU, " $3 " MiB, " $4 " MiB read"}')"
    if [ "$n" -gt 0 ]; then delete_snaps; u2=$(used); fi
    py row "$work/rows" kind=full tool="$tool" n="$n" phys="$phys" rc="$rc" time="$work/time/$label" \
        json="$work/log/$label.out" u0="$u0" u1="$u1" ${u2:+u2="$u2"}
}
incremental() { # N: catalog run, one more snapshot, catalog run again
    local n=$1 r label
    log "onecopy incremental, $n snapshots: fresh fs"
    populate "$n"; rm -f "$work"/catalog.db*
    for r in 1 2; do
        [ "$r" = 2 ] && { snapshot snap-new; settle; }
        label=incr-$r; drop; warm "$O"; oc_run "$label" --hashfile "$work/catalog.db"
        settle
        log "  run $r: $(py time "$work/time/$label" | awk '{print $1 " s wall, " $4 " MiB read"}')"
        py row "$work/rows" kind=incr tool=onecopy n="$n" run="$r" phys="$phys" rc="$rc" \
            time="$work/time/$label" json="$work/log/$label.out"
    done
}

SRC=$TREE; desc=$TREE
if [ "$SMALL" = 1 ]; then
    SRC=$work/src; mkdir -p "$SRC"
    desc="$TREE: $(py subset "$TREE" "$SRC")"
fi
nfiles=$(find "$SRC" -type f | wc -l)
apparent=$(du -sb --apparent-size "$SRC" | cut -f1)
log "work dir $work; tree $desc ($nfiles files, $((apparent / 1048576)) MiB)"
: > "$work/rows"
for n in $SNAPS; do cell onecopy "$n"; done
[ -n "$INCR_SNAPS" ] && incremental "$INCR_SNAPS"
for n in $DUPEREMOVE_SNAPS; do cell duperemove "$n"; done
teardown

results=bench/results/snapshots-dedupe-$(date +%Y%m%d-%H%M%S).md
mkdir -p bench/results
drver=$(command -v duperemove >/dev/null && duperemove --version 2>&1 | head -1 || echo "duperemove absent")
drver="$drver \`duperemove -dr -q --hashfile=H${DUPEREMOVE_ARGS:+ $DUPEREMOVE_ARGS}\`"
py report "$work/rows" "$desc" "$nfiles" "$apparent" "$("$O" --version | head -1)" "$drver" "$(uname -r)" "$IMAGE_SIZE" |
    tee "$results"
log "saved $results"
[ "$partial" = 0 ] || { log "a onecopy run ended in part (exit 1): see its errors above"; exit 1; }
