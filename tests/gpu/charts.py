#!/usr/bin/env python3
"""SVG charts of the benchmarks' JSON, with the standard library only.

    python3 tests/gpu/charts.py --out DIR INPUT...

Each INPUT is a JSON file or a folder of them (every *.json in it, in name
order): what weightd-bench writes (--json, --json-out), what peers.py writes
(--json-out), speed_report.py's speed.json (its raw sections), or a figures
file (below). They are read into figures first, then every chart is drawn
from figures, so a run's JSON and a file of figures recorded by hand give the
same charts:

  ceiling-*.svg   one per bench run with a ceiling: each method's rate (GiB/s
                  of the plan's bytes) as a bar, the ceiling measured in the
                  same run as a line, each bar labelled with its time and its
                  share of the ceiling (ceiling time / its time)
  peers-*.svg     one per peers run: weightd's bar beside every peer's for the
                  same bytes, each labelled with its time and its time over
                  weightd's
  load-vs-size.svg       load time against the bytes loaded (log-log), one
                         line per method, the ceilings as a line of their own
  attach-vs-tensors.svg  attach time against the tensor count, with targets

A figures file is {"figures": 1, "charts": [...]}; a chart is one of
  {"kind": "ceiling", "title", "note", "bytes", "ceiling_ms",
   "methods": [{"name", "ms"}]}
  {"kind": "peers", "title", "note", "bytes",
   "loaders": [{"name", "ms", "weightd": true|false}]}
  {"kind": "xy", "name": "load-vs-size" | "attach-vs-tensors" | ..., "title",
   "note", "x": "bytes" | "tensors", "log": true|false,
   "series": [{"name", "target": true|false, "points": [{"x", "ms", "label"}]}]}
each with an optional "file" (the SVG's name without .svg; else one made
from the kind and title) and "source" anywhere as a note of where the
numbers come from (ignored here). Times are in milliseconds throughout, as docs/benchmarks.md quotes
them. Nothing is drawn for what the input does not hold.
"""
import argparse
import glob
import json
import math
import os
import re
import sys
from xml.sax.saxutils import escape

GiB = float(1 << 30)

# ---- figures from the benchmarks' JSON ---------------------------------------------------------

FILLS = ("gather", "rows", "gather_streaming", "gather_write_combined")


def bench_title(j, name):
    """A bench run's title: its label (speed.sh gives one), else the checkpoint and the plan."""
    what = j.get("label") or os.path.basename(str(j.get("checkpoint", name)))
    if not j.get("label") and isinstance(j.get("plan"), dict) and j["plan"] != {"preset": "whole"}:
        what += " " + json.dumps(j["plan"], separators=(",", ":"))
    return what


def bench_note(j):
    parts = [j.get("gpu"), f"{j['bytes'] / GiB:.2f} GiB" if j.get("bytes") else None,
             f"{int(j['outputs'])} outputs" if j.get("outputs") else None,
             f"medians of {int(j['runs'])}" if j.get("runs") else None]
    return ", ".join(p for p in parts if p)


def load_phases(j):
    """The load phases of a bench run: (key, its object) for each object with a median (staged, pinned_new, ...)."""
    return [(k, v) for k, v in j.items() if isinstance(v, dict) and "median_s" in v]


def from_bench(j, name, xy):
    """The figures of one weightd-bench JSON: its ceiling chart, and its points added to the xy charts."""
    charts = []
    nbytes, ceil = j.get("bytes"), j.get("ceiling_h2d_s")
    methods = []
    for mode in FILLS:
        if f"fill_{mode}_s" in j:
            methods.append({"name": f"host fill, {mode.replace('_', ' ')}", "ms": 1e3 * j[f"fill_{mode}_s"]})
    for key, v in load_phases(j):
        how = v.get("method", "?") + (f" from {v['read_from']}" if v.get("read_from") not in (None, "", "mmap") else "")
        methods.append({"name": f"load, {key.replace('_', ' ')} ({how})", "ms": 1e3 * v["median_s"]})
        if nbytes:
            xy_point(xy, "load-vs-size", how, nbytes, 1e3 * v["median_s"], name)
    a = j.get("auto")
    if isinstance(a, dict) and "later_median_s" in a:
        methods.append({"name": f"first load ({a.get('first_method', '?')})", "ms": 1e3 * a["first_s"]})
        methods.append({"name": f"later loads ({a.get('later_method', '?')})", "ms": 1e3 * a["later_median_s"]})
        if nbytes:
            xy_point(xy, "load-vs-size", a.get("later_method", "later"), nbytes, 1e3 * a["later_median_s"], name)
    if nbytes and ceil:
        xy_point(xy, "load-vs-size", "H2D ceiling", nbytes, 1e3 * ceil, name)
        if methods:
            charts.append({"kind": "ceiling", "title": bench_title(j, name), "note": bench_note(j), "bytes": nbytes,
                           "ceiling_ms": 1e3 * ceil, "methods": methods})
    if "attach_s" in j:
        tensors = j.get("attach_tensors", j.get("outputs"))
        if tensors:
            xy_point(xy, "attach-vs-tensors", f"attach ({j.get('attach_handles', '?')})", tensors,
                     1e3 * j["attach_s"], bench_title(j, name))
    return charts


