"""tests/gpu/charts.py, the benchmarks' SVG charts, against JSON whose figures the tests choose: every SVG is
well-formed XML (xml.etree), a bar chart has one bar per method whose length is proportional to the method's
rate, with the ceiling's line where that rate puts it and labels that carry the times and ratios; the points of
the time-against-size and time-against-tensors charts sit where their scales put them. And docs/charts: its
SVGs are what charts.py draws from docs/charts/figures.json today, each figure there is one that
docs/benchmarks.md quotes, and benchmarks.md shows every chart.
"""
import json
import math
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests", "gpu"))
import charts  # noqa: E402

NS = "{http://www.w3.org/2000/svg}"
GiB = float(1 << 30)


def parse(svg):
    root = ET.fromstring(svg)
    assert root.tag == NS + "svg"
    return root


def by_class(root, tag, cls):
    return [e for e in root.iter(NS + tag) if cls in (e.get("class") or "").split()]


def texts(root, cls):
    return [e.text for e in by_class(root, "text", cls)]


# A weightd-bench JSON as it writes one (--json-out): the plan's bytes, the ceiling, fills and load phases.
BENCH = {
    "label": "whole, pin off", "gpu": "NVIDIA H200", "checkpoint": "/w/qwen3-4b", "plan": {"preset": "whole"},
    "bytes": 8044936192, "outputs": 398, "runs": 5, "ceiling_h2d_s": 0.1453,
    "fill_gather_s": 0.1665, "fill_gather_copied_bytes": 8044936192,
    "staged": {"median_s": 0.1656, "runs_s": [0.17, 0.1656, 0.16], "method": "staged", "read_from": "mmap"},
    "pinned": {"median_s": 0.1509, "runs_s": [0.1509], "method": "direct", "read_from": ""},
    "direct": {"median_s": 0.301, "runs_s": [0.301], "method": "staged", "read_from": "direct"},
    "attach_s": 0.000577, "attach_tensors": 398, "attach_handles": "cuda_vmm",
}
METHODS = [("host fill, gather", 166.5), ("load, staged (staged)", 165.6), ("load, pinned (direct)", 150.9),
           ("load, direct (staged from direct)", 301.0)]


def svg_of(charts_, kind):
    return dict(charts.render([c for c in charts_ if c["kind"] == kind]))


def test_ceiling_chart_has_a_bar_per_method_in_proportion_with_the_ceiling_line():
    figs = charts.figures([("A1_whole", BENCH)])
    (name, svg), = svg_of(figs, "ceiling").items()
    assert name == "ceiling-whole-pin-off.svg"
    root = parse(svg)
    bars = by_class(root, "rect", "bar")
    assert [b.find(NS + "title").text.split(":")[0] for b in bars] == [m for m, _ in METHODS]
    rates = [BENCH["bytes"] / GiB / (ms / 1e3) for _, ms in METHODS]
    widths = [float(b.get("width")) for b in bars]
    left = {float(b.get("x")) for b in bars}
    assert len(left) == 1
    scale = widths[0] / rates[0]
    for w, r in zip(widths, rates):
        assert w == pytest.approx(r * scale, abs=0.02), (widths, rates)
    assert widths[3] < widths[0] < widths[1] < widths[2]  # the slowest bar is the shortest
    # The ceiling's line at the ceiling's rate on the same scale, labelled with it.
    line, = by_class(root, "line", "ceiling")
    ceil_rate = BENCH["bytes"] / GiB / BENCH["ceiling_h2d_s"]
    assert float(line.get("x1")) - left.pop() == pytest.approx(ceil_rate * scale, abs=0.02)
    assert texts(root, "ceiling-label") == [f"ceiling {ceil_rate:.1f} GiB/s (145.3 ms)"]
    # Each bar's label: its time and its share of the ceiling (ceiling time / its time).
    assert texts(root, "bar-label") == [f"{ms:.1f} ms, {100 * 145.3 / ms:.0f}%" for _, ms in METHODS]
    assert texts(root, "bar-label")[2] == "150.9 ms, 96%"
    assert root.find(NS + "title").text == "whole, pin off"


