#!/usr/bin/env python3
"""Makes the next version of a tree in place, deterministically from SEED:
inserts a few bytes into 5% of the files (shifting what follows), appends
1000 bytes to 2%, deletes 1%, and adds 20 new 50 kB files.

Usage: bench/mutate-tree.py ROOT SEED (bench/store.sh, bench/snapshots.sh)."""
import os
import random
import sys

root, seed = sys.argv[1], int(sys.argv[2])
rnd = random.Random(seed)
files = sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs
               if os.path.isfile(os.path.join(d, f)) and not os.path.islink(os.path.join(d, f)))
for path in files:
    r = rnd.random()
    if r < 0.05:
        data = open(path, "rb").read()
        at = rnd.randrange(len(data) + 1)
        open(path, "wb").write(data[:at] + rnd.randbytes(rnd.randrange(1, 200)) + data[at:])
    elif r < 0.07:
        open(path, "ab").write(rnd.randbytes(1000))
    elif r < 0.08:
        os.remove(path)
for k in range(20):
    open(os.path.join(root, f"new-{seed}-{k}"), "wb").write(rnd.randbytes(50000))
