#!/usr/bin/env python3
"""onecopy benchmark harness: onecopy against duperemove, jdupes, rmlint and
fclones on a fresh loop-mounted btrfs or XFS per tool.

Usage: bench/run.sh WORKLOAD FS [options]   (see --help and bench/README.md)

Python 3 standard library only. Needs root (loop devices, mount,
drop_caches).
"""

import argparse
import atexit
import datetime as dt
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "bench", "results")
GIB = 1 << 30
MIB = 1 << 20
MAX_IMAGE = 12 * GIB
BUILD_NOTES = []
WORKLOADS = ["small", "dupes", "near", "shifted", "many", "chains", "pieces"]
ALL_TOOLS = ["onecopy", "duperemove", "duperemove-partial", "jdupes", "rmlint", "fclones"]
APT_TOOLS = {
    "mkfs.btrfs": "btrfs-progs",
    "btrfs": "btrfs-progs",
    "mkfs.xfs": "xfsprogs",
    "duperemove": "duperemove",
    "jdupes": "jdupes",
    "rmlint": "rmlint",
    "/usr/bin/time": "time",
}


def log(msg):
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def parse_size(s):
    t = s.strip().lower().replace("ib", "").replace("b", "")
    mult = 1
    for suf, m in (("k", 1 << 10), ("m", 1 << 20), ("g", 1 << 30), ("t", 1 << 40)):
        if t.endswith(suf):
            t, mult = t[: -len(suf)], m
            break
    return int(float(t) * mult)


def human(n):
    if n is None:
        return "n/a"
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, m in (("GiB", GIB), ("MiB", MIB), ("KiB", 1 << 10)):
        if n >= m:
            return f"{sign}{n / m:.2f} {unit}"
    return f"{sign}{n} B"


def run(cmd, check=True, **kw):
    """Runs a command (list), returns CompletedProcess with text output."""
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if check and r.returncode != 0:
        raise RuntimeError(f"`{shlex.join(cmd)}` failed ({r.returncode}): {r.stderr.strip()}")
    return r


# --------------------------------------------------------------------------
# Cleanup: every mount, loop device and image we create is registered here
# and torn down on exit, error or signal.


def mounts_under(path):
    """Mount points at or below `path` (from /proc/self/mounts)."""
    path = os.path.realpath(path)
    out = []
    with open("/proc/self/mounts") as f:
        for line in f:
            mp = line.split()[1].encode().decode("unicode_escape")
            if mp == path or mp.startswith(path + "/"):
                out.append(mp)
    return out


class Cleanup:
    def __init__(self):
        self.mounts = []  # mount points, unmounted in reverse order
        self.loops = []  # loop devices we attached
        self.paths = []  # files/dirs to delete

    def unmount(self, mnt):
        for attempt in range(20):
            if not os.path.ismount(mnt):
                break
            if run(["umount", mnt], check=False).returncode == 0:
                break
            time.sleep(0.2 * (attempt + 1))
        if os.path.ismount(mnt):
            run(["umount", "-l", mnt], check=False)
        if mnt in self.mounts:
            self.mounts.remove(mnt)

    def detach(self, dev):
        run(["losetup", "-d", dev], check=False)
        if dev in self.loops:
            self.loops.remove(dev)

    def remove(self, path):
        if os.path.isdir(path):
            if mounts_under(path):
                log(f"not removing {path}: still has mounts {mounts_under(path)}")
                return
            shutil.rmtree(path, ignore_errors=True)
        elif os.path.exists(path):
            os.unlink(path)
        if path in self.paths:
            self.paths.remove(path)

    def all(self):
        for m in reversed(list(self.mounts)):
            self.unmount(m)
        for d in reversed(list(self.loops)):
            self.detach(d)
        for p in reversed(list(self.paths)):
            self.remove(p)


CLEAN = Cleanup()
atexit.register(CLEAN.all)


def on_signal(signum, _frame):
    log(f"signal {signum}: cleaning up")
    raise SystemExit(128 + signum)


for _sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(_sig, on_signal)


# --------------------------------------------------------------------------
# Filesystems


