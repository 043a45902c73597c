#!/usr/bin/env python3
"""Driver of bench/store-soak.sh (issue 11, resource bounds).

Phases on a mounted store (the mount process is --pid):
  create   --files files in 1000 directories (0-4 KiB each, a few larger)
  mixed    --duration seconds of reads (checked), writes (new files),
           overwrites, appends, renames (across directories), unlinks,
           fsyncs and an online `store gc` every --gc-every seconds
  samples  every 10 s: the mount's VmRSS, VmHWM and open descriptors
  latency  per minute: p50/p99/p99.9 of all operations and of each kind

Every file's content is a function of (id, gen, offset), kept in arrays
(the independent record): file `id` holds the token `<id.gen>` repeated,
so any byte that was never written to that file is found. Each read
checks the whole file against the record. Lines of JSON go to --out
(`kind` = sample | minute | gc | phase | error); the final check (after a
remount) is done by `--check`.
"""
import argparse
import array
import json
import os
import random
import subprocess
import sys
import threading
import time

DIRS = 1000


def token(i, gen):
    return b"<%d.%d>" % (i, gen)


def content(i, gen, start, end):
    """Bytes [start, end) of file i at generation gen."""
    t = token(i, gen)
    n = len(t)
    reps = (end // n) + 2
    return (t * reps)[start:end] if start < end else b""


class Record:
    """What each file must hold: gen, size, rename count, alive."""

    def __init__(self, cap):
        self.gen = array.array("I", [0]) * cap
        self.size = array.array("I", [0]) * cap
        self.ren = array.array("I", [0]) * cap
        self.alive = bytearray(cap)
        self.n = 0  # ids < n have been used

    def path(self, mnt, i):
        r = self.ren[i]
        d = (i + r * 7) % DIRS
        return "%s/d%03d/f%d%s" % (mnt, d, i, ".r%d" % r if r else "")

    def save(self, fname):
        with open(fname, "wb") as f:
            f.write(json.dumps({"n": self.n}).encode() + b"\n")
            for a in (self.gen, self.size, self.ren):
                a[: self.n].tofile(f)
            f.write(bytes(self.alive[: self.n]))

    @classmethod
    def load(cls, fname):
        with open(fname, "rb") as f:
            n = json.loads(f.readline())["n"]
            r = cls(n)
            r.n = n
            for a in (r.gen, r.size, r.ren):
                b = array.array("I")
                b.fromfile(f, n)
                a[:n] = b
            r.alive[:n] = f.read(n)
        return r


def pick_size(rng):
    x = rng.random()
    if x < 0.9:
        return rng.randrange(0, 4096)
    if x < 0.99:
        return rng.randrange(4096, 128 * 1024)
    return rng.randrange(128 * 1024, 2 * 1024 * 1024)


def write_file(path, i, gen, size, fsync):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        data = content(i, gen, 0, size)
        if data:
            os.write(fd, data)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def read_check(rec, mnt, i):
    p = rec.path(mnt, i)
    with open(p, "rb") as f:
        got = f.read()
    want = content(i, rec.gen[i], 0, rec.size[i])
    if got != want:
        bad = next((k for k in range(min(len(got), len(want))) if got[k] != want[k]), None)
        raise AssertionError(
            "%s: %d bytes, want %d (gen %d), first difference at %s"
            % (p, len(got), len(want), rec.gen[i], bad)
        )


class Out:
    def __init__(self, fname):
        self.f = open(fname, "a", buffering=1)
        self.lock = threading.Lock()

    def emit(self, **kw):
        kw.setdefault("t", round(time.time(), 3))
        with self.lock:
            self.f.write(json.dumps(kw) + "\n")


def sample(pid):
    st = {}
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "VmHWM", "Threads"):
                st[k] = int(v.split()[0])
    st["fds"] = len(os.listdir("/proc/%d/fd" % pid))
    return st


def sampler(pid, out, stop, phase):
    while not stop.wait(10):
        try:
            out.emit(kind="sample", phase=phase[0], **sample(pid))
        except OSError as e:
            out.emit(kind="error", what="sample", err=str(e))
            return


def pct(xs, q):
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


class Lat:
    """Latencies (µs) of the current minute, per kind."""

    def __init__(self, out):
        self.out, self.m, self.start = out, {}, time.time()
        self.minute = 0

    def add(self, kind, us):
        now = time.time()
        if now - self.start >= 60:
            self.flush()
            self.start = now
        self.m.setdefault(kind, []).append(us)

    def flush(self):
        allx = [x for v in self.m.values() for x in v]
        row = {"minute": self.minute, "ops": len(allx)}
        for k, v in [("all", allx)] + sorted(self.m.items()):
            row[k] = [len(v), pct(v, 0.5), pct(v, 0.99), pct(v, 0.999)]
        self.out.emit(kind="minute", **row)
        self.minute += 1
        self.m = {}


