#!/usr/bin/env python3
"""The remote-load benchmark: weightd loading a checkpoint from a real S3 server, against the same
server's ceiling measured in the same run.

It starts SeaweedFS (tests/remote/s3server.py) on loopback, uploads a generated checkpoint, and then:

1. The ceiling: the server's throughput for parallel range GETs into memory, measured with curl
   (`curl --parallel`, an independent client: each range written to /dev/null), swept over
   connections x range size; the best is the ceiling.
2. weightd: a daemon (the host backend, or --backend cuda on a GPU host) with the bucket as its
   remote root loads the checkpoint (the whole plan, and with --tp a TP rank) by URL, `--runs` times,
   each set evicted before the next; its time is the load reply's `seconds`.

It prints one JSON object: the machine, the ceiling sweep, each weightd run, and the ratio of
weightd's best and median rate to the ceiling (bytes fetched per second: a TP rank's bytes for a
TP rank). Server and client share the machine's cores, which the output states.

    python3 tests/remote/bench_remote.py --gib 2 --runs 5 [--backend host|cuda] [--tp 2]
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


def write_checkpoint(d, gib, layers):
    """A Qwen3-shaped checkpoint of about `gib` GiB (BF16), random bytes, with its config.json."""
    os.makedirs(d, exist_ok=True)
    H = 4096
    per_layer = gib * (1 << 30) / layers / 2  # BF16 elements per layer
    # q,k,v,o: 4 H*H; gate, up, down: 3 H*I  ->  I from what remains.
    I = max(256, int((per_layer - 4 * H * H) / (3 * H)) // 256 * 256)
    tensors, off, header = [], 0, {}
    for i in range(layers):
        p = f"model.layers.{i}."
        for name, shape in ((p + "self_attn.q_proj.weight", [H, H]), (p + "self_attn.k_proj.weight", [H, H]),
                            (p + "self_attn.v_proj.weight", [H, H]), (p + "self_attn.o_proj.weight", [H, H]),
                            (p + "mlp.gate_proj.weight", [I, H]), (p + "mlp.up_proj.weight", [I, H]),
                            (p + "mlp.down_proj.weight", [H, I]), (p + "input_layernorm.weight", [H]),
                            (p + "post_attention_layernorm.weight", [H])):
            n = 2
            for x in shape:
                n *= x
            header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [off, off + n]}
            tensors.append(n)
            off += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(os.path.join(d, "model.safetensors"), "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        left = off
        block = os.urandom(64 << 20)
        while left:
            n = min(left, len(block))
            f.write(block[:n])
            left -= n
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": H,
                   "intermediate_size": I, "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128,
                   "vocab_size": 1024, "num_hidden_layers": layers, "tie_word_embeddings": False}, f)
    return d, off


def ceiling(url, size, connections, range_bytes, repeat=2):
    """GB/s of curl fetching [0, size) as ranges of range_bytes over `connections` parallel transfers."""
    lines = []
    for off in range(0, size, range_bytes):
        end = min(size, off + range_bytes) - 1
        lines += [f'url = "{url}"', f'range = "{off}-{end}"', 'output = "/dev/null"']
    cfg = tempfile.NamedTemporaryFile("w", suffix=".curlrc", delete=False)
    cfg.write("\n".join(lines) + "\n")
    cfg.close()
    best = 0.0
    try:
        for _ in range(repeat):
            t0 = time.perf_counter()
            subprocess.run(["curl", "-sS", "--fail", "--parallel", "--parallel-max", str(connections), "--http1.1",
                            "-K", cfg.name], check=True, timeout=600)
            best = max(best, size / (time.perf_counter() - t0) / 1e9)
    finally:
        os.unlink(cfg.name)
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=2.0, help="checkpoint size (default 2 GiB)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--backend", default="host")
    ap.add_argument("--tp", type=int, default=0, help="also load rank 0 of this TP size")
    ap.add_argument("--weightd", default=os.environ.get("WEIGHTD", os.path.join(REPO, "build", "weightd")))
    ap.add_argument("--weightctl", default=os.environ.get("WEIGHTCTL", os.path.join(REPO, "build", "weightctl")))
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="wdbench-")
    out = {"machine": {"cpus": os.cpu_count(), "note": "the S3 server and the client share these cores"},
           "backend": a.backend}
    try:
        with s3server.SeaweedS3(os.path.join(work, "s3"), anonymous_read=[BUCKET], start_timeout=120) as s3:
            d, payload = write_checkpoint(os.path.join(work, "ckpt"), a.gib, a.layers)
            size = os.path.getsize(os.path.join(d, "model.safetensors"))
            s3.create_bucket(BUCKET)
            for name in os.listdir(d):
                s3.client().upload_file(os.path.join(d, name), BUCKET, f"m/{name}")
            out["checkpoint"] = {"bytes": size, "payload_bytes": payload}
            obj = s3.url(BUCKET, "m/model.safetensors")
            sweep = []
            for conns in (4, 8, 16):
                for rb in (8 << 20, 32 << 20):
                    sweep.append({"connections": conns, "range_bytes": rb,
                                  "gb_per_s": round(ceiling(obj, size, conns, rb), 3)})
            out["ceiling_sweep"] = sweep
            ceil = max(x["gb_per_s"] for x in sweep)
            out["ceiling_gb_per_s"] = ceil
            sock = os.path.join(work, "wd.sock")
            env = dict(os.environ, AWS_ACCESS_KEY_ID=s3server.ACCESS_KEY, AWS_SECRET_ACCESS_KEY=s3server.SECRET_KEY,
                       AWS_REGION=s3server.REGION, AWS_ENDPOINT_URL_S3=s3.endpoint, AWS_EC2_METADATA_DISABLED="true")
            log = open(os.path.join(work, "weightd.log"), "wb")
            wd = subprocess.Popen([a.weightd, "--foreground", "--backend", a.backend, "--socket", sock,
                                   "--remote-root", f"s3://{BUCKET}", "--set", "metrics_address="],
                                  stdout=log, stderr=subprocess.STDOUT, env=env)
            try:
                for _ in range(600):
                    if os.path.exists(sock):
                        break
                    time.sleep(0.05)
                ctl_env = dict(os.environ, WEIGHTD_SOCKET=sock)
                plans = [("whole", [])] + ([(f"tp{a.tp}", ["--tp-size", str(a.tp), "--tp-rank", "0"])] if a.tp else [])
                out["weightd"] = {}
                for label, args in plans:
                    runs = []
                    for _ in range(a.runs):
                        r = subprocess.run([a.weightctl, "--json", "load", f"s3://{BUCKET}/m", *args],
                                           capture_output=True, text=True, env=ctl_env, timeout=600, check=True)
                        rep = json.loads(r.stdout.strip().splitlines()[-1])
                        fetched = sum(rep["read_bytes"].values())
                        runs.append({"seconds": rep["seconds"], "bytes": fetched,
                                     "gb_per_s": round(fetched / rep["seconds"] / 1e9, 3), "method": rep["method"]})
                        subprocess.run([a.weightctl, "evict", rep["set"]], capture_output=True, env=ctl_env,
                                       timeout=60, check=True)
                    rates = [x["gb_per_s"] for x in runs]
                    out["weightd"][label] = {"runs": runs, "best_gb_per_s": max(rates),
                                             "median_gb_per_s": statistics.median(rates),
                                             "best_ratio": round(max(rates) / ceil, 3),
                                             "median_ratio": round(statistics.median(rates) / ceil, 3)}
            finally:
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