def test_peers_chart_puts_weightd_beside_each_peer_with_the_ratio():
    peers = {"checkpoint": "/w/qwen3-4b", "cold": False, "runs": 3, "weightd_reference_s": 0.1518,
             "weightd_reference": "weightd, pin after_load, later loads (direct)",
             "loaders": [{"name": "instanttensor-mmap-cached", "version": "0.2.2", "median_s": 0.1929,
                          "bytes": 8044936192},
                         {"name": "fastsafetensors-buffered", "skipped": "python module 'fastsafetensors' is not installed"},
                         {"name": "safetensors", "version": "0.8.0", "median_s": 1.6009, "bytes": 8044936192}]}
    (name, svg), = svg_of(charts.figures([("P_peers", peers)]), "peers").items()
    root = parse(svg)
    bars = by_class(root, "rect", "bar")
    names = [b.find(NS + "title").text.split(":")[0] for b in bars]
    assert names == ["weightd, pin after_load, later loads (direct)", "instanttensor-mmap-cached 0.2.2",
                     "safetensors 0.8.0"]  # a skipped peer has no bar
    widths = [float(b.get("width")) for b in bars]
    assert widths[0] / widths[1] == pytest.approx(0.1929 / 0.1518, rel=1e-3)
    assert widths[0] / widths[2] == pytest.approx(1.6009 / 0.1518, rel=1e-3)
    assert [b.get("fill") for b in bars].count(bars[0].get("fill")) == 1  # weightd's bar stands out
    assert texts(root, "bar-label") == ["151.8 ms", "192.9 ms, 1.27x weightd's time", "1600.9 ms, 10.5x weightd's time"]


def points(root):
    """(series name, x, y, the point's title) of every point of an xy chart."""
    out = []
    for c in by_class(root, "circle", "point"):
        t = c.find(NS + "title").text
        out.append((t.split(":")[0], float(c.get("cx")), float(c.get("cy")), t))
    return out


def test_load_time_against_size_is_log_log_and_attach_against_tensors_linear():
    tp2 = dict(BENCH, label="TP=2", bytes=4022664192, ceiling_h2d_s=0.0729, attach_tensors=290, attach_s=0.0004,
               staged=dict(BENCH["staged"], median_s=0.0836), pinned=dict(BENCH["pinned"], median_s=0.0784))
    big = {"label": "dsv3", "bytes": 100840747360, "ceiling_h2d_s": 1.8207, "attach_s": 0.004289,
           "attach_tensors": 12475, "staged": {"median_s": 1.9153, "method": "staged", "read_from": "mmap"}}
    figs = charts.figures([("A2", tp2), ("A1", BENCH), ("S", big)])
    svgs = svg_of(figs, "xy")
    assert sorted(svgs) == ["attach-vs-tensors.svg", "load-vs-size.svg"]
    root = parse(svgs["load-vs-size.svg"])
    pts = points(root)
    staged = sorted((x, y) for s, x, y, _ in pts if s == "staged")
    assert len(staged) == 3
    # On log-log axes, equal ratios are equal distances: the three staged points' x follow log(bytes), y log(ms).
    gib = [4022664192 / GiB, 8044936192 / GiB, 100840747360 / GiB]
    ms = [83.6, 165.6, 1915.3]
    kx = (staged[1][0] - staged[0][0]) / math.log(gib[1] / gib[0])
    ky = (staged[1][1] - staged[0][1]) / math.log(ms[1] / ms[0])
    assert staged[2][0] - staged[0][0] == pytest.approx(kx * math.log(gib[2] / gib[0]), abs=0.05)
    assert staged[2][1] - staged[0][1] == pytest.approx(ky * math.log(ms[2] / ms[0]), abs=0.05)
    assert ky < 0 < kx  # longer times higher up
    series = {s for s, *_ in pts}
    assert series == {"H2D ceiling", "staged", "direct", "staged from direct"}
    labels = texts(root, "point-label")
    for v in ("83.6 ms", "165.6 ms", "1915.3 ms", "145.3 ms", "150.9 ms", "301 ms"):
        assert v in labels, (v, labels)
    # Attach: linear axes from 0, so x is proportional to the tensors and the height to the time.
    root = parse(svgs["attach-vs-tensors.svg"])
    pts = sorted((x, y) for _, x, y, _ in points(root))
    left = min(float(l.get("x1")) for l in root.iter(NS + "line"))
    bottom = max(float(l.get("y1")) for l in root.iter(NS + "line"))
    tensors, att = [290, 398, 12475], [0.4, 0.577, 4.289]
    for (x, y), n, a in zip(pts, tensors, att):
        assert (x - left) / n == pytest.approx((pts[2][0] - left) / 12475, rel=1e-3)
        assert (bottom - y) / a == pytest.approx((bottom - pts[2][1]) / 4.289, rel=1e-3)
    assert {"0.577 ms", "4.289 ms", "0.4 ms"} <= set(texts(root, "point-label"))