class LoopFs:
    """A fresh image + loop device + filesystem, mounted with noatime."""

    def __init__(self, workdir, fs, size, direct_io=True):
        self.fs = fs
        self.image = os.path.join(workdir, f"{fs}.img")
        self.mnt = os.path.join(workdir, "mnt")
        os.makedirs(self.mnt, exist_ok=True)
        CLEAN.paths.append(self.image)
        with open(self.image, "wb") as f:
            f.truncate(size)
        if fs == "btrfs":
            run(["mkfs.btrfs", "-q", "-f", self.image])
        elif fs == "xfs":
            run(["mkfs.xfs", "-q", "-f", "-m", "reflink=1", self.image])
        else:
            raise ValueError(fs)
        cmd = ["losetup", "--find", "--show"]
        if direct_io:
            cmd.append("--direct-io=on")
        r = run(cmd + [self.image], check=False)
        if r.returncode != 0 and direct_io:
            log("losetup --direct-io=on failed, falling back to buffered loop")
            r = run(["losetup", "--find", "--show", self.image])
        elif r.returncode != 0:
            raise RuntimeError(r.stderr)
        self.dev = r.stdout.strip()
        CLEAN.loops.append(self.dev)
        run(["mount", "-o", "noatime", self.dev, self.mnt])
        CLEAN.mounts.append(self.mnt)
        self.data = os.path.join(self.mnt, "data")

    def sync(self):
        run(["sync", "-f", self.mnt])
        if self.fs == "btrfs":
            for _ in range(2):
                run(["btrfs", "filesystem", "sync", self.mnt])

    def used(self):
        """Used bytes (statvfs blocks - free) once writeback and the
        filesystem's deferred frees have settled."""
        self.sync()
        time.sleep(1)
        self.sync()
        st = os.statvfs(self.mnt)
        return (st.f_blocks - st.f_bfree) * st.f_frsize

    def destroy(self):
        CLEAN.unmount(self.mnt)
        CLEAN.detach(self.dev)
        CLEAN.remove(self.image)


def drop_caches():
    run(["sync"])
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


# --------------------------------------------------------------------------
# Setup: packages, builds


def ensure_packages(no_install):
    missing = sorted({pkg for exe, pkg in APT_TOOLS.items() if not shutil.which(exe)})
    if missing:
        if no_install:
            log(f"missing packages (not installing): {' '.join(missing)}")
        else:
            log(f"installing: {' '.join(missing)}")
            subprocess.run(["apt-get", "install", "-y"] + missing, check=False)
    if not shutil.which("fclones"):
        cargo_bin = os.path.expanduser("~/.cargo/bin")
        if os.path.exists(os.path.join(cargo_bin, "fclones")):
            os.environ["PATH"] += os.pathsep + cargo_bin
        elif not no_install and shutil.which("cargo"):
            log("installing fclones with `cargo install fclones` (skip with --no-install)")
            subprocess.run(["cargo", "install", "fclones"], check=False)
            os.environ["PATH"] += os.pathsep + cargo_bin


def target_dir():
    return os.environ.get("CARGO_TARGET_DIR") or os.path.join(REPO, "target")


def build(args):
    tdir = target_dir()
    workload = os.path.join(tdir, "release", "onecopy-workload")
    onecopy = args.onecopy or os.path.join(tdir, "release", "onecopy")
    if not args.no_build:
        log("building onecopy-workload (release)")
        r = subprocess.run(["cargo", "build", "--release", "-p", "onecopy-workload"], cwd=REPO)
        if r.returncode != 0:
            sys.exit("cannot build onecopy-workload")
        if not args.onecopy:
            log("building onecopy (release)")
            r = subprocess.run(["cargo", "build", "--release", "-p", "onecopy"], cwd=REPO)
            if r.returncode != 0:
                if os.path.exists(onecopy):
                    log(f"building onecopy FAILED; using the existing (possibly stale) {onecopy}")
                    BUILD_NOTES.append("onecopy build failed; an existing, possibly stale binary was used")
                else:
                    log("building onecopy FAILED; its row will say so")
    if not os.path.exists(workload):
        sys.exit(f"{workload} missing (build with cargo build --release -p onecopy-workload)")
    return workload, onecopy