def from_peers(j, name):
    """The figures of one peers.py JSON: weightd's reference beside each peer that was timed."""
    loaders = []
    ref = j.get("weightd_reference_s")
    nbytes = next((r["bytes"] for r in j.get("loaders", []) if "bytes" in r), None)
    if ref:
        loaders.append({"name": j.get("weightd_reference", "weightd"), "ms": 1e3 * ref, "weightd": True})
    for r in j.get("loaders", []):
        if "median_s" in r:
            v = f" {r['version']}" if r.get("version") not in (None, "?") else ""
            loaders.append({"name": f"{r['name']}{v}", "ms": 1e3 * r["median_s"], "weightd": False})
    if not loaders or not nbytes:
        return []
    title = f"{'cold' if j.get('cold') else 'warm'}, {os.path.basename(str(j.get('checkpoint', name)))}"
    return [{"kind": "peers", "title": title, "note": f"{nbytes / GiB:.2f} GiB, medians of {j.get('runs', '?')}",
             "bytes": nbytes, "loaders": loaders}]


XY = {
    "load-vs-size": {"title": "Load time against the bytes loaded", "x": "bytes", "log": True},
    "attach-vs-tensors": {"title": "Attach time against the tensor count", "x": "tensors", "log": False},
}


def xy_point(xy, chart, series, x, ms, label):
    c = xy.setdefault(chart, dict(XY[chart], kind="xy", name=chart, note="", series=[]))
    s = next((s for s in c["series"] if s["name"] == series), None)
    if s is None:
        s = {"name": series, "points": []}
        c["series"].append(s)
    s["points"].append({"x": x, "ms": ms, "label": label})


def read_inputs(paths):
    """Every input as (name, parsed JSON), folders expanded; a file that is no JSON is an error naming it."""
    out = []
    for p in paths:
        files = sorted(glob.glob(os.path.join(p, "*.json"))) if os.path.isdir(p) else [p]
        for f in files:
            try:
                with open(f) as fh:
                    out.append((os.path.basename(f)[:-5] if f.endswith(".json") else os.path.basename(f), json.load(fh)))
            except (OSError, ValueError) as e:
                raise SystemExit(f"charts.py: {f}: {e}")
    return out


def figures(inputs):
    """All charts of the inputs (figures files' charts as they are, the rest read from the benchmarks' JSON)."""
    charts, xy = [], {}

    def one(name, j):
        if not isinstance(j, dict):
            return
        if "figures" in j:
            charts.extend(j.get("charts", []))
        elif "sections" in j:  # speed_report.py's speed.json: the raw sections
            for k, v in sorted(j["sections"].items()):
                one(k, v)
        elif "loaders" in j:
            charts.extend(from_peers(j, name))
        elif "bytes" in j or "attach_s" in j:
            charts.extend(from_bench(j, name, xy))

    for name, j in inputs:
        one(name, j)
    return charts + [xy[k] for k in XY if k in xy]


# ---- SVG -------------------------------------------------------------------------------------

COLORS = ["#3366aa", "#dd7722", "#339944", "#aa3377", "#7755bb", "#888833", "#22aaaa", "#aa5544"]
FONT = 'font-family="DejaVu Sans, Helvetica, Arial, sans-serif"'


def text_width(s, size):
    """About how wide s is in a sans-serif font of size px (no font metrics in the standard library: generous)."""
    return 0.62 * size * len(s)