def create_phase(rec, args, rng, out):
    for d in range(DIRS):
        os.makedirs("%s/d%03d" % (args.mnt, d), exist_ok=True)
    t0 = time.time()
    for i in range(args.files):
        size = pick_size(rng) if rng.random() < 0.1 else rng.randrange(0, 1024)
        write_file(rec.path(args.mnt, i), i, 0, size, False)
        rec.size[i] = size
        rec.alive[i] = 1
        rec.n = i + 1
        if (i + 1) % 100000 == 0:
            out.emit(kind="phase", phase="create", files=i + 1, secs=round(time.time() - t0, 1))
    os.sync()
    out.emit(kind="phase", phase="created", files=args.files, secs=round(time.time() - t0, 1))


def live_id(rec, rng):
    for _ in range(100):
        i = rng.randrange(rec.n)
        if rec.alive[i]:
            return i
    return None


def op_read(rec, args, rng):
    i = live_id(rec, rng)
    if i is not None:
        read_check(rec, args.mnt, i)


def op_create(rec, args, rng):
    i = rec.n
    if i >= len(rec.gen):
        return
    size = pick_size(rng)
    write_file(rec.path(args.mnt, i), i, 0, size, rng.random() < 0.2)
    rec.size[i], rec.alive[i], rec.n = size, 1, i + 1


def op_overwrite(rec, args, rng):
    i = live_id(rec, rng)
    if i is None:
        return
    gen, size = rec.gen[i] + 1, pick_size(rng)
    write_file(rec.path(args.mnt, i), i, gen, size, rng.random() < 0.2)
    rec.gen[i], rec.size[i] = gen, size


def op_append(rec, args, rng):
    i = live_id(rec, rng)
    if i is None:
        return
    old = rec.size[i]
    new = min(old + rng.randrange(1, 65536), 8 * 1024 * 1024)
    fd = os.open(rec.path(args.mnt, i), os.O_WRONLY | os.O_APPEND)
    try:
        os.write(fd, content(i, rec.gen[i], old, new))
    finally:
        os.close(fd)
    rec.size[i] = new