def tool_version(tool, onecopy):
    cmds = {
        "onecopy": [onecopy, "--version"],
        "duperemove": ["duperemove", "--version"],
        "duperemove-partial": ["duperemove", "--version"],
        "jdupes": ["jdupes", "-v"],
        "rmlint": ["rmlint", "--version"],
        "fclones": ["fclones", "--version"],
    }
    try:
        r = subprocess.run(cmds[tool], capture_output=True, text=True, timeout=10)
        out = (r.stdout or r.stderr).strip().splitlines()
        return out[0].strip() if out else "?"
    except (OSError, subprocess.SubprocessError):
        return None


# --------------------------------------------------------------------------
# Tools


_HELP = {}


def onecopy_supports(onecopy, flag):
    """Whether `onecopy dedupe --help` mentions `flag` (the CLI evolves)."""
    if onecopy not in _HELP:
        try:
            r = subprocess.run([onecopy, "dedupe", "--help"], capture_output=True, text=True, timeout=10)
            _HELP[onecopy] = r.stdout + r.stderr
        except (OSError, subprocess.SubprocessError):
            _HELP[onecopy] = ""
    return flag in _HELP[onecopy]


def tool_command(tool, data, scratch, onecopy):
    """The shell-free argv (or ['sh','-c',...] for pipelines) to run a tool
    on `data`. `scratch` is a host directory for hashfiles and scripts, kept
    outside the measured filesystem."""
    q = shlex.quote
    if tool == "onecopy":
        # A private catalog beside duperemove's hashfile: nothing leaks
        # between cells or into /var/cache/onecopy; the rerun reuses it.
        for flag in ("--catalog", "--hashfile"):
            if onecopy_supports(onecopy, flag + " "):
                return [onecopy, "dedupe", "--json", f"{flag}={scratch}/onecopy-catalog.sqlite", data]
        return [onecopy, "dedupe", "--json", data]
    if tool == "duperemove":
        return ["duperemove", "-dr", f"--hashfile={scratch}/duperemove.hash", data]
    if tool == "duperemove-partial":
        return [
            "duperemove", "-dr", "-b4096", "--dedupe-options=partial",
            f"--hashfile={scratch}/duperemove-partial.hash", data,
        ]
    if tool == "jdupes":
        return ["jdupes", "-rB", data]
    if tool == "rmlint":
        # -T df: duplicate files; the clone handler makes the script call
        # `rmlint --dedupe ORIG DUP` (FIDEDUPERANGE) once per duplicate.
        script = f"{scratch}/rmlint.sh"
        return [
            "sh", "-c",
            f"rmlint -T df --algorithm=highway256 -o sh:{q(script)} "
            f"-o json:{q(scratch)}/rmlint.json -c sh:handler=clone {q(data)} "
            f"&& sh {q(script)} -d -q",
        ]
    if tool == "fclones":
        return ["sh", "-c", f"fclones group {q(data)} | fclones dedupe"]
    raise ValueError(tool)


def parse_json_output(text):
    """The JSON object a tool printed: the whole output, else its last
    line (for tools that print progress lines first)."""
    if not text:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return json.loads(text.splitlines()[-1])


def interpret_status(tool, t, stderr_path):
    """duperemove exits 22 (EINVAL) when it finds nothing to dedupe."""
    if tool.startswith("duperemove") and t["rc"] == 22:
        try:
            with open(stderr_path, errors="replace") as f:
                if "No dedupe candidates" in f.read():
                    return "ok (no candidates)"
        except OSError:
            pass
    return t["status"]


