#!/usr/bin/env python3
"""Latency of `onecopy watch`: from the close of a file's last write (or its
rename into the tree) to all its extents being shared (FIEMAP), per mode.

    bench/watch-latency.py (as root) [--bin target/release/onecopy] [--rounds 5]
                                [--fs btrfs,xfs] [--settle 2]

On each filesystem (a fresh 1 GiB loop image) one 8 MiB random file is
written, the watcher started (catching up first), then each round copies it
(cp --reflink=never) into the tree, or, for the rename rows, copies it
beside the tree and renames it in, and polls FIEMAP every 20 ms until every
extent of the copy is flagged shared. Modes: fanotify (the default source),
and --poll --interval 1 (periodic looks; on btrfs a tree search names the
changed files). Prints a Markdown table of median and max seconds.
"""

import argparse
import array
import fcntl
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import time

FS_IOC_FIEMAP = 0xC020660B
SHARED, LAST = 0x2000, 0x1


def fully_shared(path):
    """Every extent of `path` carries FIEMAP_EXTENT_SHARED."""
    n = 64
    hdr = struct.pack("=QQIIII", 0, 2**64 - 1, 1, 0, n, 0)  # FIEMAP_FLAG_SYNC
    buf = array.array("B", hdr + b"\0" * (56 * n))
    with open(path, "rb") as f:
        fcntl.ioctl(f.fileno(), FS_IOC_FIEMAP, buf, True)
    mapped = struct.unpack_from("=I", buf, 20)[0]
    if mapped == 0:
        return False
    for i in range(mapped):
        flags = struct.unpack_from("=I", buf, 32 + 56 * i + 40)[0]
        if not flags & SHARED:
            return False
    return True


def mkfs(kind, where):
    img = os.path.join(where, "img")
    mnt = os.path.join(where, "mnt")
    os.makedirs(mnt)
    with open(img, "wb") as f:
        f.truncate(1 << 30)
    cmd = ["mkfs.btrfs", "-q", img] if kind == "btrfs" else ["mkfs.xfs", "-q", "-m", "reflink=1", img]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["mount", "-o", "loop", img, mnt], check=True)
    return mnt


def measure(args, kind, mode, rename):
    with tempfile.TemporaryDirectory(dir="/var/tmp") as d:
        mnt = mkfs(kind, d)
        try:
            root = os.path.join(mnt, "w")
            side = os.path.join(mnt, "side")
            os.makedirs(root)
            os.makedirs(side)
            orig = os.path.join(root, "orig")
            with open(orig, "wb") as f:
                f.write(os.urandom(8 << 20))
            os.sync()
            log = open(os.path.join(d, "log"), "w+")
            extra = ["--poll", "--interval", "1"] if mode == "poll" else []
            env = dict(os.environ, ONECOPY_CACHE_DIR=os.path.join(d, "cache"))
            w = subprocess.Popen([args.bin, "watch", "--settle", str(args.settle), *extra, root],
                                 stderr=log, stdout=subprocess.DEVNULL, env=env)
            try:
                while "file(s), shared" not in open(log.name).read():
                    time.sleep(0.05)
                time.sleep(2.5)  # let a racy re-read of orig pass
                out = []
                for i in range(args.rounds):
                    dst = os.path.join(root, f"c{i}")
                    src = os.path.join(side, f"c{i}") if rename else dst
                    subprocess.run(["cp", "--reflink=never", orig, src], check=True)
                    if rename:
                        os.rename(src, dst)
                    t0 = time.monotonic()
                    while not fully_shared(dst):
                        if time.monotonic() - t0 > 60:
                            sys.exit(f"{kind} {mode}: not shared in 60 s\n" + open(log.name).read())
                        time.sleep(0.02)
                    out.append(time.monotonic() - t0)
                    time.sleep(3)
                return out
            finally:
                w.terminate()
                w.wait()
        finally:
            subprocess.run(["umount", mnt], check=False)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin", default="target/release/onecopy")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--fs", default="btrfs,xfs")
    ap.add_argument("--settle", type=float, default=2.0)
    args = ap.parse_args()
    args.bin = os.path.abspath(args.bin)
    print(f"| fs | mode | change | median s | max s | rounds |  (--settle {args.settle:g})")
    print("|---|---|---|---:|---:|---:|")
    for kind in args.fs.split(","):
        for mode, rename in (("fanotify", False), ("fanotify", True), ("poll", False), ("poll", True)):
            v = measure(args, kind, mode, rename)
            label = "fanotify" if mode == "fanotify" else "--poll --interval 1"
            change = "renamed in" if rename else "written"
            print(f"| {kind} | {label} | {change} | {statistics.median(v):.2f} | {max(v):.2f} | {len(v)} |",
                  flush=True)


if __name__ == "__main__":
    main()