def op_fsync(rec, args, rng):
    i = live_id(rec, rng)
    if i is None:
        return
    fd = os.open(rec.path(args.mnt, i), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def op_rename(rec, args, rng):
    i = live_id(rec, rng)
    if i is None:
        return
    src = rec.path(args.mnt, i)
    rec.ren[i] += 1
    os.rename(src, rec.path(args.mnt, i))


def op_unlink(rec, args, rng):
    i = live_id(rec, rng)
    if i is None:
        return
    os.unlink(rec.path(args.mnt, i))
    rec.alive[i] = 0


OPS = [
    ("read", op_read, 40),
    ("create", op_create, 10),
    ("overwrite", op_overwrite, 15),
    ("append", op_append, 10),
    ("fsync", op_fsync, 5),
    ("rename", op_rename, 10),
    ("unlink", op_unlink, 10),
]


def online_gc(args, out):
    t0 = time.time()
    p = subprocess.run([args.onecopy, "store", "gc", args.store], capture_output=True, text=True)
    out.emit(kind="gc", rc=p.returncode, secs=round(time.time() - t0, 2),
             stdout=p.stdout[-300:], stderr=p.stderr[-300:])
    if p.returncode != 0 or "panicked" in p.stderr:
        raise AssertionError("online gc exited %d: %s" % (p.returncode, p.stderr))


def mixed_phase(rec, args, rng, out):
    lat = Lat(out)
    kinds = [k for k, _, w in OPS for _ in range(w)]
    fns = {k: f for k, f, _ in OPS}
    t0 = last_gc = time.time()
    n = 0
    while time.time() - t0 < args.duration:
        if time.time() - last_gc >= args.gc_every:
            online_gc(args, out)
            last_gc = time.time()
        k = rng.choice(kinds)
        s = time.perf_counter()
        fns[k](rec, args, rng)
        lat.add(k, int((time.perf_counter() - s) * 1e6))
        n += 1
    lat.flush()
    out.emit(kind="phase", phase="mixed-done", ops=n, secs=round(time.time() - t0, 1))


def check(args, out):
    """After a remount: a sample of live files reads exactly; removed names are gone."""
    rec = Record.load(args.record)
    rng = random.Random(args.seed + 1)
    ids = [i for i in range(rec.n) if rec.alive[i]]
    dead = [i for i in range(rec.n) if not rec.alive[i]]
    sample_ids = rng.sample(ids, min(args.check_sample, len(ids)))
    for i in sample_ids:
        read_check(rec, args.mnt, i)
    for i in rng.sample(dead, min(2000, len(dead))):
        if os.path.lexists(rec.path(args.mnt, i)):
            raise AssertionError("unlinked %s exists" % rec.path(args.mnt, i))
    names = sum(len(os.listdir("%s/d%03d" % (args.mnt, d))) for d in range(DIRS))
    if names != len(ids):
        raise AssertionError("%d names in the tree, record has %d live files" % (names, len(ids)))
    out.emit(kind="phase", phase="checked", sample=len(sample_ids), live=len(ids), names=names)


def summary(args):
    """Bounds and drift from the log: RSS/fds over the mixed phase, first vs last 10 minutes."""
    rows = [json.loads(line) for line in open(args.out)]
    samples = [r for r in rows if r["kind"] == "sample"]
    mixed = [r for r in samples if r["phase"] in ("mixed", "end")] or samples
    mins = [r for r in rows if r["kind"] == "minute" and r["ops"] > 0]
    gcs = [r for r in rows if r["kind"] == "gc"]
    created = [r for r in rows if r.get("phase") == "created"]
    print("## store soak summary (%s)" % args.out)
    for r in rows:
        if r.get("phase") in ("checked", "mixed-done"):
            print({k: v for k, v in r.items() if k not in ("kind", "t")})
    if created:
        print("create: %d files in %.0f s" % (created[0]["files"], created[0]["secs"]))
    for name, rs in (("all samples", samples), ("mixed phase", mixed)):
        rss = [r["VmRSS"] for r in rs]
        fds = [r["fds"] for r in rs]
        print("%s (%d): VmRSS min %d max %d KiB, VmHWM %d KiB, fds min %d max %d, threads max %d"
              % (name, len(rs), min(rss), max(rss), max(r["VmHWM"] for r in rs),
                 min(fds), max(fds), max(r.get("Threads", 0) for r in rs)))
    if len(mixed) >= 4:
        q = len(mixed) // 4
        a = sum(r["VmRSS"] for r in mixed[:q]) / q
        b = sum(r["VmRSS"] for r in mixed[-q:]) / q
        print("VmRSS mean first quarter %.0f KiB, last quarter %.0f KiB" % (a, b))
    print("online gc: %d runs, exit codes %s, max %.1f s"
          % (len(gcs), sorted(set(r["rc"] for r in gcs)), max([r["secs"] for r in gcs] or [0])))
    w = min(10, len(mins) // 2)
    if w:
        print("| minutes | ops/min | p50 µs | p99 µs | p99.9 µs |")
        print("|---|---:|---:|---:|---:|")
        for label, part in (("first %d" % w, mins[:w]), ("last %d" % w, mins[-w:])):
            med = lambda k: sorted(r["all"][k] for r in part)[len(part) // 2]
            print("| %s | %d | %d | %d | %d |" % (label, sum(r["ops"] for r in part) / len(part),
                                                med(1), med(2), med(3)))
        print("(median over the minutes of each minute's percentile, all operations)")
        kinds = [k for k in mins[0] if isinstance(mins[0][k], list) and k != "all"]
        for k in kinds:
            f = [r[k][2] for r in mins[:w] if k in r]
            l = [r[k][2] for r in mins[-w:] if k in r]
            if f and l:
                print("  %s p99 first %d last %d µs" % (k, sorted(f)[len(f) // 2], sorted(l)[len(l) // 2]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mnt")
    ap.add_argument("--store")
    ap.add_argument("--onecopy")
    ap.add_argument("--pid", type=int)
    ap.add_argument("--files", type=int, default=1000000)
    ap.add_argument("--duration", type=float, default=3600)
    ap.add_argument("--gc-every", type=float, default=300)
    ap.add_argument("--seed", type=int, default=int(time.time()))
    ap.add_argument("--out", required=True)
    ap.add_argument("--record")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--check-sample", type=int, default=20000)
    ap.add_argument("--summary", action="store_true")
    args = ap.parse_args()
    if args.summary:
        summary(args)
        return
    out = Out(args.out)
    if args.check:
        check(args, out)
        return
    out.emit(kind="phase", phase="start", seed=args.seed, files=args.files, duration=args.duration)
    rng = random.Random(args.seed)
    rec = Record(args.files + 4000000)
    stop, phase = threading.Event(), ["create"]
    th = threading.Thread(target=sampler, args=(args.pid, out, stop, phase), daemon=True)
    out.emit(kind="sample", phase="start", **sample(args.pid))
    th.start()
    try:
        create_phase(rec, args, rng, out)
        out.emit(kind="sample", phase="created", **sample(args.pid))
        phase[0] = "mixed"
        mixed_phase(rec, args, rng, out)
        out.emit(kind="sample", phase="end", **sample(args.pid))
    finally:
        stop.set()
        rec.save(args.record)


if __name__ == "__main__":
    try:
        main()
    except Exception as e:  # reported in the log, exit 1
        print("store-soak: %s" % e, file=sys.stderr)
        sys.exit(1)
