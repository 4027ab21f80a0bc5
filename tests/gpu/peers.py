#!/usr/bin/env python3
"""The loaders a user would otherwise pick, timed on the same checkpoint as weightd-bench.

    python3 tests/gpu/peers.py --checkpoint DIR [--runs 3] [--device 0] [--json-out FILE]
                               [--weightd-json FILE] [--only NAME,...] [--cold]

Every loader runs in a fresh process (its own CUDA context and environment;
the clock starts after the imports and the context), loads every tensor of
the checkpoint's shards onto the GPU and synchronizes. A loader whose package
is not installed is skipped with a line saying so. Warm runs (the default):
one untimed load first, so that the page cache and the loader's own caches
are warm, then --runs timed loads in the same process, median reported.
--cold: the page cache is dropped before each timed load (root:
/proc/sys/vm/drop_caches; else posix_fadvise DONTNEED on the shards, checked
with mincore) and the loaders' cold settings are used.

Settings, each the loader's best for this case as measured on the H200 host
(docs/benchmarks.md), and written into the output:

  instanttensor-mmap-cached  InstantTensor, INSTANTTENSOR_BACKEND=MMAP,
                             INSTANTTENSOR_CACHE_BUFFER=1 (its device buffer
                             kept between loads): the one to beat
  instanttensor-mmap         the same without the cached buffer
  instanttensor-buffered     INSTANTTENSOR_BACKEND=BUFFERED (io_uring/aio
                             through the page cache)
  fastsafetensors-buffered   fastsafetensors, nogds=True,
                             FASTSAFETENSORS_ODIRECT=0 (its O_DIRECT default
                             took 7.3 s warm)
  runai-streamer             Run:ai Model Streamer, SafetensorsStreamer,
                             RUNAI_STREAMER_CONCURRENCY = CPUs, tensors
                             copied to the GPU as they stream (.to(device))
  safetensors                safetensors.torch.load_file(device="cuda:N")
  cold: instanttensor-direct InstantTensor's default (direct I/O, URING or AIO)

With --weightd-json (a weightd-bench JSON with an "auto" section: the
default configuration's later loads; a "cold" section: the cold load; or
"pinned"), each loader is printed against weightd for the same bytes: peer
time / weightd time.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

# name -> (python module to find, environment, the setting in words)
LOADERS = {
    "instanttensor-mmap-cached": ("instanttensor", {"INSTANTTENSOR_BACKEND": "MMAP", "INSTANTTENSOR_CACHE_BUFFER": "1"},
                                  "MMAP backend, INSTANTTENSOR_CACHE_BUFFER=1"),
    "instanttensor-mmap": ("instanttensor", {"INSTANTTENSOR_BACKEND": "MMAP"}, "MMAP backend"),
    "instanttensor-buffered": ("instanttensor", {"INSTANTTENSOR_BACKEND": "BUFFERED"}, "BUFFERED (URING/AIO buffered)"),
    "fastsafetensors-buffered": ("fastsafetensors", {"FASTSAFETENSORS_ODIRECT": "0"},
                                 "nogds=True, FASTSAFETENSORS_ODIRECT=0"),
    "runai-streamer": ("runai_model_streamer", {"RUNAI_STREAMER_CONCURRENCY": str(os.cpu_count() or 16)},
                       f"SafetensorsStreamer, RUNAI_STREAMER_CONCURRENCY={os.cpu_count() or 16}, .to(device)"),
    "safetensors": ("safetensors", {}, "safetensors.torch.load_file(device=cuda)"),
}
COLD_LOADERS = {
    "instanttensor-direct": ("instanttensor", {}, "default backend (direct I/O: URING, else AIO)"),
    "safetensors": LOADERS["safetensors"],
}

CHILD = r'''
import glob, inspect, json, os, struct, sys, time
name, ckpt, device, runs, cold = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
import torch
dev = torch.device("cuda", device)
torch.cuda.set_device(dev)
torch.empty(1, device=dev)
files = sorted(glob.glob(os.path.join(ckpt, "*.safetensors")))

def names_of(f):
    with open(f, "rb") as fh:
        n = struct.unpack("<Q", fh.read(8))[0]
        h = json.loads(fh.read(n))
    h.pop("__metadata__", None)
    return list(h)

def drop():
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("3\n")
        return "drop_caches"
    except OSError:
        for f in files:
            fd = os.open(f, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        return "fadvise"

version = "?"
if name.startswith("instanttensor"):
    import instanttensor
    from instanttensor import safe_open
    version = getattr(instanttensor, "__version__", "?")
    takes_copy = "copy" in inspect.signature(safe_open).parameters
    def load():
        out = {}
        with safe_open(files, framework="pt", device=device) as f:
            for k, t in f.tensors():
                out[k] = t if takes_copy else t.clone()
        return out, None
elif name.startswith("fastsafetensors"):
    import fastsafetensors
    from fastsafetensors import SafeTensorsFileLoader, SingleGroup
    version = getattr(fastsafetensors, "__version__", "?")
    keys = [k for f in files for k in names_of(f)]
    def load():
        loader = SafeTensorsFileLoader(SingleGroup(), dev, nogds=True)
        loader.add_filenames({0: files})
        fb = loader.copy_files_to_device()
        out = {k: fb.get_tensor(k) for k in keys}
        return out, (fb, loader)
elif name.startswith("runai"):
    import runai_model_streamer
    from runai_model_streamer import SafetensorsStreamer
    version = getattr(runai_model_streamer, "__version__", "?")
    def load():
        out = {}
        with SafetensorsStreamer() as s:
            if hasattr(s, "stream_files"):  # all shards in one stream
                s.stream_files(files)
                for k, t in s.get_tensors():
                    out[k] = t.to(dev)
            else:
                for f in files:
                    s.stream_file(f)
                    for k, t in s.get_tensors():
                        out[k] = t.to(dev)
        return out, None
else:
    import safetensors
    from safetensors.torch import load_file
    version = getattr(safetensors, "__version__", "?")
    def load():
        out = {}
        for f in files:
            out.update(load_file(f, device=f"cuda:{device}"))
        return out, None

def release(out, keep):
    nbytes = sum(t.numel() * t.element_size() for t in out.values())
    n = len(out)
    out.clear()
    if keep is not None:
        fb, loader = keep
        fb.close()
        loader.close()
    return nbytes, n

times, how = [], None
if not cold:
    out, keep = load()
    torch.cuda.synchronize()
    release(out, keep)
for _ in range(runs):
    if cold:
        how = drop()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out, keep = load()
    torch.cuda.synchronize()
    times.append(time.perf_counter() - t0)
    nbytes, ntensors = release(out, keep)
print(json.dumps({"runs_s": times, "bytes": nbytes, "tensors": ntensors, "version": version, "dropped_by": how}))
'''


def have(module):
    r = subprocess.run([sys.executable, "-c", f"import importlib.util,sys; sys.exit(importlib.util.find_spec('{module}') is None)"])
    return r.returncode == 0


def run_one(name, module, env_extra, args):
    env = dict(os.environ)
    env.update(env_extra)
    try:
        r = subprocess.run([sys.executable, "-c", CHILD, name, args.checkpoint, str(args.device), str(args.runs),
                            "1" if args.cold else "0"], capture_output=True, text=True, timeout=args.timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout} s"}
    if r.returncode != 0:
        tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
        return {"error": " | ".join(tail)}
    for line in reversed(r.stdout.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {"error": "no result line"}


def weightd_reference(path):
    """weightd's time for the same bytes from a weightd-bench JSON: the default config's later loads, else pinned."""
    if not path or not os.path.exists(path):
        return None, None
    with open(path) as f:
        j = json.load(f)
    if "cold" in j and "load_s" in j["cold"]:
        return j["cold"]["load_s"], f"weightd, cold load ({j['cold']['load_method']})"
    if "auto" in j:
        return j["auto"]["later_median_s"], f"weightd, pin {j['auto']['pin']}, later loads ({j['auto']['later_method']})"
    if "pinned" in j:
        return j["pinned"]["median_s"], "weightd, pinned-resident"
    return None, None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--json-out")
    ap.add_argument("--weightd-json")
    ap.add_argument("--only")
    ap.add_argument("--cold", action="store_true")
    ap.add_argument("--timeout", type=int, default=240, help="seconds per loader")
    args = ap.parse_args()
    loaders = COLD_LOADERS if args.cold else LOADERS
    if args.only:
        want = set(args.only.split(","))
        loaders = {k: v for k, v in loaders.items() if k in want}
    ref_s, ref_what = weightd_reference(args.weightd_json)
    results = []
    print(f"peers ({'cold: page cache dropped before each run' if args.cold else 'warm: one untimed load first'}), "
          f"{args.runs} runs each, medians; checkpoint {args.checkpoint}")
    if ref_s:
        print(f"against {ref_what}: {ref_s * 1e3:.1f} ms")
    print(f"{'loader':28s} {'version':10s} {'time':>10s} {'GiB/s':>7s} {'vs weightd':>11s}  settings")
    for name, (module, env_extra, settings) in loaders.items():
        row = {"name": name, "module": module, "settings": settings, "env": env_extra, "cold": args.cold}
        if not have(module):
            row["skipped"] = f"python module '{module}' is not installed"
            print(f"{name:28s} skipped: {row['skipped']}")
            results.append(row)
            continue
        res = run_one(name, module, env_extra, args)
        row.update(res)
        if "error" in res:
            print(f"{name:28s} failed: {res['error']}")
        else:
            med = statistics.median(res["runs_s"])
            row["median_s"] = med
            row["gib_per_s"] = res["bytes"] / 2**30 / med
            if ref_s:
                row["vs_weightd"] = med / ref_s
            vs = f"{med / ref_s:9.2f}x" if ref_s else f"{'-':>10s}"
            print(f"{name:28s} {str(res.get('version', '?')):10s} {med * 1e3:8.1f} ms {row['gib_per_s']:7.1f} {vs}  {settings}")
        results.append(row)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"checkpoint": args.checkpoint, "cold": args.cold, "runs": args.runs,
                       "weightd_reference_s": ref_s, "weightd_reference": ref_what, "loaders": results}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
