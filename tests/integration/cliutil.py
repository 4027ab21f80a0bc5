"""Running weightctl and weightd as a user would: pipes, a pseudo-terminal, another uid.

Every run has a time limit and returns a Result with the exit code and the
output. json_out() checks the --json contract: exactly one JSON object on
stdout, on one line.
"""
import json
import os
import pty
import re
import select
import signal
import subprocess
import time

from conftest import SLOW, WEIGHTCTL, WEIGHTD

NOBODY = 65534


class Result:
    def __init__(self, args, code, out, err):
        self.args, self.code, self.out, self.err = args, code, out, err

    def describe(self):
        return (f"$ weightctl {' '.join(map(str, self.args))}\nexit {self.code}\n--- stdout\n{self.out}"
                f"--- stderr\n{self.err}")

    def lines(self):
        return self.err.splitlines()


def _env(extra=None):
    env = dict(os.environ)
    env.pop("WEIGHTD_SOCKET", None)
    env.update(extra or {})
    return env


def ctl(*args, user=None, timeout=120, env=None, binary=None):
    """Runs weightctl with args (pipes for stdout and stderr); user: a uid to run as."""
    argv = [binary or WEIGHTCTL] + [str(a) for a in args]
    kw = {}
    if user is not None:
        kw = {"user": user, "group": user, "extra_groups": []}
    p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout * SLOW, env=_env(env), **kw)
    return Result(args, p.returncode, p.stdout, p.stderr)


def weightd(*args, timeout=30):
    """Runs weightd with args to completion (for flags and configurations it refuses)."""
    p = subprocess.run([WEIGHTD] + [str(a) for a in args], capture_output=True, text=True, timeout=timeout * SLOW,
                       env=_env(), stdin=subprocess.DEVNULL)
    return Result(("weightd",) + args, p.returncode, p.stdout, p.stderr)


def json_out(res):
    """The one JSON object res printed on stdout (asserting that it is exactly one, on one line)."""
    lines = res.out.splitlines()
    assert len(lines) == 1, "expected one line of JSON on stdout:\n" + res.describe()
    try:
        obj = json.loads(lines[0])
    except ValueError as e:
        raise AssertionError(f"stdout is not JSON ({e}):\n" + res.describe())
    assert isinstance(obj, dict), res.describe()
    assert "id" not in obj, "an internal request id leaked:\n" + res.describe()
    return obj


def json_error(res, code, exit_code):
    """res failed with exit_code and printed {"error": {"code": code, "message": ...}} alone."""
    assert res.code == exit_code, res.describe()
    obj = json_out(res)
    assert set(obj) == {"error"}, res.describe()
    assert obj["error"]["code"] == code, res.describe()
    assert isinstance(obj["error"]["message"], str) and obj["error"]["message"], res.describe()
    return obj["error"]["message"]


def one_error_line(res, exit_code, *needles):
    """res failed with exit_code and one 'weightctl: ' line on stderr naming every needle; nothing on stdout."""
    assert res.code == exit_code, res.describe()
    lines = res.lines()
    assert len(lines) == 1 and lines[0].startswith("weightctl: "), res.describe()
    for n in needles:
        assert n in lines[0], f"{n!r} not in {lines[0]!r}"
    assert res.out == "", res.describe()
    return lines[0]


class PtyRun:
    """weightctl on a pseudo-terminal (stdout and stderr both), read as it runs."""

    def __init__(self, *args):
        self.args = [str(a) for a in args]
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child
            try:
                os.execve(WEIGHTCTL, [WEIGHTCTL] + self.args, _env({"TERM": "xterm"}))
            finally:
                os._exit(127)
        self.out = b""
        self.code = None

    def read_until(self, pattern, timeout):
        """Reads until the output matches pattern (a regex on bytes) or the child ends; True when it matched."""
        deadline = time.monotonic() + timeout * SLOW
        rx = re.compile(pattern)
        while not rx.search(self.out):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            r, _, _ = select.select([self.fd], [], [], min(left, 0.05))
            if r:
                try:
                    data = os.read(self.fd, 65536)
                except OSError:
                    return bool(rx.search(self.out))
                if not data:
                    return bool(rx.search(self.out))
                self.out += data
        return True

    def signal(self, sig=signal.SIGINT):
        os.kill(self.pid, sig)

    def wait(self, timeout=60):
        deadline = time.monotonic() + timeout * SLOW
        while True:
            self.read_until(rb"(?!x)x", 0.05)  # drain
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid == self.pid:
                self.read_until(rb"(?!x)x", 0.1)
                os.close(self.fd)
                self.code = os.waitstatus_to_exitcode(status)
                return self.code
            if time.monotonic() > deadline:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
                os.close(self.fd)
                raise AssertionError(f"weightctl {self.args} did not exit:\n{self.text()}")

    def text(self):
        return self.out.decode(errors="replace")
