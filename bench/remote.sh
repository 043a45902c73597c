#!/usr/bin/env bash
# A remote store (issue 32: the store in an S3-compatible bucket) against
# restic on the same kind of server: SeaweedFS `weed mini` on loopback,
# one freshly started server per tool (so each bucket's bytes and
# requests are its tool's alone), both with encryption on.
#
# Usage: bench/remote.sh (as root)
#   VERSIONS=N   versions backed up, one after the other (default 4)
#   SMALL=1      smoke run: a few MiB of each tree, 2 versions by default
#   CHUNKING=..  onecopy `store init --chunking` (default cdc:16K/64K/256K,
#                the one `store init --help` gives for backups)
#   ONECOPY=PATH a prebuilt onecopy (default: cargo build --release -p onecopy)
#   WEED=PATH    the weed binary (default: `pyenv which weed`, else PATH)
#   KEEP=1       keep the work directory (logs, stores) at exit
#   TREE=DIR     version 1 is DIR (e.g. ~/.pyenv/versions: 112 k files,
#                2.1 GiB, the issue's size), later ones bench/mutate-tree.py's
#
# Workload: successive versions of a real tree, the Python standard
# library of each Python under ~/.pyenv/versions (then /usr/lib/python3.*)
# in version order, the newest VERSIONS of them; site-packages is left
# out (it holds whatever was pip-installed into that Python, 465 MiB of it
# in one of them here). Each version is `rsync -a --delete`d to the same
# path, $WORK/src/python, which both tools then back up from a dropped
# page cache: onecopy with `store import STORE SRC --to /vN` (a store made
# with `store init --remote s3://BUCKET/onecopy --endpoint ...`), restic
# with `restic backup SRC` (its parent snapshot is found, the path being
# the same). With fewer trees than VERSIONS, the last one is changed in
# place by bench/mutate-tree.py for the rest (as bench/store.sh does).
#
# Measured for each: wall, CPU (user+sys) and peak RSS of the client
# (/usr/bin/time -v); the server's CPU, the S3 requests by type and the
# bytes sent and received, from the server's own Prometheus counters
# (SeaweedFS_s3_request_total, _bucket_traffic_*); after the last version
# the bucket's objects and bytes, listed with boto3 (list_objects_v2).
# Then a cold restore of the last version: `restic restore latest`
# (from an empty restic cache) against onecopy's way on a new machine:
# the local cache removed, `store init NEWCACHE --recover`, a mount,
# `cp -a` out of it; both compared with the source, byte for byte and
# type, mode, mtime of every entry.
#
# Output: markdown on stdout, progress on stderr; the markdown is also
# saved as bench/results/remote-TIME.md. Exit 1 when a restore differs
# from its source (after the report) or a command fails (its log tail
# on stderr).
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "run as root (drop_caches, FUSE mounts)" >&2; exit 2; }
SMALL=${SMALL:-0}
if [ "$SMALL" = 1 ]; then VERSIONS=${VERSIONS:-2}; else VERSIONS=${VERSIONS:-4}; fi
CHUNKING=${CHUNKING:-cdc:16K/64K/256K}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target}
if [ -z "${ONECOPY:-}" ]; then
    cargo build -q --release -p onecopy
    ONECOPY=$CARGO_TARGET_DIR/release/onecopy
fi
O=$(realpath "$ONECOPY")
. bench/weed.sh
for t in restic rsync fusermount3; do
    command -v $t >/dev/null || apt-get install -y -qq restic rsync fuse3 >/dev/null
done
[ -x /usr/bin/time ] || apt-get install -y -qq time >/dev/null
python3 -c 'import boto3' 2>/dev/null || python3 -m pip install -q boto3 >&2