def num(v):
    """A coordinate, short: 2 decimals at most."""
    return f"{v:.2f}".rstrip("0").rstrip(".")


class Svg:
    def __init__(self, width, height):
        self.w, self.h, self.parts = width, height, []

    def add(self, s):
        self.parts.append(s)

    def text(self, x, y, s, size=12, anchor="start", cls=None, weight=None, fill="#222"):
        c = f' class="{cls}"' if cls else ""
        wt = f' font-weight="{weight}"' if weight else ""
        self.add(f'<text x="{num(x)}" y="{num(y)}" font-size="{size}" text-anchor="{anchor}" fill="{fill}"{wt}{c}>'
                 f"{escape(s)}</text>")

    def line(self, x1, y1, x2, y2, stroke="#999", width=1, dash=None, cls=None):
        d = f' stroke-dasharray="{dash}"' if dash else ""
        c = f' class="{cls}"' if cls else ""
        self.add(f'<line x1="{num(x1)}" y1="{num(y1)}" x2="{num(x2)}" y2="{num(y2)}" stroke="{stroke}" '
                 f'stroke-width="{width}"{d}{c}/>')

    def done(self, title):
        return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{num(self.w)}" height="{num(self.h)}" '
                f'viewBox="0 0 {num(self.w)} {num(self.h)}" {FONT}>\n<title>{escape(title)}</title>\n'
                f'<rect x="0" y="0" width="{num(self.w)}" height="{num(self.h)}" fill="#ffffff" class="background"/>\n'
                + "\n".join(self.parts) + "\n</svg>\n")


def nice_step(span, ticks=5):
    raw = span / ticks
    mag = 10 ** math.floor(math.log10(raw))
    return next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)


def linear_ticks(hi):
    step = nice_step(hi)
    top = step * math.ceil(hi / step - 1e-9)
    return top, [i * step for i in range(int(round(top / step)) + 1)]


def log_ticks(lo, hi):
    """1-2-5 ticks from below lo to above hi, and the axis ends (the ticks' first and last)."""
    e = math.floor(math.log10(lo))
    vals = []
    while True:
        for m in (1, 2, 5):
            v = m * 10 ** e
            vals.append(v)
        if vals[-1] >= hi:
            break
        e += 1
    first = max(i for i, v in enumerate(vals) if v <= lo)
    last = min(i for i, v in enumerate(vals) if v >= hi)
    return vals[first:last + 1]


def tick_text(v, unit=""):
    if v >= 100 or v == int(v):
        s = f"{v:,.0f}"
    else:
        s = f"{v:g}"
    return s + unit


def header(svg, chart, width):
    svg.text(16, 24, chart["title"], size=15, weight="bold", cls="title")
    if chart.get("note"):
        svg.text(16, 42, chart["note"], size=11, fill="#555", cls="note")


def bars(chart, rows, ref=None, value_label="GiB/s"):
    """Horizontal bars: rows are (name, value, label, highlighted); ref is (value, label) drawn as a line."""
    size, row_h = 12, 26
    name_w = min(460, max(text_width(r[0], size) for r in rows) + 8)
    lab_w = max(text_width(r[2], 11) for r in rows) + 12
    plot_w = 440
    left = 16 + name_w
    top = 60 + (18 if ref else 0)
    width = left + plot_w + lab_w + 16
    height = top + row_h * len(rows) + 44
    hi = max([r[1] for r in rows] + ([ref[0]] if ref else []))
    axis_hi, ticks = linear_ticks(hi * 1.02)
    scale = plot_w / axis_hi
    svg = Svg(width, height)
    header(svg, chart, width)
    bottom = top + row_h * len(rows)
    for t in ticks:
        x = left + t * scale
        svg.line(x, top - 4, x, bottom, stroke="#e4e4e4")
        svg.text(x, bottom + 16, tick_text(t), size=10, anchor="middle", fill="#555", cls="tick")
    svg.text(left + plot_w / 2, bottom + 34, value_label, size=11, anchor="middle", fill="#555", cls="axis-label")
    for i, (name, value, label, mark) in enumerate(rows):
        y = top + i * row_h
        w = value * scale
        svg.text(left - 8, y + row_h / 2 + 4, name, size=size, anchor="end", cls="bar-name")
        color = COLORS[1] if mark else COLORS[0]
        svg.add(f'<rect class="bar" x="{num(left)}" y="{num(y + 4)}" width="{num(w)}" height="{num(row_h - 8)}" '
                f'fill="{color}"><title>{escape(name)}: {escape(label)}</title></rect>')
        svg.text(left + plot_w + 10, y + row_h / 2 + 4, label, size=11, cls="bar-label")
    svg.line(left, top - 4, left, bottom, stroke="#444")
    if ref:
        x = left + ref[0] * scale
        svg.line(x, top - 10, x, bottom, stroke="#cc2222", width=2, dash="6 3", cls="ceiling")
        svg.text(x, top - 14, ref[1], size=11, anchor="middle", fill="#cc2222", cls="ceiling-label")
    return svg.done(chart["title"])


