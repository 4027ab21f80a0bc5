"""The README's "Next steps", run as written where CI can run them.

Step 1 (sudo cmake --install) is stood in for by the same install into a
private DESTDIR, whose binaries, library and pkg-config file the later steps
then use; the test checks that it installs the man pages and the bash
completion. Step 2 needs systemd and root and is not run here. Steps 3 to 6
run as one bash script, verbatim except that /tmp is a private directory,
so that runs side by side do not share a socket; step 5's pip install
(which needs the network) is left out and its program runs with the
binding from the source tree. In a sanitizer build the C and Python steps
are left out: a plain program cannot load an instrumented libweightd.
"""
import glob
import json
import os
import re
import subprocess
import sys

import pytest

from conftest import REPO, SLOW, WEIGHTCTL

BUILD = os.path.dirname(WEIGHTCTL)


def cache(key):
    with open(os.path.join(BUILD, "CMakeCache.txt")) as f:
        for line in f:
            if line.startswith(key + ":"):
                return line.split("=", 1)[1].strip()
    return ""


def next_steps():
    """The sh blocks of the README's "Next steps", in order."""
    with open(os.path.join(REPO, "README.md")) as f:
        text = f.read()
    section = text.split("## Next steps", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```sh\n(.*?)```", section, re.S)


def test_readme_next_steps(tmp_path):
    blocks = next_steps()
    assert len(blocks) == 6, blocks
    assert "cmake --install build" in blocks[0] and "systemctl enable --now weightd.socket" in blocks[1]

    # Step 1, into a private root.
    root = tmp_path / "root"
    env = dict(os.environ, DESTDIR=str(root))
    p = subprocess.run(["cmake", "--install", BUILD], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    prefix = str(root) + cache("CMAKE_INSTALL_PREFIX")
    for f in ("bin/weightctl", "bin/weightd", "share/man/man1/weightctl.1", "share/man/man8/weightd.8",
              "share/bash-completion/completions/weightctl", "include/weightd.h"):
        assert os.path.isfile(os.path.join(prefix, f)), f"cmake --install did not install {f}"
    (lib,) = {os.path.dirname(p) for p in glob.glob(f"{prefix}/lib*/**/libweightd.so.0", recursive=True)}
    sanitized = cache("WEIGHTD_SANITIZE") in ("ON", "1", "TRUE")

    # Steps 3 to 6 in one shell (step 3's export holds for the rest).
    priv = tmp_path / "t"
    priv.mkdir()
    script = []
    for i, b in enumerate(blocks[2:], start=3):
        if sanitized and i in (4, 5):
            continue
        if i == 5:
            b = "\n".join(line for line in b.splitlines() if "pip install" not in line)
        b = b.replace("/tmp/", f"{priv}/")
        if i == 5:  # after the /tmp/ rewrite: this python may itself live under /tmp (a clone there)
            b = b.replace(f"{priv}/wd-venv/bin/python", sys.executable)
        script.append(f"echo '== step {i}'\n" + b)
    run_env = dict(os.environ)
    run_env.pop("WEIGHTD_SOCKET", None)
    run_env.update(PATH=f"{prefix}/bin:" + os.environ["PATH"], LD_LIBRARY_PATH=lib,
                   PKG_CONFIG_PATH=f"{lib}/pkgconfig", PYTHONPATH=os.path.join(REPO, "client", "python"),
                   WEIGHTD_LIB=os.path.join(lib, "libweightd.so.0"))
    sock = f"{priv}/wd.sock"
    try:
        p = subprocess.run(["bash", "-euo", "pipefail", "-c", "\n".join(script)], capture_output=True, text=True,
                           env=run_env, timeout=600 * SLOW, cwd=REPO)
    finally:
        if os.path.exists(sock):  # the daemon of step 3 outlived a failure: stop it
            subprocess.run([WEIGHTCTL, "--socket", sock, "shutdown"], capture_output=True, timeout=60)
    out = p.stdout
    assert p.returncode == 0, f"exit {p.returncode}\n--- stdout\n{out}\n--- stderr\n{p.stderr}"
    assert re.search(r"^set s\d+ on ", out, re.M), out
    assert re.search(r"^verified \d+ tensors, \d+ bytes .*identical to its plan", out, re.M), out
    assert re.search(r"^leases \(0\)$", out, re.M), out
    if not sanitized:
        assert re.search(r"^set s\d+: model\.embed_tokens\.weight is BF16, \d+ bytes$", out, re.M), out
        assert re.search(r"^s\d+ l\d+ \(75968, 1024\) ", out, re.M), out
    prewarms = [json.loads(line) for line in out.splitlines() if line.startswith('{"ok":true,"path"')]
    assert len(prewarms) == 2, out
    assert prewarms[0]["sets"][0]["resident_before"] is False and prewarms[1]["sets"][0]["resident_before"] is True
    assert "already resident\nready\nthe daemon is stopping\n" in out, out