work=$(mktemp -d /var/tmp/onecopy-remotebench.XXXXXX)
MNT=$work/mnt
mount_pid=
cleanup() {
    if grep -qs " $MNT " /proc/self/mountinfo; then
        fusermount3 -u "$MNT" 2>/dev/null || fusermount3 -uz "$MNT" 2>/dev/null || true
    fi
    [ -n "$mount_pid" ] && kill "$mount_pid" 2>/dev/null || true
    for f in "$work"/weed-*/pid; do
        [ -f "$f" ] || continue
        p=$(cat "$f"); kill "$p" 2>/dev/null || continue
        for _ in $(seq 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.2; done
        kill -9 "$p" 2>/dev/null || true
    done
    wait 2>/dev/null || true
    if [ "${KEEP:-0}" = 1 ]; then echo "kept $work" >&2; else rm -rf "$work"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM
mkdir -p "$work"/{log,time,m,src}
log() { echo "[$(date +%T)] $*" >&2; }
drop() { sync; echo 3 > /proc/sys/vm/drop_caches; }

# Helpers in Python: the S3 side (boto3), the server's
# counters, /usr/bin/time -v's report.
H=$work/h.py
cat > "$H" <<'PY'
import json, os, sys, time, urllib.request
cmd, args = sys.argv[1], sys.argv[2:]

def client(endpoint):
    import boto3
    from botocore.config import Config
    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                        aws_access_key_id=os.environ["AWS_ACCESS_KEY_ID"],
                        aws_secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"],
                        config=Config(retries={"max_attempts": 1}, connect_timeout=2, read_timeout=30))

if cmd == "wait":  # ENDPOINT BUCKET PID: until the bucket answers
    t0 = time.time(); err = None
    while time.time() - t0 < 120:
        try:
            os.kill(int(args[2]), 0)
        except OSError:
            sys.exit(f"weed (pid {args[2]}) exited")
        try:
            client(args[0]).head_bucket(Bucket=args[1]); sys.exit(0)
        except Exception as e:
            err = e; time.sleep(0.3)
    sys.exit(f"{args[0]} bucket {args[1]} did not answer in 120 s: {err}")
elif cmd == "usage":  # ENDPOINT BUCKET OUT.json: objects and bytes, by kind
    s3 = client(args[0]); n = size = 0; kinds = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=args[1]):
        for o in page.get("Contents", []):
            n += 1; size += o["Size"]
            parts = o["Key"].split("/")
            k = parts[1] if parts[0] == "onecopy" and len(parts) > 1 else parts[0]
            c = kinds.setdefault(k, [0, 0]); c[0] += 1; c[1] += o["Size"]
    json.dump({"objects": n, "bytes": size, "kinds": kinds}, open(args[2], "w"))
elif cmd == "metrics":  # PORT BUCKET OUT.json: the server's counters now
    text = urllib.request.urlopen(f"http://127.0.0.1:{args[0]}/metrics", timeout=10).read().decode()
    m = {"cpu": 0.0, "rx": 0, "tx": 0}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, val = line.rsplit(" ", 1)
        if name == "process_cpu_seconds_total":
            m["cpu"] = float(val)
        elif f'bucket="{args[1]}"' not in name:
            continue
        elif name.startswith("SeaweedFS_s3_request_total{"):
            t = name.split('type="')[1].split('"')[0]
            m[t] = m.get(t, 0) + int(float(val))
        elif name.startswith("SeaweedFS_s3_bucket_traffic_received_bytes_total"):
            m["rx"] = int(float(val))
        elif name.startswith("SeaweedFS_s3_bucket_traffic_sent_bytes_total"):
            m["tx"] = int(float(val))
    json.dump(m, open(args[2], "w"))
