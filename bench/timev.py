"""Reads the report of `/usr/bin/time -v -o FILE`: the one parser of the
bench scripts that time a command (remote.sh, snapshots-dedupe.sh), which
import it (PYTHONPATH=bench)."""


def timev(path):
    """Wall s, CPU s (user + system), peak RSS MiB and the bytes read
    from block devices ("File system inputs" x 512) of one report."""
    v = {}
    for line in open(path):
        if ": " in line:
            k, x = line.strip().rsplit(": ", 1)
            v[k] = x
    w = 0.0
    for p in v["Elapsed (wall clock) time (h:mm:ss or m:ss)"].split(":"):
        w = w * 60 + float(p)
    cpu = float(v["User time (seconds)"]) + float(v["System time (seconds)"])
    rss = int(v["Maximum resident set size (kbytes)"]) / 1024
    return w, cpu, rss, int(v["File system inputs"]) * 512
