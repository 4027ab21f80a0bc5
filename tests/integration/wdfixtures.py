"""The daemon fixtures every host-backend suite shares: a real weightd on a private socket.

tests/integration uses them through its conftest.py; the conftests of
tests/python_binding, tests/python_vllm and tests/vllm do the same
(``from wdfixtures import *`` with tests/integration on sys.path), so that
there is one launcher, one set of checks at stop and one time limit.
tests/gpu/wdgpu.py subclasses its Daemon for the cuda backend.

The binaries come from $WEIGHTD and $WEIGHTCTL (ctest sets them; by hand,
the defaults are build/weightd and build/weightctl). Temporary files go under
$WD_TEST_TMP when it is set. Each test that asks for a daemon gets its own,
started with `--foreground --backend host` on a socket in a fresh directory;
at the end of the test it is stopped with SIGTERM and must exit with status 0
within a few seconds and without a sanitizer report in its log (an ASan build
is detected and run with detect_leaks=1). A failing test prints the log.

The metrics endpoints are off (`metrics_address=""`) unless a test asks for
them: start_daemon(metrics=True) serves them on a free loopback port of the
daemon's own (d.metrics_address), so that daemons of tests run in parallel
never share one.
"""
import faulthandler
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import wdclient  # noqa: E402

REPO = os.path.abspath(os.path.join(HERE, "..", ".."))

# What ``from wdfixtures import *`` gives a conftest: the fixtures and the hook
# (pytest finds them by name in the conftest's namespace) and the helpers tests use.
__all__ = [
    # hooks and fixtures
    "pytest_runtest_makereport", "_time_limit", "binaries", "workdir", "model_root", "outside_dir",
    "ckpt_small", "ckpt_sharded", "tiny", "start_daemon", "daemon",
    # constants and helpers
    "REPO", "WEIGHTD", "WEIGHTCTL", "ASAN", "SLOW", "STOP_SECONDS", "TEST_TIMEOUT", "SANITIZER_MARKS",
    "TINY_TENSORS", "DaemonProcess", "Daemon", "TimeLimitExceeded", "_failed", "free_port", "mkcheckpoint",
    "native_env", "write_single",
]
SANITIZER_MARKS = ("ERROR: AddressSanitizer", "ERROR: LeakSanitizer", "LeakSanitizer",
                   "runtime error:", "ERROR: ThreadSanitizer", "AddressSanitizer:DEADLYSIGNAL")


def _binary(env, default):
    path = os.environ.get(env) or os.path.join(REPO, "build", default)
    return os.path.abspath(path)


WEIGHTD = _binary("WEIGHTD", "weightd")
WEIGHTCTL = _binary("WEIGHTCTL", "weightctl")


def _is_sanitized(path):
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return False
    return b"__asan_init" in data or b"libasan.so" in data


ASAN = _is_sanitized(WEIGHTD)
# Time allowances grow under the sanitizer build (about 3x slower).
SLOW = 3.0 if ASAN else 1.0
# A stopped daemon must be gone within this many seconds (leak checking at
# exit takes a moment under ASan).
STOP_SECONDS = 5.0 * SLOW
TEST_TIMEOUT = int(os.environ.get("WD_TEST_TIMEOUT", str(int(180 * SLOW))))


# ---- reporting -----------------------------------------------------------------


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, "rep_" + rep.when, rep)


def _failed(request):
    rep = getattr(request.node, "rep_call", None)
    return rep is None or rep.failed


# ---- a per-test time limit -----------------------------------------------------


class TimeLimitExceeded(Exception):
    pass


