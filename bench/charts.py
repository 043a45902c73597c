#!/usr/bin/env python3
"""Renders bench.py's results as SVG bar charts (no dependencies).

    bench/charts.py [RESULT.json ...] [--out DIR]

Reads the given results (default: every bench/results/*.json; for each
workload and filesystem the newest file wins) and writes into DIR (default
bench/charts/):

  wall.svg   wall seconds of each tool's first run, per workload
  freed.svg  MiB each tool actually freed (statvfs), per workload
  rerun.svg  wall seconds of the second run (--rerun), when present
  store.svg  the store's fio throughput beside its ceilings (native disk,
             null FUSE filesystem), from bench/store.sh's output
             (--store FILE; default the newest bench/charts/data/store-*.txt)

One group of bars per "workload on fs", one colour per tool; baselines
(find-stat, read-all) are drawn grey. Missing or failed runs are left out
and named under the chart.
"""

import argparse
import glob
import json
import os
import sys
from xml.sax.saxutils import escape

HERE = os.path.dirname(os.path.abspath(__file__))
PALETTE = {
    "onecopy": "#1b7837",
    "duperemove": "#2166ac",
    "duperemove-partial": "#67a9cf",
    "jdupes": "#b2182b",
    "rmlint": "#ef8a62",
    "fclones": "#762a83",
    "find-stat": "#bbbbbb",
    "read-all": "#888888",
    "native": "#888888",
    "null FUSE": "#bbbbbb",
    "onecopy store": "#1b7837",
}
OK = ("ok", "ok (no candidates)")


def load(paths):
    """The newest result per (workload, fs)."""
    newest = {}
    for p in paths:
        with open(p) as f:
            r = json.load(f)
        key = (r["workload"], r["fs"])
        if key not in newest or r.get("date", "") > newest[key].get("date", ""):
            newest[key] = r
    return [newest[k] for k in sorted(newest)]


def series(results, run, field):
    """[(group label, {tool: value})], tool order, skipped notes."""
    groups, tools, skipped = [], [], []
    for r in results:
        label = f"{r['workload']} on {r['fs']}"
        vals = {}
        for row in r["rows"]:
            if row.get("run", 1) != run:
                continue
            t = row["tool"]
            v = row.get(field)
            if field == "freed_mib" and row.get("freed") is not None:
                v = round(row["freed"] / 2**20, 2)
            if row.get("status") not in OK:
                skipped.append(f"{t} ({label}): {row.get('status', '?')}")
                continue
            if v is None:  # baselines free nothing
                continue
            vals[t] = v
            if t not in tools:
                tools.append(t)
        if vals:
            groups.append((label, vals))
    return groups, tools, skipped


def nice_max(v):
    if v <= 0:
        return 1.0
    mag = 10 ** len(str(int(v))) / 10
    for m in (1, 2, 2.5, 4, 5, 6, 8, 10):
        if v <= m * mag:
            return m * mag
    return 10 * mag


def bar_chart(title, unit_fmt, groups, tools, notes):
    """A grouped bar chart as SVG text."""
    bar_w, gap, left, top, plot_h = 18, 26, 80, 50, 260
    group_w = max(1, len(tools)) * bar_w + gap
    width = max(560, left + max(1, len(groups)) * group_w + 180)
    height = top + plot_h + 70 + 16 * len(notes)
    vmax = nice_max(max([v for _, vals in groups for v in vals.values()] + [0]))
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'font-family="sans-serif" font-size="12">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{left}" y="24" font-size="15" font-weight="bold">{escape(title)}</text>',
    ]
    for i in range(5):
        v = vmax * i / 4
        y = top + plot_h - plot_h * i / 4
        out.append(f'<line x1="{left}" x2="{width - 170}" y1="{y:.1f}" y2="{y:.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{escape(unit_fmt(v))}</text>')
    for g, (label, vals) in enumerate(groups):
        x0 = left + gap / 2 + g * group_w
        for t_i, t in enumerate(tools):
            if t not in vals:
                continue
            v = vals[t]
            h = max(plot_h * max(v, 0) / vmax, 1.5)  # a zero still shows
            x = x0 + t_i * bar_w
            y = top + plot_h - h
            colour = PALETTE.get(t, "#444")
            out.append(
                f'<rect x="{x:.1f}" y="{y:.1f}" width="{bar_w - 2}" height="{h:.1f}" fill="{colour}">'
                f"<title>{escape(t)}: {escape(unit_fmt(v))}</title></rect>")
        cx = x0 + len(tools) * bar_w / 2
        out.append(f'<text x="{cx:.1f}" y="{top + plot_h + 18}" text-anchor="middle">{escape(label)}</text>')
    for t_i, t in enumerate(tools):
        y = top + 10 + t_i * 18
        x = width - 160
        out.append(f'<rect x="{x}" y="{y - 10}" width="12" height="12" fill="{PALETTE.get(t, "#444")}"/>')
        out.append(f'<text x="{x + 18}" y="{y}">{escape(t)}</text>')
    for n_i, n in enumerate(notes):
        out.append(f'<text x="{left}" y="{top + plot_h + 46 + 16 * n_i}" fill="#666">'
                   f"not shown: {escape(n)}</text>")
    out.append("</svg>")
    return "\n".join(out) + "\n"


