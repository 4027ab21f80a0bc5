#!/usr/bin/env python3
"""The summary of tests/gpu/speed.sh: one table of every figure against its ceiling and target.

    python3 tests/gpu/speed_report.py JSON_DIR [--out FILE]

Reads the JSON each section of speed.sh wrote (weightd-bench --json-out and
peers.py --json-out), prints one table (figure, time, GiB/s, % of the
same run's ceiling, target, met or missed by how much) and, with --out,
writes it together with the raw sections as one JSON file. A section that is
missing (skipped or failed) is said so; nothing is made up.
"""
import argparse
import glob
import json
import math
import os
import sys

GiB = float(1 << 30)


def load_all(d):
    out = {}
    for p in sorted(glob.glob(os.path.join(d, "*.json"))):
        key = os.path.basename(p)[:-5]
        try:
            with open(p) as f:
                out[key] = json.load(f)
        except (OSError, ValueError) as e:
            out[key] = {"error": str(e)}
    return out


class Table:
    def __init__(self):
        self.rows = []

    def head(self, text):
        self.rows.append({"section": text})
        print(f"\n{text}")

    def add(self, what, seconds=None, nbytes=None, ceiling=None, target=None, note=""):
        """A figure: ratio = ceiling time / this time (the share of the ceiling's rate reached)."""
        row = {"what": what}
        ratio = None
        if seconds is not None and seconds > 0:
            row["seconds"] = seconds
            if nbytes:
                row["gib_per_s"] = nbytes / GiB / seconds
            if ceiling:
                ratio = ceiling / seconds
                row["of_ceiling"] = ratio
        verdict = ""
        if target is not None and ratio is not None:
            row["target"] = target
            row["met"] = ratio >= target
            # One decimal, rounded up: a miss never prints as "by 0.0 points".
            verdict = "met" if ratio >= target else f"MISSED by {math.ceil(round(1000 * (target - ratio), 6)) / 10:.1f} points"
            verdict = f"target >= {100 * target:.0f}%: {verdict}"
        if note:
            row["note"] = note
        self.rows.append(row)
        t = f"{1e3 * seconds:9.1f} ms" if seconds is not None and seconds >= 0 else f"{'-':>12s}"
        g = f"{row['gib_per_s']:6.1f}" if "gib_per_s" in row else f"{'':6s}"
        c = f"{100 * ratio:5.0f}%" if ratio is not None else f"{'':6s}"
        print(f"  {what:54s} {t} {g} {c}  {verdict}{'  ' if verdict and note else ''}{note}")

    def check(self, what, value, limit, unit, fmt="{:.2f}", lower_is_better=True):
        ok = value <= limit if lower_is_better else value >= limit
        self.rows.append({"what": what, "value": value, "limit": limit, "unit": unit, "met": ok})
        verdict = "met" if ok else "MISSED"
        print(f"  {what:54s} {fmt.format(value):>12s} {unit:13s} target {'<=' if lower_is_better else '>='} "
              f"{fmt.format(limit)} {unit}: {verdict}")

    def missing(self, what):
        self.rows.append({"what": what, "missing": True})
        print(f"  {what}: not measured in this run (section skipped or failed; see its log)")


def loads(t, j, key, label, ceiling, nbytes, target=None):
    s = j.get(key)
    if not s:
        return None
    t.add(f"{label} ({s.get('method', '?')})", s["median_s"], nbytes, ceiling, target,
          note=f"runs {', '.join(f'{1e3 * x:.0f}' for x in s['runs_s'])} ms")
    if "back_to_back_median_s" in s:
        t.add("  same, right after an evict", s["back_to_back_median_s"], nbytes, ceiling)
    return s["median_s"]