def ceiling_chart(c):
    gib = c["bytes"] / GiB
    rows = [(m["name"], gib / (m["ms"] / 1e3), f"{m['ms']:.1f} ms, {100 * c['ceiling_ms'] / m['ms']:.0f}%", False)
            for m in c["methods"]]
    ref = (gib / (c["ceiling_ms"] / 1e3), f"ceiling {gib / (c['ceiling_ms'] / 1e3):.1f} GiB/s ({c['ceiling_ms']:.1f} ms)")
    return bars(c, rows, ref, "GiB/s (the plan's bytes over the load's time); the line: the same run's ceiling")


def peers_chart(c):
    gib = c["bytes"] / GiB
    ours = next((l for l in c["loaders"] if l.get("weightd")), None)
    rows = []
    for l in c["loaders"]:
        label = f"{l['ms']:.1f} ms"
        if ours and not l.get("weightd"):
            label += f", {l['ms'] / ours['ms']:.3g}x weightd's time"
        rows.append((l["name"], gib / (l["ms"] / 1e3), label, bool(l.get("weightd"))))
    return bars(c, rows, None, "GiB/s for the same bytes (longer is faster)")


def xy_chart(c):
    """Points of each series on linear or log-log axes, joined in x order, each labelled with its time."""
    pts = [p for s in c["series"] for p in s["points"]]
    xs = [p["x"] / GiB if c["x"] == "bytes" else p["x"] for p in pts]
    ys = [p["ms"] for p in pts]
    log = c.get("log", False)
    left, top, pw, ph = 76, 62, 560, 340
    legend_w = max(text_width(s["name"], 11) for s in c["series"]) + 40
    width, height = left + pw + 24 + legend_w, top + ph + 52
    if log:
        xt, yt = log_ticks(min(xs), max(xs)), log_ticks(min(ys), max(ys))
        x0, x1, y0, y1 = xt[0], xt[-1], yt[0], yt[-1]
        fx = lambda v: left + pw * math.log(v / x0) / math.log(x1 / x0)
        fy = lambda v: top + ph - ph * math.log(v / y0) / math.log(y1 / y0)
    else:
        x1, xt = linear_ticks(max(xs) * 1.05)
        y1, yt = linear_ticks(max(ys) * 1.1)
        fx = lambda v: left + pw * v / x1
        fy = lambda v: top + ph - ph * v / y1
    svg = Svg(width, height)
    header(svg, c, width)
    for t in xt:
        svg.line(fx(t), top, fx(t), top + ph, stroke="#e4e4e4")
        svg.text(fx(t), top + ph + 16, tick_text(t), size=10, anchor="middle", fill="#555", cls="tick")
    for t in yt:
        svg.line(left, fy(t), left + pw, fy(t), stroke="#e4e4e4")
        svg.text(left - 6, fy(t) + 4, tick_text(t), size=10, anchor="end", fill="#555", cls="tick")
    svg.line(left, top, left, top + ph, stroke="#444")
    svg.line(left, top + ph, left + pw, top + ph, stroke="#444")
    xlabel = "GiB loaded" if c["x"] == "bytes" else "tensors"
    svg.text(left + pw / 2, top + ph + 36, xlabel + (" (log scale)" if log else ""), size=11, anchor="middle",
             fill="#555", cls="axis-label")
    svg.add(f'<text x="16" y="{num(top + ph / 2)}" font-size="11" text-anchor="middle" fill="#555" class="axis-label" '
            f'transform="rotate(-90 16 {num(top + ph / 2)})">ms{" (log scale)" if log else ""}</text>')
    labels = []  # [x, y, text, color] of every point, placed once all are known
    for i, s in enumerate(c["series"]):
        color = "#cc2222" if s.get("target") else COLORS[i % len(COLORS)]
        ps = sorted(s["points"], key=lambda p: p["x"])
        coords = [(fx(p["x"] / GiB if c["x"] == "bytes" else p["x"]), fy(p["ms"])) for p in ps]
        if len(coords) > 1 and not s.get("target"):
            svg.add(f'<polyline class="series-line" fill="none" stroke="{color}" stroke-width="1.5" points="'
                    + " ".join(f"{num(x)},{num(y)}" for x, y in coords) + '"/>')
        for (x, y), p in zip(coords, ps):
            what = f"{s['name']}: {p['ms']:g} ms" + (f" ({p['label']})" if p.get("label") else "")
            if s.get("target"):
                svg.add(f'<path class="target" d="M{num(x - 6)},{num(y)} L{num(x + 6)},{num(y)}" stroke="{color}" '
                        f'stroke-width="2"><title>{escape(what)}</title></path>')
            else:
                svg.add(f'<circle class="point" cx="{num(x)}" cy="{num(y)}" r="4" fill="{color}">'
                        f"<title>{escape(what)}</title></circle>")
            labels.append([x, y, ("target " if s.get("target") else "") + f"{p['ms']:g} ms", color])
        ly = top + 10 + 18 * i
        lx = left + pw + 24
        if s.get("target"):
            svg.line(lx, ly - 4, lx + 14, ly - 4, stroke=color, width=2)
        else:
            svg.add(f'<circle cx="{num(lx + 7)}" cy="{num(ly - 4)}" r="4" fill="{color}"/>')
        svg.text(lx + 20, ly, s["name"], size=11, cls="legend")
    place_labels(svg, labels, left + 0.8 * pw)
    return svg.done(c["title"])