elif cmd == "tree":  # SRC DST: is DST a copy of SRC (bytes, type, mode, mtime, links)?
    import filecmp, stat
    src, dst = args
    def walk(root):
        out = {}
        for d, dirs, files in os.walk(root):
            for n in dirs + files:
                p = os.path.join(d, n); out[os.path.relpath(p, root)] = os.lstat(p)
        return out
    a, b = walk(src), walk(dst)
    missing = sorted(set(a) - set(b)); extra = sorted(set(b) - set(a))
    content, meta = [], []
    for k in sorted(set(a) & set(b)):
        x, y = a[k], b[k]; why = []
        if stat.S_IFMT(x.st_mode) != stat.S_IFMT(y.st_mode):
            why.append("type")
        elif stat.S_ISREG(x.st_mode):
            if x.st_size != y.st_size or not filecmp.cmp(os.path.join(src, k), os.path.join(dst, k), shallow=False):
                content.append(k)
        elif stat.S_ISLNK(x.st_mode) and os.readlink(os.path.join(src, k)) != os.readlink(os.path.join(dst, k)):
            content.append(k)
        if stat.S_IMODE(x.st_mode) != stat.S_IMODE(y.st_mode):
            why.append("mode")
        if not stat.S_ISLNK(x.st_mode) and x.st_mtime_ns != y.st_mtime_ns:
            why.append("mtime")
        if why:
            meta.append(f"{k} ({', '.join(why)})")
    files = sum(1 for v in a.values() if stat.S_ISREG(v.st_mode))
    bad = []
    if missing: bad.append(f"{len(missing)} missing (first {missing[0]})")
    if extra: bad.append(f"{len(extra)} extra (first {extra[0]})")
    if content: bad.append(f"{len(content)} files differ in content (first {content[0]})")
    if meta: bad.append(f"{len(meta)} entries differ in metadata (first {meta[0]})")
    print("identical" + f" ({files} files: bytes, types, modes, mtimes)" if not bad else "DIFFERS: " + "; ".join(bad))
elif cmd == "time":  # TIMEFILE: wall, CPU (user+sys) and peak RSS (MiB) from time -v
    from timev import timev
    w, cpu, rss, _ = timev(args[0])
    print(f"{w:.2f} {cpu:.2f} {rss:.0f}")
PY
py() { PYTHONPATH="$PWD/bench" python3 "$H" "$@"; }

# One weed mini per tool: NAME BUCKET. Leaves $work/weed-NAME/{pid,s3,metrics}.
start_weed() { weed_start "$work/weed-$1" "$2"; }
wait_weed() { # NAME BUCKET
    local d=$work/weed-$1
    py wait "http://127.0.0.1:$(cat "$d/s3")" "$2" "$(cat "$d/pid")" ||
        { tail -20 "$d/weed.log" >&2; exit 1; }
}
metrics() { py metrics "$(cat "$work/weed-$1/metrics")" "$2" "$3"; } # NAME BUCKET OUT

# A client command under /usr/bin/time -v: LABEL CMD... (output in log/LABEL.*)
timed() {
    local label=$1; shift
    if ! /usr/bin/time -v -o "$work/time/$label" "$@" >"$work/log/$label.out" 2>"$work/log/$label.err"; then
        echo "FAILED ($label): $*" >&2
        tail -20 "$work/log/$label.err" >&2
        if [ -n "$mount_pid" ]; then echo "the mount's stderr:" >&2; tail -20 "$work/log/oc-mount.err" >&2; fi
        exit 1
    fi
}

export AWS_ACCESS_KEY_ID=onecopybench AWS_SECRET_ACCESS_KEY=onecopybenchsecret AWS_REGION=us-east-1
export ONECOPY_PASSWORD=onecopy-bench-pass RESTIC_PASSWORD=restic-bench-pass
OB=onecopy-bench RB=restic-bench
load0=$(cut -d' ' -f1-3 /proc/loadavg)
log "work dir $work; starting two weed mini servers"
start_weed onecopy $OB
start_weed restic $RB
wait_weed onecopy $OB
wait_weed restic $RB
OE=http://127.0.0.1:$(cat "$work/weed-onecopy/s3")
RR=s3:http://127.0.0.1:$(cat "$work/weed-restic/s3")/$RB
RCACHE=$work/restic-cache