def test_the_command_writes_a_folder_of_json_as_charts(tmp_path):
    src = tmp_path / "json"
    src.mkdir()
    (src / "A1_whole.json").write_text(json.dumps(BENCH))
    out = tmp_path / "charts"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "gpu", "charts.py"), "--out", str(out), str(src)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(out)) == ["attach-vs-tensors.svg", "ceiling-whole-pin-off.svg", "load-vs-size.svg"]
    for f in out.iterdir():
        parse(f.read_text())
    (src / "broken.json").write_text("{")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "gpu", "charts.py"), "--out", str(out), str(src)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "broken.json" in r.stderr, r.stderr


def test_names_and_labels_are_escaped():
    j = dict(BENCH, label='a <b> & "c"')
    (name, svg), = svg_of(charts.figures([("x", j)]), "ceiling").items()
    assert parse(svg).find(NS + "title").text == 'a <b> & "c"'


# ---- docs/charts ----------------------------------------------------------------------------

DOCS = os.path.join(ROOT, "docs", "charts")


def recorded():
    with open(os.path.join(DOCS, "figures.json")) as f:
        return json.load(f)


def test_docs_charts_are_what_the_generator_draws_from_the_recorded_figures():
    files = dict(charts.render(charts.figures([("figures", recorded())])))
    on_disk = sorted(f for f in os.listdir(DOCS) if f.endswith(".svg"))
    assert sorted(files) == on_disk
    for name, svg in files.items():
        parse(svg)
        with open(os.path.join(DOCS, name)) as f:
            assert f.read() == svg, f"docs/charts/{name} is stale: python3 tests/gpu/charts.py --out docs/charts " \
                                    "docs/charts/figures.json"


def test_every_recorded_figure_is_quoted_in_benchmarks_md_and_every_chart_shown():
    with open(os.path.join(ROOT, "docs", "benchmarks.md")) as f:
        doc = f.read()
    quoted = {float(x.replace(",", "")) for x in re.findall(r"\d[\d,]*(?:\.\d+)?", doc)}
    figs = recorded()
    values = []
    for c in figs["charts"]:
        assert c.get("source"), c["title"]
        values += [c.get("ceiling_ms"), c.get("bytes")]
        values += [m["ms"] for m in c.get("methods", []) + c.get("loaders", [])]
        values += [v for s in c.get("series", []) for p in s["points"] for v in (p["ms"], p["x"])]
    for v in values:
        if v is not None:
            assert float(v) in quoted, f"{v}: not a figure docs/benchmarks.md quotes"
    for name in os.listdir(DOCS):
        if name.endswith(".svg"):
            assert f"charts/{name}" in doc, f"docs/benchmarks.md does not show charts/{name}"