def place_labels(svg, labels, right_from, gap=12):
    """Labels beside their points, those of points at about the same x pushed apart to gap px; left of the
    points from right_from on, so that none runs off the plot."""
    labels.sort(key=lambda l: (round(l[0] / 10), l[1]))
    prev = None
    for l in labels:
        if prev is not None and round(prev[0] / 10) == round(l[0] / 10) and l[1] < prev[1] + gap:
            l[1] = prev[1] + gap
        prev = l
    for x, y, t, color in labels:
        right = x >= right_from
        svg.text(x - 8 if right else x + 8, y + 4, t, size=10, anchor="end" if right else "start", fill=color,
                 cls="point-label")


def slug(s):
    return re.sub(r"[^a-z0-9]+", "-", s.lower()).strip("-")[:60] or "chart"


def render(charts):
    """(file name, SVG text) for each chart; names unique in the order given."""
    out, seen = [], set()
    for c in charts:
        if c["kind"] == "ceiling":
            name, svg = f"ceiling-{slug(c['title'])}", ceiling_chart(c)
        elif c["kind"] == "peers":
            name, svg = f"peers-{slug(c['title'])}", peers_chart(c)
        elif c["kind"] == "xy":
            name, svg = c.get("name") or slug(c["title"]), xy_chart(c)
        else:
            raise SystemExit(f"charts.py: a chart of kind '{c['kind']}': known kinds are ceiling, peers, xy")
        name = c.get("file") or name
        base, k = name, 2
        while name in seen:
            name, k = f"{base}-{k}", k + 1
        seen.add(name)
        out.append((name + ".svg", svg))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description="SVG charts of weightd-bench's and peers.py's JSON")
    ap.add_argument("--out", required=True, help="the folder the SVGs are written to")
    ap.add_argument("inputs", nargs="+", help="JSON files, or folders of them")
    args = ap.parse_args(argv)
    charts = figures(read_inputs(args.inputs))
    os.makedirs(args.out, exist_ok=True)
    files = render(charts)
    for name, svg in files:
        with open(os.path.join(args.out, name), "w") as f:
            f.write(svg)
    print(f"charts: {len(files)} written to {args.out}" + "".join(f"\n  {n}" for n, _ in files))
    return 0


if __name__ == "__main__":
    sys.exit(main())
