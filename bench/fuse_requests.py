#!/usr/bin/env python3
"""FUSE requests per opcode from `perf script` output of the
`fuse:fuse_request_send` (and, if recorded, `fuse:fuse_request_end`)
tracepoints, for one connection: counts, per file and, with end events,
each opcode's mean, median, 90th percentile and summed latency (send to
end): a mean well above the median is a few slow requests.

Usage: perf script -i perf.data | bench/fuse_requests.py FILES CONNECTION
CONNECTION is the mount's kernel dev_t (major << 20 | minor).
"""
import re
import sys
from collections import defaultdict

SEND = re.compile(r"\s(\d+\.\d+):\s+fuse:fuse_request_send: connection (\d+) req (\d+) opcode \d+ \((\w+)\)")
END = re.compile(r"\s(\d+\.\d+):\s+fuse:fuse_request_end: connection (\d+) req (\d+)")


def main():
    files, conn = int(sys.argv[1]), sys.argv[2]
    count = defaultdict(int)
    lat = defaultdict(list)
    open_reqs = {}
    for line in sys.stdin:
        m = SEND.search(line)
        if m:
            if m.group(2) != conn:
                continue
            op = m.group(4).removeprefix("FUSE_")
            count[op] += 1
            open_reqs[m.group(3)] = (op, float(m.group(1)))
            continue
        m = END.search(line)
        if m and m.group(2) == conn and m.group(3) in open_reqs:
            op, t0 = open_reqs.pop(m.group(3))
            lat[op].append(float(m.group(1)) - t0)
    timed = bool(lat)
    head = "| opcode | requests | per file |"
    print(head + (" mean us | median us | p90 us | summed s |" if timed else ""))
    print("|---|---:|---:|" + ("---:|---:|---:|---:|" if timed else ""))
    rows = sorted(count.items(), key=lambda kv: -kv[1])
    for op, n in rows:
        row = f"| `{op}` | {n} | {n / files:.2f} |"
        if timed:
            t = sorted(lat[op]) or [float("nan")]
            mean, med, p90 = (sum(t) / len(t), t[len(t) // 2], t[len(t) * 9 // 10])
            row += f" {mean * 1e6:.1f} | {med * 1e6:.1f} | {p90 * 1e6:.1f} | {sum(t):.2f} |"
        print(row)
    total = sum(count.values())
    row = f"| all | {total} | {total / files:.2f} |"
    if timed:
        row += f" | | | {sum(sum(t) for t in lat.values()):.2f} |"
    print(row)


if __name__ == "__main__":
    main()