@pytest.fixture(autouse=True)
def _time_limit(request):
    """Fails a test that runs longer than TEST_TIMEOUT seconds (and dumps stacks)."""

    def on_alarm(signum, frame):
        raise TimeLimitExceeded(f"{request.node.name} ran longer than {TEST_TIMEOUT} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(TEST_TIMEOUT)
    faulthandler.dump_traceback_later(TEST_TIMEOUT + 30, exit=True)
    try:
        yield
    finally:
        signal.alarm(0)
        faulthandler.cancel_dump_traceback_later()
        signal.signal(signal.SIGALRM, old)


# ---- binaries and directories ------------------------------------------------------


@pytest.fixture(scope="session")
def binaries():
    for p in (WEIGHTD, WEIGHTCTL):
        if not (os.path.isfile(p) and os.access(p, os.X_OK)):
            pytest.fail(f"{p} is missing (set WEIGHTD and WEIGHTCTL to the built binaries)")
    return {"weightd": WEIGHTD, "weightctl": WEIGHTCTL, "asan": ASAN}


@pytest.fixture(scope="session")
def workdir():
    """A private directory for the session, removed at the end."""
    base = os.environ.get("WD_TEST_TMP") or tempfile.gettempdir()
    os.makedirs(base, exist_ok=True)
    d = tempfile.mkdtemp(prefix="wdi-", dir=base)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def model_root(workdir):
    """The daemons' model root; checkpoints live below it."""
    d = os.path.join(workdir, "models")
    os.makedirs(d)
    return d


@pytest.fixture(scope="session")
def outside_dir(workdir):
    """A directory outside the model root that holds a valid checkpoint."""
    d = os.path.join(workdir, "outside")
    os.makedirs(d)
    wdclient.write_safetensors(os.path.join(d, "secret.safetensors"),
                               [("w", "F32", [64, 64])], seed=99)
    return d


def native_env():
    """os.environ for weightd and weightctl. Under WD_PYTHON_ASAN=1 (tests/CMakeLists.txt) this
    python runs with the ASan runtime preloaded for an instrumented libweightd; the binaries
    carry their own runtime (a second one is refused) and check their leaks."""
    env = dict(os.environ)
    if env.pop("WD_PYTHON_ASAN", None):
        env.pop("LD_PRELOAD", None)
        env.pop("ASAN_OPTIONS", None)
    return env


def mkcheckpoint(out, preset="qwen3-0.6b", layers=1, seed=None):
    """Runs weightctl mkcheckpoint; returns out."""
    cmd = [WEIGHTCTL, "mkcheckpoint", "--preset", preset, "--layers", str(layers), "--out", out]
    if seed is not None:
        cmd += ["--seed", str(seed)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=native_env())
    assert r.returncode == 0, f"{' '.join(cmd)} failed:\n{r.stdout}{r.stderr}"
    return out


@pytest.fixture(scope="session")
def ckpt_small(model_root, binaries):
    """qwen3-0.6b, one layer: a directory with model.safetensors (~650 MB)."""
    return mkcheckpoint(os.path.join(model_root, "qwen3-0.6b-l1"), "qwen3-0.6b", 1)


@pytest.fixture(scope="session")
def ckpt_sharded(model_root, binaries):
    """qwen3-4b, one layer: three shards and an index (~980 MB)."""
    return mkcheckpoint(os.path.join(model_root, "qwen3-4b-l1"), "qwen3-4b", 1)


TINY_TENSORS = [
    ("embed.weight", "BF16", [1000, 256]),
    ("layers.0.norm.weight", "F32", [256]),
    ("layers.0.odd", "U8", [1001]),
    ("layers.0.attn.q.weight", "F16", [256, 300]),
    ("layers.0.bias", "I64", [3, 5]),
    ("head.weight", "BF16", [513, 256]),
]


def write_single(d, tensors, seed):
    """A checkpoint directory holding model.safetensors; returns the directory."""
    os.makedirs(d, exist_ok=True)
    wdclient.write_safetensors(os.path.join(d, "model.safetensors"), tensors, seed=seed)
    return d


@pytest.fixture(scope="session")
def tiny(model_root):
    """Small checkpoints under the root, {name: directory}, about 1 MB each.

    Also "file": a bare .safetensors file (the "file" layout).
    """
    d = os.path.join(model_root, "tiny")
    os.makedirs(d)
    out = {}
    for name, seed in (("a", 1), ("b", 2), ("c", 3)):
        out[name] = write_single(os.path.join(d, f"tiny_{name}"), TINY_TENSORS, seed)
    # Many small tensors: a large tensor table, so that a leaked reply shows in RSS.
    many = [(f"layers.{i}.w", "F16", [16, 8 + i % 7]) for i in range(400)]
    out["many"] = write_single(os.path.join(d, "many"), many, 4)
    out["file"] = os.path.join(d, "bare.safetensors")
    wdclient.write_safetensors(out["file"], TINY_TENSORS, seed=5)
    return out


# ---- the daemon -------------------------------------------------------------------


def free_port():
    """A loopback TCP port that was free a moment ago (bound to port 0, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What weightd logs when metrics_address cannot be bound (it serves the socket anyway).
METRICS_BIND_FAILED = "metrics and probes are off"


class DaemonProcess:
    """What a test reads about a started weightd: its pid, its log, its /proc entries.

    A subclass sets self.proc (the Popen) and self.log_path (where its stdout
    and stderr go): Daemon here, test_service's Service.
    """

    @property
    def pid(self):
        return self.proc.pid

    def log_text(self):
        try:
            with open(self.log_path, "rb") as f:
                return f.read().decode(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, n=80):
        return "\n".join(self.log_text().splitlines()[-n:])

    def sanitizer_report(self):
        text = self.log_text()
        return [m for m in SANITIZER_MARKS if m in text]

    # ---- /proc views ----

    def fd_count(self):
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def fd_targets(self):
        out = {}
        d = f"/proc/{self.pid}/fd"
        for n in os.listdir(d):
            try:
                out[int(n)] = os.readlink(os.path.join(d, n))
            except OSError:
                pass
        return out

    def rss_kib(self):
        return self.proc_status("VmRSS")

    def rss_anon_kib(self):
        """RssAnon: the daemon's own heap (not the memfd slabs, not the mapped shards)."""
        return self.proc_status("RssAnon")

    def proc_status(self, key):
        """A field of /proc/PID/status in KiB (VmRSS, VmHWM, RssAnon, ...)."""
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
        raise AssertionError(f"no {key} in /proc/{self.pid}/status")

    def cpu_seconds(self):
        """User plus system CPU time the daemon has used so far."""
        with open(f"/proc/{self.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def threads(self):
        return len(os.listdir(f"/proc/{self.pid}/task"))


class Daemon(DaemonProcess):
    """One weightd process on a private socket.

    metrics: serve the metrics endpoints on a free loopback port (d.metrics_address);
    otherwise they are off unless settings name a metrics_address (None: no
    flag, the config file decides). config: a config file (--config), read
    again on SIGHUP. nofile: the daemon's RLIMIT_NOFILE, one number for soft
    and hard or a (soft, hard) pair, for running it out of descriptors.
    user: a uid to run the daemon as (needs root), with that number as its
    group and no other; its directory is given to it, and it has no model
    root unless roots names some. socket: the path it listens on instead of
    one in its directory; with socket_flag False it gets no --socket and must
    choose that path itself. env: variables to set in its environment (None
    removes one).
    """

    def __init__(self, workdir, model_root, settings=None, roots=None, log_level=None, public=False,
                 metrics=False, nofile=None, config=None, user=None, socket=None, socket_flag=True, env=None,
                 extra_args=()):
        self.dir = tempfile.mkdtemp(prefix="d-", dir=workdir)
        self.socket = os.path.join(self.dir, "weightd.sock")
        if len(self.socket) > 100 or public or user is not None:  # sun_path holds 108 bytes
            self.dir = tempfile.mkdtemp(prefix="wdi-")
            self.socket = os.path.join(self.dir, "weightd.sock")
        if public:  # other users may reach the socket (its own mode still applies)
            os.chmod(self.dir, 0o755)
        self.user = user
        if user is not None:
            os.chown(self.dir, user, user)
            roots = roots if roots is not None else []
        if socket is not None:
            self.socket = socket
        self.socket_flag = socket_flag
        self.env = dict(env or {})
        self.extra_args = list(extra_args)
        self.log_path = os.path.join(self.dir, "weightd.log")
        self.model_root = model_root
        self.settings = dict(settings or {})
        self.pick_port = metrics and "metrics_address" not in self.settings
        if self.pick_port:
            self.settings["metrics_address"] = f"127.0.0.1:{free_port()}"
        self.settings.setdefault("metrics_address", "")
        self.nofile = nofile
        self.config = config
        self.roots = roots if roots is not None else [model_root]
        self.log_level = log_level or os.environ.get("WD_DAEMON_LOG_LEVEL", "info")
        self.proc = None
        self.exit_code = None
        self.expect_exit = 0  # the status stop() checks; a test that kills the daemon sets it
        self.stopped = False

    def argv(self):
        a = [WEIGHTD, "--foreground", "--backend", "host", "--log-level", self.log_level]
        if self.socket_flag:
            a += ["--socket", self.socket]
        if self.config is not None:
            a += ["--config", self.config]
        for r in self.roots:
            a += ["--model-root", r]
        for k, v in self.settings.items():
            if v is not None:
                a += ["--set", f"{k}={v}"]
        return a + self.extra_args

    @property
    def metrics_address(self):
        """HOST:PORT of the metrics endpoints, "" when they are off (or set by a config file)."""
        return self.settings["metrics_address"] or ""

    def start(self, timeout=None):
        """Starts the daemon; a port picked for metrics that another process took meanwhile is picked again."""
        for _ in range(5):
            self._start(timeout)
            if not (self.pick_port and METRICS_BIND_FAILED in self.log_text()):
                return self
            self.stop()
            self.stopped = False
            self.settings["metrics_address"] = f"127.0.0.1:{free_port()}"
        raise AssertionError("no free port for metrics_address after 5 tries:\n" + self.log_text())

    def _limits(self):
        soft, hard = self.nofile if isinstance(self.nofile, tuple) else (self.nofile, self.nofile)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    def _start(self, timeout=None):
        timeout = timeout or 20 * SLOW
        env = native_env()
        asan = env.get("ASAN_OPTIONS", "")
        if "detect_leaks" not in asan:
            asan = (asan + ":" if asan else "") + "detect_leaks=1"
        # ASan holds freed memory back (256 MiB by default) to catch use after
        # free; a small quarantine keeps RSS measurements about the daemon.
        if "quarantine_size_mb" not in asan:
            asan += ":quarantine_size_mb=8"
        env["ASAN_OPTIONS"] = asan
        env.setdefault("UBSAN_OPTIONS", "print_stacktrace=1:halt_on_error=1")
        env.pop("WEIGHTD_SOCKET", None)
        for k, v in self.env.items():
            if v is None:
                env.pop(k, None)
            else:
                env[k] = v
        as_user = {"user": self.user, "group": self.user, "extra_groups": []} if self.user is not None else {}
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.argv(), stdin=subprocess.DEVNULL, stdout=self.log,
                                     stderr=subprocess.STDOUT, env=env,
                                     preexec_fn=self._limits if self.nofile is not None else None, **as_user)
        deadline = time.monotonic() + timeout
        while "weightd: listening on " + self.socket not in self.log_text():
            if self.proc.poll() is not None:
                raise AssertionError(f"weightd exited with {self.proc.returncode} before listening:\n"
                                     + self.log_text())
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"weightd did not listen within {timeout} s:\n" + self.log_text())
            time.sleep(0.01)

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def assert_alive(self):
        assert self.alive(), f"weightd died (status {self.proc.returncode}):\n{self.log_tail()}"
        assert not self.sanitizer_report(), f"sanitizer report:\n{self.log_tail(200)}"

    # ---- clients ----

    def connect(self, hello=True, timeout=60.0, handles=None, features=None):
        return wdclient.Conn(self.socket, hello=hello, timeout=timeout, handles=handles, features=features)

    def status(self):
        with self.connect() as c:
            return c.status()

    def check_serving(self):
        """A fresh connection gets hello and status answered; returns the status."""
        self.assert_alive()
        st = self.status()
        assert st["daemon"]["pid"] == self.pid
        return st

    def quiet_fd_count(self):
        """The daemon's descriptors with exactly one client connected (a fresh one).

        Connections that other clients closed may still be open on the daemon's
        side for a moment; this waits until they are gone, so two calls compare
        like with like.
        """
        with self.connect() as c:
            wdclient.wait_until(lambda: c.status()["daemon"]["connections"] == 1, timeout=10 * SLOW,
                                what="other connections to close")
            return self.fd_count()

    # ---- stopping ----

    def wait_exit(self, timeout):
        try:
            self.exit_code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        self.stopped = True
        self.log.close()
        return self.exit_code

    def kill(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.stopped = True
        if not self.log.closed:
            self.log.close()

    def stop(self, sig=signal.SIGTERM, timeout=None):
        """Signals the daemon and checks a clean exit: status 0, in time, no sanitizer report."""
        timeout = timeout or STOP_SECONDS
        if not self.stopped:
            if self.proc.poll() is None:
                t0 = time.monotonic()
                self.proc.send_signal(sig)
                rc = self.wait_exit(timeout)
                if rc is None:
                    self.kill()
                    raise AssertionError(f"weightd did not exit within {timeout} s of signal {sig}:\n"
                                         + self.log_tail(200))
                self.stop_seconds = time.monotonic() - t0
            else:
                self.wait_exit(1)
        self.check_exit(self.expect_exit)

    def check_exit(self, expect=0):
        rc = self.proc.returncode
        assert rc == expect, f"weightd exited with status {rc}, expected {expect}:\n{self.log_tail(200)}"
        rep = self.sanitizer_report()
        assert not rep, f"sanitizer report ({rep}):\n{self.log_tail(300)}"


@pytest.fixture
def start_daemon(workdir, model_root, binaries, request):
    """A factory: start_daemon(settings={...}, metrics=False, nofile=None, ...) -> a started Daemon,
    checked and stopped at the end (see Daemon for the keywords)."""
    started = []

    def start(settings=None, **kw):
        d = Daemon(workdir, model_root, settings=settings, **kw)
        started.append(d)
        return d.start()

    yield start
    errors = []
    for d in started:
        try:
            d.stop()
        except AssertionError as e:
            errors.append(str(e))
        finally:
            d.kill()
    if _failed(request) and not errors:
        for d in started:
            print(f"---- log of weightd (pid {d.pid}) ----\n{d.log_tail(150)}")
    for d in started:
        if not errors:
            shutil.rmtree(d.dir, ignore_errors=True)
    if errors:
        pytest.fail("\n\n".join(errors), pytrace=False)


@pytest.fixture
def daemon(start_daemon):
    """A weightd with the default configuration."""
    return start_daemon()