def section_a(t, s, name, title):
    j = s.get(name)
    if not j:
        t.head(title)
        t.missing(title)
        return
    nbytes, ceil = j["bytes"], j.get("ceiling_h2d_s")
    t.head(f"{title}: {nbytes / GiB:.2f} GiB, {int(j['outputs'])} outputs")
    t.add("H2D ceiling (pinned source, 64 MiB copies)", ceil, nbytes, ceil)
    # The bench's fill alone (no copy alongside, a buffer per thread that never stays in cache).
    for mode in ("gather", "rows", "gather_streaming", "gather_write_combined"):
        if f"fill_{mode}_s" in j:
            t.add(f"host fill, {mode.replace('_', ' ')} ({int(j['fill_threads'])} threads)", j[f"fill_{mode}_s"],
                  nbytes, ceil,
                  note=f"{j[f'fill_{mode}_copied_bytes'] / GiB:.2f} GiB copied")
    staged = [k for k in j if k.startswith("staged")]
    target_staged = 0.85
    best = None
    for k in sorted(staged):
        m = loads(t, j, k, f"load, staged{', staged_strided ' + j[k]['staged_strided'] if k != 'staged' else ''}",
                  ceil, nbytes, target_staged)
        best = m if best is None or (m and m < best) else best
    if "pin_once_s" in j:
        t.add("pinning once (prefetch --pin --wait)", j["pin_once_s"], None, None,
              note=f"{j.get('pin_registered_bytes', 0) / GiB:.2f} GiB registered")
    for k in sorted(x for x in j if x.startswith("pinned") and isinstance(j[x], dict)):
        loads(t, j, k, f"load, pinned-resident{', ' + j[k]['daemon'] if k != 'pinned' else ''}", ceil, nbytes, 0.93)
    if "attach_s" in j:
        t.add("fresh process: attach to usable pointers", j["attach_s"], note="(CUDA context apart: "
              f"{1e3 * j['attach_context_s']:.0f} ms)")
    if "daemon_rss_anon_bytes" in j:
        t.check("daemon RssAnon", j["daemon_rss_anon_bytes"] / (1 << 20), 100, "MiB", "{:.1f}")


def section_auto(t, s, name, title, target):
    j = s.get(name)
    t.head(title)
    if not j or "auto" not in j:
        t.missing(title)
        return
    a, nbytes, ceil = j["auto"], j["bytes"], j.get("ceiling_h2d_s")
    t.add("H2D ceiling", ceil, nbytes, ceil)
    t.add(f"first load ({a['first_method']})", a["first_s"], nbytes, ceil)
    wait = a["pinned_after_s"]
    t.add("  then pinned by the daemon itself after", wait if wait >= 0 else None,
          note=f"{a['pinned_bytes'] / GiB:.2f} GiB" if wait >= 0 else "not within 60 s")
    t.add(f"second and later loads ({a['later_method']})", a["later_median_s"], nbytes, ceil, target,
          note=f"runs {', '.join(f'{1e3 * x:.0f}' for x in a['later_runs_s'])} ms")


def section_peers(t, s, name, title):
    j = s.get(name)
    t.head(title)
    if not j:
        t.missing(title)
        return
    ref = j.get("weightd_reference_s")
    if ref:
        t.add(j.get("weightd_reference", "weightd"), ref)
    slowest_ok = True
    for r in j["loaders"]:
        if "skipped" in r or "error" in r:
            t.rows.append({"what": r["name"], "skipped": r.get("skipped") or r.get("error")})
            print(f"  {r['name']:54s} {'skipped' if 'skipped' in r else 'FAILED'}: {r.get('skipped') or r.get('error')}")
            continue
        vs = r.get("vs_weightd")
        note = f"{r['settings']}; v{r.get('version', '?')}"
        if vs:
            note = f"{vs:.2f}x weightd's time; " + note
            slowest_ok &= vs > 1
        t.add(r["name"], r["median_s"], r["bytes"], note=note)
    if ref and any("vs_weightd" in r for r in j["loaders"]):
        t.rows.append({"what": "weightd faster than every peer measured", "met": slowest_ok})
        print(f"  {'weightd faster than every peer measured':54s} {'met' if slowest_ok else 'MISSED'}")


def section_dsv3(t, s, name, title):
    j = s.get(name)
    t.head(title)
    if not j:
        t.missing(title)
        return
    nbytes, ceil = j["bytes"], j.get("ceiling_h2d_s")
    print(f"  {int(j['shards'])} shards, {int(j['tensors'])} tensors; the rank: {nbytes / GiB:.2f} GiB, "
          f"{int(j['outputs'])} outputs")
    if "daemon_open_s" in j:
        t.add("open in the daemon (163 headers validated, mapped)", j["daemon_open_s"])
        t.add("plan_build of the rank", j["plan_build_s"])
        t.check("open + plan", j["daemon_open_s"] + j["plan_build_s"], 1.0, "s")
    t.add("H2D ceiling (measured on 16 GiB, scaled)", ceil, nbytes, ceil)
    if "prefetch_s" in j:
        t.add("prefetch of the rank's ranges (page cache warm)", j["prefetch_s"], nbytes)
    for mode in ("gather", "rows", "gather_streaming", "gather_write_combined"):  # what limits the staged load
        if f"fill_{mode}_s" in j:
            t.add(f"host fill, {mode.replace('_', ' ')} ({int(j['fill_threads'])} threads)", j[f"fill_{mode}_s"],
                  nbytes, ceil,
                  note=f"{j[f'fill_{mode}_copied_bytes'] / GiB:.2f} GiB copied")
    loads(t, j, "staged", "load, staged", ceil, nbytes, 0.85)
    if "pin_once_s" in j:
        t.add("pinning the rank's ranges once", j["pin_once_s"], None,
              note=f"{j.get('pin_registered_bytes', 0) / GiB:.2f} GiB registered")
    loads(t, j, "pinned", "load, pinned per plan", ceil, nbytes, 0.85)
    loads(t, j, "direct", "load, O_DIRECT source (holes read as zeros)", ceil, nbytes, 0.85)
    if "attach_s" in j:
        t.add(f"fresh process: attach ({int(j['outputs'])} tensors)", j["attach_s"])
    if "daemon_rss_anon_bytes" in j:
        t.check("daemon RssAnon", j["daemon_rss_anon_bytes"] / (1 << 20), 200, "MiB", "{:.1f}")


