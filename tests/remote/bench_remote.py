#!/usr/bin/env python3
"""The remote-load benchmark: weightd loading a checkpoint from a real S3 server, against the same
server's ceiling measured in the same run.

It starts SeaweedFS (tests/remote/s3server.py) on loopback, uploads a checkpoint `weightctl mkcheckpoint`
writes (a published model's layout, seeded bytes), and then:

1. The ceiling: the server's throughput for parallel range GETs into memory, measured with curl
   (`curl --parallel`, an independent client: each range of the largest shard written into memory, a
   file of /dev/shm of its own, each file's size and edges checked against the shard once per sweep
   point), swept over connections x range size, and its best point measured again after the loads;
   the best of all is the ceiling. Beside it, weightd's engine alone (tests/test_fetch) into malloc'd
   memory and into memfd mappings.
2. weightd: a daemon (the host backend, or --backend cuda on a GPU host) with the bucket as its
   remote root loads the checkpoint (the whole plan, and each --rank) by URL, `--runs` times,
   each set evicted before the next; its time is the request's, end to end as the client sees it
   (`weightctl load`; the first run includes the open), beside the reply's fill time. With several
   --weightd binaries (LABEL=PATH[@KEY=VALUE...]), one daemon each runs, and their loads alternate
   run by run, so that each sees the same conditions and the same ceiling.

It prints one JSON object: the machine, the ceiling sweep, each weightd run, and the ratio of
weightd's best and median rate to the ceiling (bytes fetched per second: a TP rank's bytes for a
TP rank). Server and client share the machine's cores, which the output states.

    python3 tests/remote/bench_remote.py [--preset qwen3-4b --layers 36] [--runs 5] [--backend host|cuda]
        [--rank "--tp-size 2 --tp-rank 0"] [--preset deepseek-v3 --layers 4 --experts 32
        --rank "--ep-size 8 --ep-rank 0"] [--weightd base=PATH --weightd new=PATH@fill_threads=4]
"""
import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import s3server  # noqa: E402

BUCKET = "bench"


def write_checkpoint(weightctl, d, preset, layers, experts):
    """`weightctl mkcheckpoint`: a published model's exact layout (cut to `layers`, `experts`), seeded bytes."""
    cmd = [weightctl, "--json", "mkcheckpoint", "--preset", preset, "--out", d, "--layers", str(layers)]
    if experts:
        cmd += ["--experts", str(experts)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=1800)
    return d


def ceiling(url, size, connections, range_bytes, local, repeat=2):
    """GB/s of curl fetching [0, size) as ranges of range_bytes over `connections` parallel transfers, each
    range written into memory (a file of its own in /dev/shm, as a slab or staging slot receives it).

    In a curl config file, options before the first `next` are shared by every URL and a later one
    replaces an earlier one: `range` and `output` without `next` between the entries would make every
    transfer fetch the last range into the last file. So each entry is its own group (`next` between
    them, each with its own url, range, output and the per-transfer options). After the first pass the
    files are checked against `local`, the object's bytes: each file the size of its range, and its first
    and last 4 KiB equal to the object's there (the check is not timed)."""
    shm = tempfile.mkdtemp(prefix="wdceil-", dir="/dev/shm")
    groups, ranges = [], []
    for i, off in enumerate(range(0, size, range_bytes)):
        end = min(size, off + range_bytes) - 1
        ranges.append((f"{shm}/{i}", off, end + 1 - off))
        groups.append(f'url = "{url}"\nrange = "{off}-{end}"\noutput = "{shm}/{i}"\nfail\nhttp1.1')
    cfg = os.path.join(shm, "ranges.curlrc")
    with open(cfg, "w") as f:
        f.write("\nnext\n".join(groups) + "\n")
    best = 0.0
    try:
        for k in range(repeat):
            t0 = time.perf_counter()
            subprocess.run(["curl", "-sS", "--parallel", "--parallel-max", str(connections), "-K", cfg],
                           check=True, timeout=600, stderr=subprocess.DEVNULL)
            best = max(best, size / (time.perf_counter() - t0) / 1e9)
            if k == 0:
                check_ranges(ranges, local)
            for path, _, _ in ranges:
                os.unlink(path)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    return best


