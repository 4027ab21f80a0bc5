#!/usr/bin/env python3
"""Restart survival on a GPU host (issue 18; docs/benchmarks.md, "Restarts").

Starts weightd on the cuda backend with VMM handles under the fd store
harness (tests/integration/fdstore_harness.py, which plays systemd's store),
loads one set, and runs an engine process (torch) that attaches it and does
forward passes with the mapped weights (a matmul per layer-sized weight)
while the daemon is SIGKILLed and restarted. Then the engine's next call
reconnects and reclaims its lease. Prints one line per figure and exits 1
when a check fails:

  restart: spawn to READY                 (harness: exec of the new daemon to its READY=1)
  restart: process start to READY         (the daemon's own clock: main() to READY=1)
  restart: CUDA context ready to READY    (target <= 200 ms)
  restart: bytes reloaded                 (target 0: status loads and the log)
  restart: sets re-adopted
  restart: engine forward passes, errors, changed outputs (target 0 and 0)
  restart: engine lease reclaimed

  tests/gpu/restart.py BUILD_DIR WORK_DIR [--layers N] [--kills K]

The checkpoint (qwen3-4b layout, 7.49 GiB with every layer) is generated once
under WORK_DIR. Under 3 minutes once it exists.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(REPO, "tests", "integration"))
import fdstore_harness  # noqa: E402

# The engine: attaches, runs forward passes until stdin closes, then makes one call (reconnect + reclaim).
ENGINE = r"""
import json, os, sys, threading, time
sys.path.insert(0, sys.argv[2])
import torch, weightd
client = weightd.Client(sys.argv[1])
s = client.attach(sys.argv[3])
mats = [n for n in s.names() if n.endswith("proj.weight")][:16]
ws = [s[n] for n in mats]
torch.manual_seed(0)
xs = [torch.randn(8, w.shape[1], dtype=w.dtype, device=w.device) for w in ws]
# mkcheckpoint's weights are random bytes: about 1 BF16 in 256 is NaN, so every output row is NaN
# and outputs compare with NaN equal to NaN; an exact integer sum of each weight's bits catches any
# byte that changes under the engine.
def forward(x, w):
    return x @ w.T, w.view(torch.int16).sum(dtype=torch.int64)
ref = [forward(x, w) for x, w in zip(xs, ws)]
torch.cuda.synchronize()
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
passes = errors = changed = 0
print("running", flush=True)
while not stop.is_set():
    try:
        for x, w, (r, rsum) in zip(xs, ws, ref):
            out, wsum = forward(x, w)
            if not torch.allclose(out, r, rtol=0, atol=0, equal_nan=True) or not torch.equal(wsum, rsum):
                changed += 1
        torch.cuda.synchronize()
        passes += 1
    except Exception as e:
        errors += 1
        print("error", repr(e), file=sys.stderr, flush=True)
reclaimed = None
try:
    st = client.status()
    reclaimed = [l for l in st["leases"] if l["pid"] == os.getpid() and not l["recovered"]] != []
except Exception as e:
    errors += 1
    print("error in the call after the restart", repr(e), file=sys.stderr, flush=True)
print(json.dumps({"passes": passes, "errors": errors, "changed": changed, "reclaimed": reclaimed,
                  "tensors": mats}), flush=True)
"""


def log_ms(text, pattern):
    m = re.findall(pattern, text)
    return float(m[-1]) if m else None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("build")
    ap.add_argument("work")
    ap.add_argument("--layers", type=int, default=0, help="layers of the qwen3-4b layout (0: all, 7.49 GiB)")
    ap.add_argument("--kills", type=int, default=1, help="SIGKILL and restart this many times")
    a = ap.parse_args()
    build, work = os.path.abspath(a.build), os.path.abspath(a.work)
    os.makedirs(work, exist_ok=True)
    ckpt = os.path.join(work, f"qwen3-4b-l{a.layers}" if a.layers else "qwen3-4b")
    if not os.path.exists(os.path.join(ckpt, "model.safetensors.index.json")):
        cmd = [os.path.join(build, "weightctl"), "mkcheckpoint", "--preset", "qwen3-4b", "--seed", "1", "--out", ckpt]
        if a.layers:
            cmd += ["--layers", str(a.layers)]
        subprocess.run(cmd, check=True)
    os.environ.setdefault("WEIGHTD_LIB", os.path.join(build, "libweightd.so"))
    sup = fdstore_harness.Supervisor(os.path.join(build, "weightd"), work, backend="cuda",
                                     config={"cuda_handles": "vmm", "restart_grace_ms": 60000}, timeout=120)
    failures = []
    engine = None
    try:
        sup.start()
        engine = subprocess.Popen([sys.executable, "-c", ENGINE, sup.socket, os.path.join(REPO, "client", "python"),
                                   ckpt], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = engine.stdout.readline().strip()
        if line != "running":
            raise SystemExit(f"restart: the engine did not start ({line!r}); daemon log:\n{sup.log_text()[-4000:]}")
        for k in range(a.kills):
            time.sleep(1.0)  # forward passes run against the live daemon first
            sup.kill()
            time.sleep(0.5)  # and with no daemon at all
            log_len = len(sup.log_text())
            sup.start()
            ready_at = sup.ready_at
            text = sup.log_text()[log_len:]
            start_ms = log_ms(text, r"READY ([0-9.]+) ms after start")
            ctx_ms = log_ms(text, r"READY [0-9.]+ ms after start, ([0-9.]+) ms after the backend was ready")
            adopted = log_ms(text, r"; ([0-9]+) set\(s\) re-adopted")
            loaded = re.findall(r"loaded set \S+: .* ([0-9]+) bytes in", text)
            print(f"restart {k + 1}: spawn to READY: {(ready_at - sup.spawned) * 1e3:.1f} ms")
            print(f"restart {k + 1}: process start to READY: {start_ms} ms")
            print(f"restart {k + 1}: CUDA context ready to READY: {ctx_ms} ms (target <= 200 ms)")
            print(f"restart {k + 1}: bytes reloaded: {sum(int(b) for b in loaded)} (target 0)")
            print(f"restart {k + 1}: sets re-adopted: {adopted}")
            if ctx_ms is None or ctx_ms > 200:
                failures.append(f"context-to-READY {ctx_ms} ms")
            if loaded:
                failures.append(f"{len(loaded)} load(s) after the restart")
            if adopted != 1:
                failures.append(f"{adopted} sets re-adopted, expected 1")
        time.sleep(1.0)
        engine.stdin.close()
        out = engine.stdout.read().strip().splitlines()
        rc = engine.wait(120)
        res = json.loads(out[-1]) if out else {}
        print(f"restart: engine forward passes: {res.get('passes')}, errors: {res.get('errors')}, "
              f"changed outputs: {res.get('changed')} (target 0 and 0; exit {rc})")
        print(f"restart: engine lease reclaimed after the restart: {res.get('reclaimed')}")
        if rc != 0 or res.get("errors") != 0 or res.get("changed") != 0 or not res.get("passes"):
            failures.append("the engine saw errors or changed outputs")
        if res.get("reclaimed") is not True:
            failures.append("the engine's lease was not reclaimed")
        sup.stop()
    finally:
        if engine is not None and engine.poll() is None:
            engine.kill()
        sup.cleanup()
    print("restart: " + ("PASS" if not failures else "FAIL: " + "; ".join(failures)))
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