# The trees, oldest first; the newest VERSIONS are used.
mapfile -t trees < <(
    { ls -d "$HOME"/.pyenv/versions/*/lib/python3.* /usr/lib/python3.* 2>/dev/null || true; } |
    while read -r d; do [ -f "$d/os.py" ] && echo "$(basename "$d") $d"; done |
    sort -V -k1,1 -u | cut -d' ' -f2-)
[ "${#trees[@]}" -gt 0 ] || { echo "no Python standard library tree found" >&2; exit 1; }
[ "${#trees[@]}" -gt "$VERSIONS" ] && trees=("${trees[@]: -$VERSIONS}")
RSYNC_FILTER=(--exclude=/site-packages)
if [ -n "${TREE:-}" ]; then
    [ -d "$TREE" ] || { echo "TREE=$TREE is not a directory" >&2; exit 2; }
    trees=("$(realpath "$TREE")"); RSYNC_FILTER=()
fi
# SMALL: a few packages and the top-level modules of each version.
[ "$SMALL" = 1 ] && RSYNC_FILTER=(--include='/*.py' --include='/json/***' --include='/email/***'
    --include='/http/***' --exclude='*')
stage() { # VERSION: make $work/src/python version N
    local v=$1
    if [ "$v" -le "${#trees[@]}" ]; then
        rsync -a --delete "${RSYNC_FILTER[@]}" "${trees[$((v - 1))]}/" "$work/src/python/"
        echo "${trees[$((v - 1))]}"
    else
        python3 bench/mutate-tree.py "$work/src/python" "$v"
        echo "v$((v - 1)) changed by bench/mutate-tree.py $v"
    fi
}

STORE=$work/store
timed oc-init "$O" store init "$STORE" --remote "s3://$OB/onecopy" --endpoint "$OE" --chunking "$CHUNKING"
timed rs-init restic -r "$RR" --cache-dir "$RCACHE" init
restic_version=$(restic -r "$RR" --cache-dir "$RCACHE" cat config 2>/dev/null |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["version"])' || echo "?")

: > "$work/rows"
for v in $(seq 1 "$VERSIONS"); do
    what=$(stage "$v")
    files=$(find "$work/src/python" -type f | wc -l)
    mib=$(du -sm --apparent-size "$work/src/python" | cut -f1)
    log "v$v: $what ($files files, $mib MiB)"
    for tool in onecopy restic; do
        if [ $tool = onecopy ]; then b=$OB; else b=$RB; fi
        metrics $tool $b "$work/m/$tool-v$v.0"
        drop
        if [ $tool = onecopy ]; then
            timed "oc-v$v" "$O" store import "$STORE" "$work/src/python" --to "/v$v"
        else
            timed "rs-v$v" restic -r "$RR" --cache-dir "$RCACHE" backup -q "$work/src/python"
        fi
        metrics $tool $b "$work/m/$tool-v$v.1"
        if [ $tool = onecopy ]; then lbl=oc; else lbl=rs; fi
        read -r wall cpu rss < <(py time "$work/time/$lbl-v$v")
        echo "backup $tool v$v $files $mib $wall $cpu $rss $work/m/$tool-v$v.0 $work/m/$tool-v$v.1" >> "$work/rows"
        log "  $tool: ${wall}s wall, ${cpu}s CPU, ${rss} MiB"
    done
    echo "$what" > "$work/what-v$v"
done
last=$VERSIONS
py usage "$OE" $OB "$work/usage-onecopy.json"
py usage "http://127.0.0.1:$(cat "$work/weed-restic/s3")" $RB "$work/usage-restic.json"
# The store's metadata reserve (DIR/reserve, 4-64 MiB kept free for commits
# on a full disk) holds no data: left out, as in bench/snapshots.sh.
cache_mib=$(du -sm --exclude=reserve "$STORE" | cut -f1)
reserve_mib=$(du -sm "$STORE/reserve" 2>/dev/null | cut -f1 || echo 0)
rcache_mib=$(du -sm "$RCACHE" | cut -f1)

# Cold restore of the last version. restic: from an empty cache.
log "restore v$last: restic"
rm -rf "$RCACHE" "$work/out-restic"
metrics restic $RB "$work/m/restic-restore.0"
drop
timed rs-restore sh -c 'restic -r "$1" --cache-dir "$2" restore latest --target "$3" && sync' sh \
    "$RR" "$RCACHE" "$work/out-restic"
metrics restic $RB "$work/m/restic-restore.1"
read -r rwall rcpu rrss < <(py time "$work/time/rs-restore")
echo "restore restic v$last - - $rwall $rcpu $rrss $work/m/restic-restore.0 $work/m/restic-restore.1" >> "$work/rows"

# onecopy: the machine is gone (its cache removed); a new cache from
# the bucket, a mount, cp -a.
log "restore v$last: onecopy (recover, mount, cp -a)"
rm -rf "$STORE" "$work/out-onecopy"
mkdir -p "$MNT"
NEW=$work/newcache
metrics onecopy $OB "$work/m/onecopy-restore.0"
drop
t0=$(date +%s.%N)
timed oc-recover "$O" store init "$NEW" --recover --remote "s3://$OB/onecopy" --endpoint "$OE"
t1=$(date +%s.%N)
/usr/bin/time -v -o "$work/time/oc-mount" "$O" mount -f -o ro "$NEW" "$MNT" \
    >"$work/log/oc-mount.out" 2>"$work/log/oc-mount.err" &
mount_pid=$!
until grep -qs " $MNT " /proc/self/mountinfo; do
    kill -0 $mount_pid 2>/dev/null || { echo "FAILED: $O mount -f $NEW $MNT" >&2; cat "$work/log/oc-mount.err" >&2; exit 1; }
    sleep 0.05
done
t2=$(date +%s.%N)
# A read error is onecopy's to report, not the benchmark's to stop on: cp
# goes on past it, and the report counts the files it could not read.
cp_errors=0
/usr/bin/time -v -o "$work/time/oc-cp" sh -c 'cp -a "$1" "$2"; rc=$?; sync; exit $rc' sh \
    "$MNT/v$last/python" "$work/out-onecopy" >"$work/log/oc-cp.out" 2>"$work/log/oc-cp.err" || {
    cp_errors=$(grep -c '^cp: ' "$work/log/oc-cp.err" || true)
    echo "onecopy restore: cp -a out of the mount failed on $cp_errors files:" >&2
    head -5 "$work/log/oc-cp.err" >&2
}
t3=$(date +%s.%N)
metrics onecopy $OB "$work/m/onecopy-restore.1"
fusermount3 -u "$MNT"
wait $mount_pid || { echo "FAILED: $O mount -f $NEW $MNT exited $?" >&2; tail -20 "$work/log/oc-mount.err" >&2; exit 1; }
mount_pid=
read -r _ rc_cpu rc_rss < <(py time "$work/time/oc-recover")
read -r _ mt_cpu mt_rss < <(py time "$work/time/oc-mount")
read -r _ cp_cpu _ < <(py time "$work/time/oc-cp")
read -r t_rec t_mnt t_cp t_all < <(python3 -c "import sys; a,b,c,d=map(float,sys.argv[1:]); print(f'{b-a:.2f} {c-b:.2f} {d-c:.2f} {d-a:.2f}')" "$t0" "$t1" "$t2" "$t3")
ocpu=$(python3 -c "print(f'{$rc_cpu+$mt_cpu+$cp_cpu:.2f}')")
orss=$(( rc_rss > mt_rss ? rc_rss : mt_rss ))
echo "restore onecopy v$last - - $t_all $ocpu $orss $work/m/onecopy-restore.0 $work/m/onecopy-restore.1" >> "$work/rows"

# Both restores against the source (still in $work/src/python).
check() { py tree "$work/src/python" "$1"; }
ok_restic=$(check "$work/out-restic$work/src/python")
ok_onecopy=$(check "$work/out-onecopy")
[ "$cp_errors" = 0 ] || ok_onecopy="$ok_onecopy; cp -a failed to read $cp_errors files: $(head -3 "$work/log/oc-cp.err" | sed "s|$work/mnt/||g" | tr '\n' ' ')"

# The report.
results=bench/results/remote-$(date +%Y%m%d-%H%M%S).md
mkdir -p bench/results
python3 - "$work" "$VERSIONS" "$CHUNKING" "$restic_version" "$SMALL" "$cache_mib" "$rcache_mib" \
    "$ok_onecopy" "$ok_restic" "$reserve_mib" "$load0 / $(cut -d' ' -f1-3 /proc/loadavg)" "$t_rec" "$t_mnt" "$t_cp" "$rc_cpu" "$mt_cpu" "$cp_cpu" "$rc_rss" "$mt_rss" \
    "$("$O" --version)" "$(restic version | cut -d' ' -f1-2)" "$("$WEED" version 2>/dev/null | head -1)" <<'PY' | tee "$results"
import json, sys
(work, nv, chunking, rver, small, cache_mib, rcache_mib, ok_o, ok_r, reserve_mib, load, t_rec, t_mnt, t_cp,
 rc_cpu, mt_cpu, cp_cpu, rc_rss, mt_rss, over, rsver, wver) = sys.argv[1:]
def delta(a, b):
    a, b = json.load(open(a)), json.load(open(b))
    return {k: b.get(k, 0) - a.get(k, 0) for k in set(a) | set(b)}
rows = [l.split() for l in open(f"{work}/rows")]
mib = lambda b: b / 1048576
def ratio(o, r):
    return f"{o / r:.2f}" if r else "-"
print(f"## onecopy remote store vs restic, S3 (SeaweedFS weed mini on loopback), {nv} versions"
      + (" (SMALL)" if small == "1" else ""))
print()
print(f"{over}, `store init --remote --chunking {chunking}` (encrypted, default compression); "
      f"{rsver}, repository format {rver}; weed {wver}. Cache dropped before every timed command.")
print()
print("| version | tree | files | MiB | tool | wall s | CPU s | peak RSS MiB | server CPU s | PUT | other requests | MiB uploaded |")
print("|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|")
tot = {"onecopy": {}, "restic": {}}
for r in rows:
    kind, tool, ver, files, m, wall, cpu, rss, m0, m1 = r
    d = delta(m0, m1)
    other = sum(v for k, v in d.items() if k not in ("cpu", "rx", "tx", "PUT"))
    t = tot[tool].setdefault(kind, {"wall": 0, "cpu": 0, "rss": 0, "scpu": 0, "put": 0, "other": 0, "rx": 0, "tx": 0, "d": {}})
    t["wall"] += float(wall); t["cpu"] += float(cpu); t["rss"] = max(t["rss"], int(rss))
    t["scpu"] += d["cpu"]; t["put"] += d.get("PUT", 0); t["other"] += other
    t["rx"] += d["rx"]; t["tx"] += d["tx"]
    for k, v in d.items():
        t["d"][k] = t["d"].get(k, 0) + v
    if kind == "backup":
        what = open(f"{work}/what-{ver}").read().strip()
        print(f"| {ver} | {what} | {files} | {m} | {tool} | {wall} | {cpu} | {rss} | {d['cpu']:.2f} | "
              f"{d.get('PUT', 0)} | {other} | {mib(d['rx']):.1f} |")
u = {t: json.load(open(f"{work}/usage-{t}.json")) for t in ("onecopy", "restic")}
o, r = tot["onecopy"], tot["restic"]
ob, rb = o["backup"], r["backup"]
orr, rr = o["restore"], r["restore"]
print()
print("| all versions | onecopy | restic | onecopy / restic |")
print("|---|---:|---:|---:|")
def row(name, a, b, fmt="{:.2f}"):
    print(f"| {name} | {fmt.format(a)} | {fmt.format(b)} | {ratio(a, b)} |")
row("backup wall s (sum)", ob["wall"], rb["wall"])
row("backup CPU s (sum, client)", ob["cpu"], rb["cpu"])
row("backup peak RSS MiB (max)", ob["rss"], rb["rss"], "{}")
row("server CPU s during backups", ob["scpu"], rb["scpu"])
row("MiB uploaded (received by the server)", mib(ob["rx"]), mib(rb["rx"]), "{:.1f}")
row("bytes in bucket", u["onecopy"]["bytes"], u["restic"]["bytes"], "{:,}")
row("objects in bucket", u["onecopy"]["objects"], u["restic"]["objects"], "{}")
row("PUT requests", ob["put"], rb["put"], "{}")
row("other requests (GET, HEAD, LIST, DELETE...)", ob["other"], rb["other"], "{}")
row("local cache MiB after the backups (onecopy: without its reserve)", int(cache_mib), int(rcache_mib), "{}")
row(f"cold restore of v{nv}: wall s", orr["wall"], rr["wall"])
row(f"cold restore of v{nv}: CPU s (client)", orr["cpu"], rr["cpu"])
row(f"cold restore of v{nv}: peak RSS MiB", orr["rss"], rr["rss"], "{}")
row("restore: GET requests", orr["d"].get("GET", 0), rr["d"].get("GET", 0), "{}")
row("restore: MiB received from the server", mib(orr["tx"]), mib(rr["tx"]), "{:.1f}")
row("restore: server CPU s", orr["scpu"], rr["scpu"])
print()
for t in ("onecopy", "restic"):
    ks = ", ".join(f"{k} {v[0]} ({mib(v[1]):.1f} MiB)" for k, v in sorted(u[t]["kinds"].items()))
    print(f"- {t}'s bucket: {ks}")
    print(f"- {t}'s requests, backups: " + ", ".join(f"{k} {v}" for k, v in sorted(tot[t]['backup']['d'].items()) if k not in ('cpu', 'rx', 'tx') and v)
          + "; restore: " + ", ".join(f"{k} {v}" for k, v in sorted(tot[t]['restore']['d'].items()) if k not in ('cpu', 'rx', 'tx') and v))
print(f"- onecopy restore = `store init --recover` {t_rec} s (CPU {rc_cpu} s, {rc_rss} MiB) + mount until "
      f"it shows in mountinfo {t_mnt} s + `cp -a` out of it and sync {t_cp} s (cp's CPU {cp_cpu} s; "
      f"the mount's CPU {mt_cpu} s, peak RSS {mt_rss} MiB, until unmounted); restic = "
      f"`restic restore latest` and sync, from an empty cache.")
print(f"- restored v{nv} against its source: onecopy {ok_o}; restic {ok_r}.")
print(f"- onecopy's local cache keeps uploaded containers up to its bound (--cache-size, default 4 GiB); "
      f"its metadata reserve ({reserve_mib} MiB) is not counted. restic's cache holds its index and snapshots.")
print("- PUT and other request counts are the server's own (SeaweedFS_s3_request_total); objects in "
      "bucket are what is left (onecopy replaces its `manifest` at each push, restic makes and deletes "
      "lock files). Server CPU from the server's process_cpu_seconds_total.")
print(f"- load average (1, 5, 15 min) at start / end: {load}")
PY
log "saved $results"
# A restore that does not match its source fails the run (after the report).
[[ $ok_onecopy == identical* && $ok_restic == identical* ]] || { log "a restore differs from its source"; exit 1; }