def timed(cmd, stdout_path, stderr_path, cwd, timeout):
    """Runs cmd under /usr/bin/time; returns dict(wall, user, sys, rss_kib,
    rc, status)."""
    tfile = stderr_path + ".time"
    full = ["/usr/bin/time", "-f", "%e %U %S %M", "-o", tfile, "--"] + cmd
    with open(stdout_path, "w") as out, open(stderr_path, "w") as err:
        p = subprocess.Popen(full, stdout=out, stderr=err, cwd=cwd, start_new_session=True)
        try:
            rc = p.wait(timeout=timeout)
            status = "ok" if rc == 0 else f"exit {rc}"
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            rc, status = None, f"timeout {timeout}s"
    res = {"rc": rc, "status": status, "wall": None, "user": None, "sys": None, "rss_kib": None}
    try:
        with open(tfile) as f:
            line = [l for l in f.read().splitlines() if l.strip()][-1]
        # A failing command makes time print "Command exited with non-zero
        # status N" before the format line.
        wall, user, sys_, rss = line.split()
        res.update(wall=float(wall), user=float(user), sys=float(sys_), rss_kib=int(rss))
    except (OSError, IndexError, ValueError):
        pass
    return res


# --------------------------------------------------------------------------
# Sizing


def image_size(args, fs):
    if args.image_size:
        return parse_size(args.image_size)
    size = parse_size(args.size) if args.size else None
    files = args.files
    w = args.workload
    if w == "small":
        need = (files or 100_000) * 8 * 1024 + GIB
    elif w == "many":
        need = (files or 1_000_000) * 12 * 1024 + 2 * GIB
    else:
        default = 2 * GIB if w == "dupes" else GIB
        need = int((size or default) * 1.3) + GIB
    need = max(need, 2 * GIB)
    if need > MAX_IMAGE:
        log(f"workload needs ~{human(need)}; capping the image at {human(MAX_IMAGE)}")
        need = MAX_IMAGE
    return need


# --------------------------------------------------------------------------
# One measurement cell


def generate(args, workload_bin, lfs):
    cmd = [workload_bin, args.workload, "--dir", lfs.data, "--seed", str(args.seed)]
    if args.size:
        cmd += ["--size", args.size]
    if args.files:
        cmd += ["--files", str(args.files)]
    t0 = time.time()
    r = run(cmd)
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    summary["generate_wall"] = round(time.time() - t0, 2)
    return summary


def fresh(args, workload_bin, workdir, size):
    lfs = LoopFs(workdir, args.fs, size, direct_io=not args.no_direct_io)
    try:
        summary = generate(args, workload_bin, lfs)
    except BaseException:
        lfs.destroy()
        raise
    return lfs, summary


def measure_tool(args, tool, workload_bin, onecopy, workdir, size, stamp):
    row_base = {"tool": tool}
    if tool == "onecopy" and not os.path.exists(onecopy):
        msg = f"{onecopy} missing: build it with `cargo build --release -p onecopy`"
        log(msg)
        return [dict(row_base, run=1, status="missing", note=msg)], None
    exe = {"duperemove-partial": "duperemove"}.get(tool, tool)
    if tool != "onecopy" and not shutil.which(exe):
        msg = f"{exe} not installed; skipped"
        log(msg)
        return [dict(row_base, run=1, status="missing", note=msg)], None

    scratch = tempfile.mkdtemp(prefix=f"{tool}-", dir=workdir)
    CLEAN.paths.append(scratch)
    log(f"{tool}: fresh {args.fs} ({human(size)}), generating {args.workload}")
    lfs, summary = fresh(args, workload_bin, workdir, size)
    rows = []
    try:
        used = lfs.used()
        first_used = used
        runs = 2 if args.rerun else 1
        for n in range(1, runs + 1):
            drop_caches()
            cmd = tool_command(tool, lfs.data, scratch, onecopy)
            base = os.path.join(RESULTS, f"{stamp}-{tool}-run{n}")
            out_path = base + (".json" if tool == "onecopy" else ".out")
            log(f"{tool} run {n}: {shlex.join(cmd)}")
            t = timed(cmd, out_path, base + ".err", scratch, args.timeout)
            after = lfs.used()
            row = dict(
                row_base,
                run=n,
                status=interpret_status(tool, t, base + ".err"),
                wall=t["wall"],
                cpu=None if t["user"] is None else round(t["user"] + t["sys"], 2),
                user=t["user"],
                sys=t["sys"],
                rss_mib=None if t["rss_kib"] is None else round(t["rss_kib"] / 1024, 1),
                used_before=used,
                used_after=after,
                freed=used - after,
                command=shlex.join(cmd),
                stdout=os.path.relpath(out_path, REPO),
                stderr=os.path.relpath(base + ".err", REPO),
            )
            if tool == "onecopy":
                try:
                    with open(out_path) as f:
                        text = f.read().strip()
                    row["report"] = parse_json_output(text)
                except (OSError, ValueError, IndexError) as e:
                    row["report"] = None
                    row["note"] = f"--json output unparsable: {e}"
            rows.append(row)
            used = after
        rows[0]["total_freed"] = first_used - used
    finally:
        lfs.destroy()
        CLEAN.remove(scratch)
    return rows, summary


