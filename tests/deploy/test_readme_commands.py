"""The README's first two commands work as root without sudo and as a user with sudo.

Each privileged step is written `$(command -v sudo) apt-get ...`. The test
takes the two commands from README.md as written and checks, in bash:
with no sudo on PATH (root in a container), each such step's words are
exactly `apt-get ...`, and with a sudo on PATH they are `/path/sudo
apt-get ...` (the words are printed instead of run: this checks the shell's
expansion, not sudo). Then it runs each install step for real with apt-get's
simulation flag (`-s`: resolves every package, installs nothing, needs no
root), with sudo absent from PATH, so a misspelt or missing package fails here.
"""
import os
import re
import shlex
import shutil
import subprocess

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
PREFIX = "$(command -v sudo) "


def first_two_commands():
    with open(os.path.join(REPO, "README.md")) as f:
        head = f.read().split("## Next steps", 1)[0]
    blocks = re.findall(r"```sh\n(.*?)```", head, re.S)
    assert len(blocks) == 2, blocks
    return [b.strip() for b in blocks]


def privileged_steps(cmd):
    steps = [s.strip() for s in cmd.split("&&")]
    apt = [s for s in steps if "apt-get" in s]
    assert apt, cmd
    for s in steps:
        assert not s.startswith("sudo "), f"a step needs sudo, which root in a container does not have: {s}"
    for s in apt:
        assert s.startswith(PREFIX + "apt-get "), f"apt-get without the sudo-or-root prefix: {s}"
    return apt


def words(step, path):
    """The words bash makes of step with PATH=path, printed instead of run."""
    r = subprocess.run(["bash", "-c", f"set -- {step}; printf '%s\\n' \"$@\""], capture_output=True, text=True,
                       env={"PATH": path}, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()


def path_without_sudo():
    dirs = [d for d in os.environ["PATH"].split(":") if d and not os.path.exists(os.path.join(d, "sudo"))]
    return ":".join(dirs)


@pytest.mark.parametrize("which", [0, 1], ids=["demo", "tests"])
def test_prefix_expands_for_root_and_for_sudo_users(which, tmp_path):
    for step in privileged_steps(first_two_commands()[which]):
        expected = shlex.split(step[len(PREFIX):])
        assert words(step, path_without_sudo()) == expected
        bindir = tmp_path / "bin"
        bindir.mkdir(exist_ok=True)
        sudo = bindir / "sudo"
        sudo.write_text("#!/bin/sh\nexec \"$@\"\n")
        sudo.chmod(0o755)
        assert words(step, f"{bindir}:{path_without_sudo()}") == [str(sudo)] + expected


@pytest.mark.parametrize("which", [0, 1], ids=["demo", "tests"])
def test_install_steps_resolve_without_sudo(which):
    apt = shutil.which("apt-get")
    assert apt, "apt-get is missing: the README's commands are for Debian"
    for step in privileged_steps(first_two_commands()[which]):
        argv = shlex.split(step[len(PREFIX):])
        if argv[1] != "install":
            continue
        sim = [argv[0], "-s"] + argv[1:]
        r = subprocess.run(["bash", "-c", f"$(command -v sudo) {shlex.join(sim)}"], capture_output=True, text=True,
                           env={"PATH": path_without_sudo(), "LC_ALL": "C"}, timeout=300)
        assert r.returncode == 0, f"{' '.join(sim)}:\n{r.stdout[-2000:]}{r.stderr}"
        assert "Unable to locate package" not in r.stdout + r.stderr