def section_cold(t, s):
    j = s.get("K1_cold")
    t.head("Cold (page cache dropped)")
    if not j or "cold" not in j:
        t.missing("cold path")
        return
    c = j["cold"]
    if "skipped" in c:
        print(f"  skipped: {c['skipped']} (dropped by {c['dropped_by']})")
        t.rows.append({"what": "cold", "skipped": c["skipped"]})
        return
    print(f"  page cache dropped by {c['dropped_by']}; {100 * c['cached_after_drop']:.1f}% left cached")
    for q in c.get("odirect_sweep", []):
        n = q.get("threads", q.get("depth"))
        way = f"{q['way']} {int(q['read_bytes']) >> 20} MiB x {int(n)}{' in flight' if q['way'] == 'io_uring' else ' threads'}"
        print(f"  {'disk: O_DIRECT ' + way + ' (a slice)':54s} {q['gbps']:9.2f} GB/s")
    b, ceil = c.get("odirect_best", {}), c["odirect_best_gbps"]
    best = f"{b.get('way', '?')} {int(b.get('read_bytes', 0)) >> 20} MiB x {int(b.get('threads', b.get('depth', 0)))}"
    print(f"  {'disk ceiling: ' + best + ', every range':54s} {ceil:9.2f} GB/s")
    t.rows.append({"what": "O_DIRECT ceiling (best of the sweep)", "gb_per_s": ceil, "way": best})
    for key, target in (("load", None), ("direct_load", 0.9)):
        if key not in c:
            continue
        x = c[key]
        print(f"  {'cold load (' + x['method'] + ' from ' + x['read_from'] + ')':54s} {x['gbps']:9.2f} GB/s "
              f"{100 * x['of_odirect']:5.0f}% of the disk's best; page cache {100 * x['cached_before']:.1f}% -> "
              f"{100 * x['cached_after']:.1f}% of the plan's ranges")
        row = {"what": f"cold load, {x['read_from']}", "gb_per_s": x["gbps"], "of_odirect": x["of_odirect"],
               "cached_before": x["cached_before"], "cached_after": x["cached_after"]}
        if target:
            row["met"] = x["of_odirect"] >= target and x["cached_after"] <= x["cached_before"] + 1e-9
            miss = math.ceil(round(1000 * (target - x["of_odirect"]), 6)) / 10
            print(f"  {'':54s} target >= {100 * target:.0f}% and no page-cache growth: "
                  f"{'met' if row['met'] else 'MISSED' + (f' by {miss:.1f} points' if miss > 0 else ' (the page cache grew)')}")
        t.rows.append(row)
    p = s.get("K2_peers_cold")
    if p:
        for r in p["loaders"]:
            if "median_s" in r:
                gbps = r["bytes"] / 1e9 / r["median_s"]
                print(f"  {'cold: ' + r['name'] + ' (' + r['settings'] + ')':54s} {gbps:9.2f} GB/s")
                t.rows.append({"what": f"cold {r['name']}", "gb_per_s": gbps})