def measure_baselines(args, workload_bin, workdir, size, stamp):
    log(f"baselines: fresh {args.fs}, generating {args.workload}")
    lfs, summary = fresh(args, workload_bin, workdir, size)
    rows = []
    try:
        lfs.used()
        q = shlex.quote(lfs.data)
        for name, script in (
            ("find-stat", f"find {q} -printf '%s\\n' > /dev/null"),
            ("read-all", f"find {q} -type f -print0 | xargs -0 -r cat > /dev/null"),
        ):
            drop_caches()
            base = os.path.join(RESULTS, f"{stamp}-{name}")
            t = timed(["sh", "-c", script], base + ".out", base + ".err", workdir, args.timeout)
            rows.append(
                dict(
                    tool=name,
                    run=1,
                    status=t["status"],
                    wall=t["wall"],
                    cpu=None if t["user"] is None else round(t["user"] + t["sys"], 2),
                    rss_mib=None if t["rss_kib"] is None else round(t["rss_kib"] / 1024, 1),
                    freed=None,
                    command=script,
                )
            )
    finally:
        lfs.destroy()
    return rows, summary


# --------------------------------------------------------------------------
# Report


def fmt(v, digits=2):
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def ratio(a, b):
    if a is None or b is None or b == 0:
        return None
    return a / b