def store_series(path):
    """[(row, {column: MB/s})] and column order, from the fio table that
    bench/store.sh prints (`| row | native | null FUSE | onecopy store |`).
    A cell "A / B" (the disk before and after the store) counts as their
    mean; a column's "(...)" note is dropped; percentages are skipped."""
    cols, groups = [], []
    with open(path) as f:
        lines = [l.strip() for l in f]
    start = next((i for i, l in enumerate(lines) if l.startswith("## fio sequential")), None)
    if start is None:
        return [], []
    for l in lines[start + 1:]:
        if l.startswith("##"):
            break
        if not l.startswith("|") or l.startswith("|---"):
            continue
        cells = [c.strip() for c in l.strip("|").split("|")]
        if not cols:
            cols = [c.split(" (")[0] for c in cells[1:]]
            continue
        vals = {}
        for c, v in zip(cols, cells[1:]):
            try:
                parts = [float(x) for x in v.split("/")]
                vals[c] = round(sum(parts) / len(parts))
            except ValueError:
                pass  # "-" (not measured for this row), or a percentage
        if vals:
            groups.append((cells[0], vals))
    return groups, [c for c in cols if any(c in v for _, v in groups)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="*")
    ap.add_argument("--out", default=os.path.join(HERE, "charts"))
    ap.add_argument("--store", help="bench/store.sh output (default: newest in charts/data)")
    args = ap.parse_args()
    store = args.store or max(glob.glob(os.path.join(HERE, "charts", "data", "store-*.txt")),
                              default=None)
    if store:
        groups, cols = store_series(store)
        if groups:
            os.makedirs(args.out, exist_ok=True)
            path = os.path.join(args.out, "store.svg")
            title = "Store throughput vs its ceilings, fio 1 MiB sequential (MB/s, higher is better)"
            with open(path, "w") as f:
                f.write(bar_chart(title, lambda v: f"{v:g} MB/s", groups, cols, []))
            print(path)
    paths = args.results or sorted(
        p for p in glob.glob(os.path.join(HERE, "results", "*.json"))
        if not p.endswith(("-run1.json", "-run2.json")))
    if not paths:
        sys.exit("charts: no results (run bench/run.sh first)")
    results = load(paths)
    os.makedirs(args.out, exist_ok=True)
    charts = [
        ("wall.svg", "Wall time, first run (s, lower is better)", 1, "wall", lambda v: f"{v:g} s"),
        ("freed.svg", "Space actually freed, MiB (statvfs, higher is better)", 1, "freed_mib",
         lambda v: f"{v:g} MiB"),
        ("rerun.svg", "Wall time, rerun on the deduped tree (s)", 2, "wall", lambda v: f"{v:g} s"),
    ]
    for name, title, run, field, fmt in charts:
        groups, tools, skipped = series(results, run, field)
        if not groups:
            continue
        path = os.path.join(args.out, name)
        with open(path, "w") as f:
            f.write(bar_chart(title, fmt, groups, tools, skipped))
        print(path)


if __name__ == "__main__":
    main()