def check_ranges(ranges, local):
    """Raises unless every (file, off, len) of `ranges` holds `len` bytes whose first and last 4 KiB are
    the local object's at `off`: each transfer fetched its own range."""
    with open(local, "rb") as obj:
        for path, off, n in ranges:
            got = os.path.getsize(path)
            if got != n:
                raise RuntimeError(f"ceiling: {path} has {got} bytes, its range {off}+{n} has {n}")
            k = min(4096, n)
            with open(path, "rb") as f:
                head = f.read(k)
                f.seek(n - k)
                tail = f.read(k)
            obj.seek(off)
            ohead = obj.read(k)
            obj.seek(off + n - k)
            if head != ohead or tail != obj.read(k):
                raise RuntimeError(f"ceiling: {path} differs from the object's bytes {off}-{off + n - 1}")


def load_once(weightctl, ctl_env, args):
    """One load of the bucket's checkpoint (then its set evicted): the request's time end to end, its fill time."""
    t0 = time.perf_counter()
    r = subprocess.run([weightctl, "--json", "load", f"s3://{BUCKET}/m", *args],
                       capture_output=True, text=True, env=ctl_env, timeout=600, check=True)
    wall = time.perf_counter() - t0  # the request end to end: open and checks included
    rep = json.loads(r.stdout.strip().splitlines()[-1])
    fetched = sum(rep["read_bytes"].values())
    subprocess.run([weightctl, "evict", rep["set"]], capture_output=True, env=ctl_env, timeout=60, check=True)
    return {"seconds": round(wall, 4), "fill_seconds": rep["seconds"], "bytes": fetched,
            "gb_per_s": round(fetched / wall / 1e9, 3), "method": rep["method"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen3-4b", help="the layout (weightctl mkcheckpoint --list)")
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--experts", type=int, default=0, help="routed experts per MoE layer (MoE presets)")
    ap.add_argument("--rank", action="append", default=[],
                    help='a rank to load besides the whole plan, as weightctl load flags ("--tp-size 2 --tp-rank 0")')
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--backend", default="host")
    ap.add_argument("--weightd", action="append", default=[],
                    help="the daemon binary ($WEIGHTD, or build/weightd); given several times (LABEL=PATH, and "
                         "@KEY=VALUE for each setting it runs with), one daemon each, their loads alternating "
                         "run by run, reported by label")
    ap.add_argument("--weightctl", default=os.environ.get("WEIGHTCTL", os.path.join(REPO, "build", "weightctl")))
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    a = ap.parse_args()
    a.weightd = a.weightd or [os.environ.get("WEIGHTD", os.path.join(REPO, "build", "weightd"))]
    work = tempfile.mkdtemp(prefix="wdbench-")
    out = {"machine": {"cpus": os.cpu_count(), "note": "the S3 server and the client share these cores"},
           "backend": a.backend}
    try:
        with s3server.SeaweedS3(os.path.join(work, "s3"), anonymous_read=[BUCKET], start_timeout=120) as s3:
            d = write_checkpoint(a.weightctl, os.path.join(work, "ckpt"), a.preset, a.layers, a.experts)
            files = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))
            size = sum(os.path.getsize(os.path.join(d, f)) for f in files)
            s3.create_bucket(BUCKET)
            for name in os.listdir(d):
                s3.client().upload_file(os.path.join(d, name), BUCKET, f"m/{name}")
            out["checkpoint"] = {"preset": a.preset, "layers": a.layers, "experts": a.experts or None,
                                 "shards": len(files), "bytes": size}
            # The ceiling over the largest shard: ranges of it from parallel connections.
            big = max(files, key=lambda f: os.path.getsize(os.path.join(d, f)))
            obj = s3.url(BUCKET, f"m/{big}")
            big_size = os.path.getsize(os.path.join(d, big))
            sweep = []
            for conns in (4, 8, 16):
                for rb in (8 << 20, 32 << 20):
                    sweep.append({"connections": conns, "range_bytes": rb,
                                  "gb_per_s": round(ceiling(obj, big_size, conns, rb, os.path.join(d, big)), 3)})
            out["ceiling_sweep"] = sweep
            # weightd's range-GET engine alone (tests/test_fetch: rf_read into memory, the default 16
            # connections and 8 MiB parts), over the same shard in 64 MiB reads from 2 and 8 threads into
            # malloc'd memory (anonymous: transparent huge pages where the kernel gives them), and from 2
            # threads into fresh memfd mappings (what a host-backend slab is: shmem pages).
            fetch = os.path.join(os.path.dirname(a.weightctl), "tests", "test_fetch")
            if os.path.exists(fetch):
                ranges = os.path.join(work, "ranges.txt")
                with open(ranges, "w") as f:
                    f.writelines(f"{o} {min(64 << 20, big_size - o)}\n" for o in range(0, big_size, 64 << 20))
                eng = []
                for threads, dst in ((2, "malloc"), (8, "malloc"), (2, "memfd")):
                    t0 = time.perf_counter()
                    subprocess.run([fetch, "read", obj, "--threads", str(threads), "--ranges", ranges, "--out",
                                    "/dev/null", *(["--memfd"] if dst == "memfd" else [])],
                                   check=True, capture_output=True, timeout=600)
                    eng.append({"threads": threads, "into": dst,
                                "gb_per_s": round(big_size / (time.perf_counter() - t0) / 1e9, 3)})
                out["engine"] = eng
            ceil = max(x["gb_per_s"] for x in sweep)
            out["ceiling_gb_per_s"] = ceil
            env = dict(os.environ, AWS_ACCESS_KEY_ID=s3server.ACCESS_KEY, AWS_SECRET_ACCESS_KEY=s3server.SECRET_KEY,
                       AWS_REGION=s3server.REGION, AWS_ENDPOINT_URL_S3=s3.endpoint, AWS_EC2_METADATA_DISABLED="true")
            daemons = []  # (label, Popen, log, ctl_env), one daemon per binary, all up at once
            try:
                for i, spec in enumerate(a.weightd):
                    spec, *settings = spec.split("@")
                    label, path = spec.split("=", 1) if "=" in spec else (os.path.basename(spec), spec)
                    sock = os.path.join(work, f"wd{i}.sock")
                    log = open(os.path.join(work, f"weightd{i}.log"), "wb")
                    wd = subprocess.Popen([path, "--foreground", "--backend", a.backend, "--socket", sock,
                                           "--remote-root", f"s3://{BUCKET}", "--set", "metrics_address=",
                                           *[x for kv in settings for x in ("--set", kv)]],
                                          stdout=log, stderr=subprocess.STDOUT, env=env)
                    daemons.append((label, wd, log, dict(os.environ, WEIGHTD_SOCKET=sock)))
                    for _ in range(600):
                        if os.path.exists(sock):
                            break
                        time.sleep(0.05)
                plans = [("whole", [])] + [(r, r.split()) for r in a.rank]
                runs = {(d[0], p[0]): [] for d in daemons for p in plans}
                for label, args in plans:
                    for _ in range(a.runs):
                        for name, _, _, ctl_env in daemons:  # the binaries' loads alternate: the same conditions
                            runs[(name, label)].append(load_once(a.weightctl, ctl_env, args))
                # The ceiling's best point again, after the loads: the machine's other load may have changed.
                best = max(sweep, key=lambda x: x["gb_per_s"])
                again = round(ceiling(obj, big_size, best["connections"], best["range_bytes"], os.path.join(d, big)), 3)
                out["ceiling_after"] = {"connections": best["connections"], "range_bytes": best["range_bytes"],
                                        "gb_per_s": again}
                ceil = max(ceil, again)
                out["ceiling_gb_per_s"] = ceil
                res = {}
                for (name, label), rs in runs.items():
                    rates = [x["gb_per_s"] for x in rs]
                    res.setdefault(name, {})[label] = {
                        "runs": rs, "fetched_bytes": rs[0]["bytes"],
                        "share_of_checkpoint": round(rs[0]["bytes"] / size, 4), "best_gb_per_s": max(rates),
                        "median_gb_per_s": statistics.median(rates), "best_ratio": round(max(rates) / ceil, 3),
                        "median_ratio": round(statistics.median(rates) / ceil, 3)}
                out["weightd"] = res[daemons[0][0]] if len(daemons) == 1 else res
            finally:
                for _, wd, log, _ in daemons:
                    wd.terminate()
                    wd.wait(timeout=60)
                    log.close()
    finally:
        if a.keep:
            out["work"] = work
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