def table(rows):
    ref = {r["run"]: r for r in rows if r["tool"] == "onecopy" and r.get("wall") is not None}
    head = ("| tool | run | wall s | cpu s | peak RSS MiB | freed | wall / onecopy "
            "| freed / onecopy | status |")
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        o = ref.get(r.get("run", 1))
        wall_r = ratio(r.get("wall"), o and o.get("wall"))
        freed_r = ratio(r.get("freed"), o and o.get("freed"))
        lines.append(
            "| {tool} | {run} | {wall} | {cpu} | {rss} | {freed} | {wr} | {fr} | {st} |".format(
                tool=r["tool"],
                run=r.get("run", 1),
                wall=fmt(r.get("wall")),
                cpu=fmt(r.get("cpu")),
                rss=fmt(r.get("rss_mib"), 1),
                freed="—" if r.get("freed") is None and r.get("status") == "ok" else human(r.get("freed")),
                wr="n/a" if wall_r is None else f"{wall_r:.2f}x",
                fr="n/a" if freed_r is None else f"{freed_r:.2f}x",
                st=r.get("status", "?"),
            )
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(
        prog="bench/run.sh",
        description="Benchmark onecopy against peer dedupers on a fresh loop filesystem per tool.",
    )
    ap.add_argument("workload", choices=WORKLOADS)
    ap.add_argument("fs", choices=["btrfs", "xfs"])
    ap.add_argument("--size", help="workload --size (dupes/near/shifted), e.g. 1G")
    ap.add_argument("--files", type=int, help="workload --files (small/many)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--rerun", action="store_true",
                    help="run each tool a second time on the deduped tree (cold cache)")
    ap.add_argument("--tools", help="comma-separated subset of: " + ",".join(ALL_TOOLS)
                    + " (default: all; duperemove-partial only for near)")
    ap.add_argument("--no-baselines", action="store_true", help="skip find-stat and read-all")
    ap.add_argument("--image-size", help="loop image size (default: from the workload, max 12G)")
    ap.add_argument("--timeout", type=int, default=3600, help="per-run timeout, seconds")
    ap.add_argument("--onecopy", help="path of the onecopy binary (default: target/release/onecopy)")
    ap.add_argument("--no-build", action="store_true", help="do not run cargo build")
    ap.add_argument("--no-install", action="store_true", help="do not apt-get/cargo install peers")
    ap.add_argument("--no-direct-io", action="store_true",
                    help="buffered loop device (default: losetup --direct-io=on)")
    ap.add_argument("--workdir", default=os.environ.get("BENCH_WORKDIR", "/var/tmp"),
                    help="where images and scratch files go (default /var/tmp)")
    args = ap.parse_args()

    if os.geteuid() != 0:
        sys.exit("bench: must run as root (loop devices, mount, drop_caches)")
    if args.tools:
        tools = [t.strip() for t in args.tools.split(",") if t.strip()]
        bad = [t for t in tools if t not in ALL_TOOLS]
        if bad:
            sys.exit(f"unknown tools: {bad}; choose from {ALL_TOOLS}")
    else:
        tools = [t for t in ALL_TOOLS if t != "duperemove-partial" or args.workload == "near"]

    ensure_packages(args.no_install)
    workload_bin, onecopy = build(args)
    os.makedirs(RESULTS, exist_ok=True)
    size = image_size(args, args.fs)
    workdir = tempfile.mkdtemp(prefix="onecopy-bench-", dir=args.workdir)
    CLEAN.paths.append(workdir)
    free = shutil.disk_usage(workdir).free
    if free < size + 2 * GIB:
        sys.exit(f"bench: {human(free)} free in {workdir}, need {human(size + 2 * GIB)}")

    stamp = "{}-{}-{}".format(
        args.workload, args.fs, dt.datetime.now().strftime("%Y%m%d-%H%M%S"))
    rows = []
    summary = None
    if not args.no_baselines:
        r, summary = measure_baselines(args, workload_bin, workdir, size, stamp)
        rows += r
    for tool in tools:
        try:
            r, s = measure_tool(args, tool, workload_bin, onecopy, workdir, size, stamp)
        except (RuntimeError, OSError, ValueError) as e:
            log(f"{tool}: FAILED: {e}")
            r, s = [dict(tool=tool, run=1, status="error", note=str(e))], None
        rows += r
        summary = summary or s

    versions = {t: tool_version(t, onecopy) for t in tools}
    result = {
        "workload": args.workload,
        "fs": args.fs,
        "seed": args.seed,
        "size": args.size,
        "files": args.files,
        "image_bytes": size,
        "direct_io": not args.no_direct_io,
        "rerun": args.rerun,
        "generated": summary,
        "host": {
            "kernel": platform.release(),
            "cpus": os.cpu_count(),
            "mem_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        },
        "versions": versions,
        "notes": BUILD_NOTES,
        "rows": rows,
        "date": dt.datetime.now().isoformat(timespec="seconds"),
    }
    path = os.path.join(RESULTS, stamp + ".json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2)

    print(f"## {args.workload} on {args.fs} (seed {args.seed}, image {human(size)}, "
          f"{os.cpu_count()} CPUs, kernel {platform.release()})\n")
    if summary:
        print(f"Workload: {summary['files']} files, {human(summary['bytes'])}, "
              f"duplicate {human(summary['duplicate_bytes'])} "
              f"({summary['duplicate_note']}); generated in {summary['generate_wall']} s\n")
    print("Versions: " + "; ".join(f"{t}: {v or 'not installed'}" for t, v in versions.items()) + "\n")
    print(table(rows))
    for r in rows:
        if r.get("note"):
            print(f"\n- {r['tool']} run {r.get('run', 1)}: {r['note']}")
        rep = r.get("report")
        if isinstance(rep, dict):
            keys = ("files_scanned", "bytes_scanned", "dedupe_ioctls", "bytes_deduped", "bytes_freed")
            print(f"\n- onecopy run {r['run']} reports: "
                  + ", ".join(f"{k}={rep.get(k)}" for k in keys)
                  + f" (measured freed: {r.get('freed')})")
    for n in BUILD_NOTES:
        print(f"\n- NOTE: {n}")
    print(f"\nResults: {os.path.relpath(path, REPO)}")


if __name__ == "__main__":
    main()