def section_compare(t, s, name, title):
    """Two builds of the daemon in one run (weightd-bench --names A,B): medians, spreads, the difference."""
    j = s.get(name)
    t.head(title)
    if not j:
        t.missing(title)
        return
    nbytes, ceil = j["bytes"], j.get("ceiling_h2d_s")
    t.add("H2D ceiling (pinned source, 64 MiB copies)", ceil, nbytes, ceil)
    kinds = sorted({k.rsplit("_", 1)[0] for k in j if isinstance(j[k], dict) and "daemon" in j[k]})
    for kind in kinds:
        pair = [k for k in j if isinstance(j[k], dict) and k.startswith(kind + "_") and "daemon" in j[k]]
        if len(pair) != 2:
            continue
        pts = {}
        for k in pair:
            x = j[k]
            loads(t, j, k, f"{kind}, {x['daemon']}", ceil, nbytes)
            runs = [ceil / r for r in x["runs_s"]]  # each run as a share of the ceiling
            pts[x["daemon"]] = (ceil / x["median_s"], max(runs) - min(runs))
        (a, (ma, sa)), (b, (mb, sb)) = sorted(pts.items())
        diff = 100 * abs(ma - mb)
        ok = diff <= 2 or diff <= 100 * max(sa, sb)
        print(f"  {kind + ': ' + a + ' ' + f'{100 * ma:.1f}%' + ' vs ' + b + ' ' + f'{100 * mb:.1f}%':54s} "
              f"differ by {diff:.1f} points; spreads {100 * sa:.1f} / {100 * sb:.1f}: {'met' if ok else 'MISSED'}")
        t.rows.append({"what": f"{kind}: {a} vs {b}", "points": diff, "spreads": [100 * sa, 100 * sb], "met": ok})


def section_digests(t, s, name, title):
    """Loads with scrub on (digests recorded) against scrub off: the compare, then the cost in time (target <= 3%)."""
    section_compare(t, s, name, title)
    j = s.get(name)
    if not j:
        return
    for k in j:
        x = j[k]
        if not (isinstance(x, dict) and x.get("daemon") == "digests"):
            continue
        other = j.get(k.rsplit("_", 1)[0] + "_none")
        if not other:
            continue
        cost = x["median_s"] / other["median_s"] - 1
        ok = cost <= 0.03
        print(f"  {k.rsplit('_', 1)[0] + ': digests cost':54s} {100 * cost:+.1f}% of the load time "
              f"({1e3 * x['median_s']:.1f} vs {1e3 * other['median_s']:.1f} ms; target <= 3%): {'met' if ok else 'MISSED'}")
        t.rows.append({"what": f"{name} {k}: digests cost", "cost": cost, "met": ok})


def section_matmul(t, s, name, title):
    """A matmul loop while the background scrub runs at its default duty, against the daemon stopped (<= 1%)."""
    j = s.get(name)
    if not j:
        return
    print(f"\n{title}")
    slow = j["slowdown_percent"] / 100
    ok = slow <= 0.01
    print(f"  {'matmul ' + str(j['n']) + '^2 BF16, median of ' + str(j['runs']) + ' runs x ' + str(j['iters']):54s} "
          f"{1e3 * j['median_ms']['scrub']:.1f} vs {1e3 * j['median_ms']['paused']:.1f} us: {100 * slow:+.2f}% "
          f"(target <= 1%; {j.get('scrubbed_bytes_during')} bytes scrubbed meanwhile): {'met' if ok else 'MISSED'}")
    t.rows.append({"what": f"{name}: matmul slowdown", "slowdown": slow, "met": ok})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("json_dir")
    ap.add_argument("--out")
    args = ap.parse_args()
    s = load_all(args.json_dir)
    t = Table()
    gpu = next((v.get("gpu") for v in s.values() if isinstance(v, dict) and v.get("gpu")), "?")
    print(f"speed.sh summary: {gpu}; medians; each ratio against the ceiling measured in the same bench run")
    section_compare(t, s, "X1_whole", "Two builds alternating, whole set")
    section_compare(t, s, "X2_tp2", "Two builds alternating, TP=2 fused rank 0")
    section_a(t, s, "A1_whole", "Whole set, pin off")
    section_a(t, s, "A2_tp2", "TP=2 fused rank 0, pin off (staged: gather vs whole rows)")
    section_auto(t, s, "C1_auto_whole", "Default configuration (pin after_load), whole set", 0.95)
    section_auto(t, s, "C2_auto_tp2", "Default configuration (pin after_load), TP=2 fused rank 0", 0.93)
    section_auto(t, s, "D1_on_open_whole", "pin on_open, whole set", 0.95)
    section_peers(t, s, "P_peers", "Peers, warm, same checkpoint (against the default configuration's later loads)")
    section_digests(t, s, "I1_digests", "Digests (scrub on) vs none, whole set")
    section_digests(t, s, "I2_digests_tp2", "Digests (scrub on) vs none, TP=2 fused rank 0")
    section_matmul(t, s, "I4_matmul_scrub", "Background scrub (default duty, back to back) vs stopped, matmul loop")
    section_dsv3(t, s, "S_dsv3_ep8", "DeepSeek-V3 (sparse), EP8 rank 0 onto one GPU")
    section_cold(t, s)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"summary": t.rows, "sections": s}, f, indent=1)
        print(f"\nwritten: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
