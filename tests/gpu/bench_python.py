#!/usr/bin/env python3
"""from_pretrained vs weightd.transformers.load_model to first logits, in one run on one checkpoint.

    WEIGHTD_LIB=BUILD/libweightd.so WEIGHTD=BUILD/weightd WEIGHTCTL=BUILD/weightctl \\
        python3 tests/gpu/bench_python.py WORK_DIR [--runs 5] [--preset qwen3-4b]

Generates the checkpoint (weightctl mkcheckpoint) under WORK_DIR unless it is
there, starts weightd with the cuda backend on a private socket, and times,
each in a fresh process (so every row pays for its own CUDA context and
imports the same way; the clock starts after them), to logits on the host:

- from_pretrained: ``AutoModelForCausalLM.from_pretrained(dtype=bf16,
  device_map="cuda:0")`` from a warm page cache;
- load_model, not resident: the set evicted first, so the daemon loads it;
- load_model, resident: the set is on the GPU already.

It prints medians and minimums, the ratio from_pretrained / load_model
(resident), and, in one process, the weights part of load_model: the C
attach alone (weightd_attach through ctypes), the binding's attach by set id
and by path, and attach + wrapping every tensor.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

CHILD = r"""
import json, sys, time
mode, path, sock, ids = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
import torch, transformers, weightd
from weightd.transformers import load_model
torch.cuda.init(); torch.empty(1, device="cuda:0")
input_ids = torch.tensor(ids, device="cuda:0")
t0 = time.perf_counter()
if mode == "from_pretrained":
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="cuda:0")
else:
    model = load_model(path, socket=sock, device=0)
t_model = time.perf_counter() - t0
with torch.no_grad():
    logits = model(input_ids).logits.float().cpu()
t_total = time.perf_counter() - t0
print(json.dumps({"model_s": t_model, "total_s": t_total, "checksum": float(logits.nan_to_num().double().sum())}))
"""


def child(mode, path, sock):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.join(HERE, "..", "..", "client", "python") + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", CHILD, mode, path, sock, json.dumps([[1, 2, 3, 4, 5, 6, 7, 8]])],
                       capture_output=True, text=True, timeout=600, env=env)
    if r.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{r.stderr}")
    return json.loads(r.stdout.splitlines()[-1])


def weights_part(sock, path, runs):
    """Milliseconds: the C attach, the binding's attach (by id, by path), attach + wrapping every tensor."""
    import ctypes

    import weightd
    from weightd._lib import lib

    out = {"c_attach": [], "py_attach_id": [], "py_attach_path": [], "attach_and_wrap": []}
    with weightd.Client(sock) as c:
        sid = c.load(path, device=0)
        for _ in range(runs):
            ptr = ctypes.c_void_p()
            t0 = time.perf_counter()
            rc = lib.weightd_attach(c._conn.ptr, sid.encode(), ctypes.byref(ptr))
            out["c_attach"].append(time.perf_counter() - t0)
            assert rc == 0
            lib.weightd_release(ptr.value)
            t0 = time.perf_counter()
            s = c.attach(set_id=sid)
            out["py_attach_id"].append(time.perf_counter() - t0)
            s.release()
            t0 = time.perf_counter()
            s = c.attach(path, device=0)
            out["py_attach_path"].append(time.perf_counter() - t0)
            s.release()
            t0 = time.perf_counter()
            s = c.attach(path, device=0)
            tensors = [s[n] for n in s]
            out["attach_and_wrap"].append(time.perf_counter() - t0)
            n = len(tensors)
            del tensors
            s.release()
    return {k: (statistics.median(v) * 1e3, min(v) * 1e3) for k, v in out.items()}, n


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("work")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--preset", default="qwen3-4b")
    args = ap.parse_args()
    import wdgpu

    models = os.path.join(args.work, "models")
    os.makedirs(models, exist_ok=True)
    path = wdgpu.mkcheckpoint(os.path.join(models, args.preset), args.preset)
    subprocess.run(["cat"] + [os.path.join(path, f) for f in os.listdir(path)], stdout=subprocess.DEVNULL, check=True)
    d = wdgpu.CudaDaemon(args.work, models).start()
    try:
        import weightd

        rows = {"from_pretrained": [], "load_model, not resident": [], "load_model, resident": []}
        sums = set()
        with weightd.Client(d.socket) as c:
            for _ in range(args.runs):
                r = child("from_pretrained", path, d.socket)
                rows["from_pretrained"].append(r)
                for s in c.status()["sets"]:
                    c.evict(s["set"])
                rows["load_model, not resident"].append(child("load_model", path, d.socket))
                rows["load_model, resident"].append(child("load_model", path, d.socket))
                sums |= {x[-1]["checksum"] for x in rows.values()}
        print(f"\n{args.preset}: {path}, {args.runs} runs, each in a fresh process (times from after CUDA init)")
        print(f"{'path':28} {'to model med/min (s)':>22} {'to first logits med/min (s)':>30}")
        med = {}
        for name, rs in rows.items():
            m = [r["model_s"] for r in rs]
            t = [r["total_s"] for r in rs]
            med[name] = statistics.median(t)
            print(f"{name:28} {statistics.median(m):10.3f} {min(m):10.3f} {med[name]:18.3f} {min(t):10.3f}")
        print(f"ratio from_pretrained / load_model (resident): {med['from_pretrained'] / med['load_model, resident']:.2f}x")
        print(f"ratio from_pretrained / load_model (not resident): "
              f"{med['from_pretrained'] / med['load_model, not resident']:.2f}x")
        print(f"logits checksums agree across all rows: {len(sums) == 1} ({sorted(sums)})")
        part, n = weights_part(d.socket, path, max(args.runs, 10))
        print(f"\nweights part, {n} tensors (ms, median / min):")
        for k, (m, lo) in part.items():
            print(f"  {k:18} {m:8.3f} {lo:8.3f}")
        print(f"  binding overhead over the C attach (by id): {part['py_attach_id'][0] - part['c_attach'][0]:.3f} ms")
    finally:
        d.stop()


if __name__ == "__main__":
    main()
