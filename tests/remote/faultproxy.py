"""A fault-injecting HTTP relay for the remote tests: it stands in front of a real server.

A FaultProxy listens on 127.0.0.1 and relays each HTTP/1.1 request it receives to the upstream
server (SeaweedFS, another proxy) unchanged - the Host header and every signed header as the client
sent them, so signatures still verify - and the upstream's response back, over keep-alive
connections on both sides. Rules (Rule) change what happens to the requests they match:

    Rule("drop", after_bytes=N)            relay the status, headers and N body bytes, then close the
                                           connection (reset=True: with a TCP reset)
    Rule("status", status=503)             answer this status without asking the upstream, with an
                                           S3 error body (code=, default by status) and, when
                                           retry_after= is given, a Retry-After header
    Rule("stall", seconds=T)               send nothing for T seconds, then the response; with
                                           after_bytes=N the headers and N body bytes first
    Rule("replace", action=fn)             call fn() (e.g. upload another version of the object)
                                           before relaying: the requests from then on see the new
                                           object (another ETag, so an If-Match answers 412)
    Rule("redirect", status=307, location=URL)   answer a redirect to URL
    Rule("strip_response_headers", names=[...])  relay, removing these response headers
    Rule("drop_request_headers", names=[...])    relay without these request headers
    Rule("set_request_headers", headers={...})   relay with these request headers set (replaced)
    Rule("pad_body", extra=N)                    relay with N more body bytes than the server sent
    Rule("overstate", extra=N)                   relay the whole body under a Content-Length N bytes
                                                 longer, then close: every byte came, the transfer failed
    Rule("flip", offset=N)                       relay with body byte N (of what the server sent)
                                                 inverted: a corruption the transport did not catch
    Rule("require_bearer", token=T)              answer 401 unless the request carries
                                                 "Authorization: Bearer T"; relay it without that
                                                 header (an artifact server's gate before a public
                                                 bucket); give times=None to gate every request

Each rule matches a method and a substring of the path (None: any), lets the first `skip` matching
requests pass untouched, then applies to the next `times` (None: all) of them. The first rule in
the list that applies to a request takes it. Every request is logged (method, path, headers, the
status sent, the rule applied, the time it arrived): count() and log() let a test assert what the
client did.

Use:
    with FaultProxy("127.0.0.1", upstream_port, [Rule("status", status=503, times=3)]) as p:
        url = p.url + "/bucket/key"
"""
import http.client
import socket
import struct
import threading
import time

HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
              "transfer-encoding", "upgrade", "content-length"}
S3_CODES = {403: "AccessDenied", 404: "NoSuchKey", 412: "PreconditionFailed", 429: "SlowDown",
            500: "InternalError", 503: "ServiceUnavailable"}


class Rule:
    ACTIONS = ("drop", "status", "stall", "replace", "redirect", "strip_response_headers", "drop_request_headers",
               "set_request_headers", "pad_body", "require_bearer", "flip", "overstate")

    def __init__(self, kind, path=None, method=None, skip=0, times=1, **params):
        if kind not in self.ACTIONS:
            raise ValueError(f"unknown rule {kind!r}")
        self.kind, self.path, self.method = kind, path, method
        self.skip, self.times, self.params = skip, times, params
        self.seen = 0     # matching requests so far
        self.applied = 0  # requests it took

    def take(self, method, path):
        """Whether this rule applies to the request (counts it)."""
        if (self.method and method != self.method) or (self.path and self.path not in path):
            return False
        self.seen += 1
        if self.seen <= self.skip or (self.times is not None and self.applied >= self.times):
            return False
        self.applied += 1
        return True

    def __repr__(self):
        return f"Rule({self.kind!r}, path={self.path!r}, skip={self.skip}, times={self.times}, {self.params})"


class _Closed(Exception):
    """The client closed its connection (or the proxy is stopping)."""


class FaultProxy:
    def __init__(self, upstream_host, upstream_port, rules=(), name="proxy"):
        self.upstream = (upstream_host, upstream_port)
        self.rules = list(rules)
        self.name = name
        self._lock = threading.Lock()
        self._log = []
        self._stop = threading.Event()
        self._conns = set()
        self._threads = []
        self._listener = None

    # ---- lifetime -------------------------------------------------------------

    def start(self):
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.port = self._listener.getsockname()[1]
        t = threading.Thread(target=self._accept_loop, name=self.name + "-accept", daemon=True)
        t.start()
        self._threads.append(t)
        return self

    def stop(self):
        self._stop.set()
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in self._threads:
            t.join(timeout=10)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"

    def set_rules(self, rules):
        with self._lock:
            self.rules = list(rules)

    # ---- what the client did ----------------------------------------------------

    def log(self):
        """The requests so far, in the order they arrived."""
        with self._lock:
            return sorted(self._log, key=lambda e: e["t"])

    def count(self, method=None, path=None, status=None, rule=None):
        return sum(1 for e in self.log()
                   if (method is None or e["method"] == method) and (path is None or path in e["path"])
                   and (status is None or e["status"] == status) and (rule is None or e["rule"] == rule))

    # ---- serving ------------------------------------------------------------------

    def _accept_loop(self):
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._conns.add(conn)
            t = threading.Thread(target=self._serve, args=(conn,), name=self.name + "-conn", daemon=True)
            t.start()
            self._threads.append(t)

    def _serve(self, conn):
        upstream = None
        buf = b""
        try:
            while not self._stop.is_set():
                req, buf = self._read_request(conn, buf)
                if req is None:
                    return
                upstream, keep = self._handle(conn, req, upstream)
                if not keep:
                    return
        except (_Closed, OSError):
            return
        finally:
            with self._lock:
                self._conns.discard(conn)
            try:
                conn.close()
            except OSError:
                pass
            if upstream is not None:
                upstream.close()

    def _read_request(self, conn, buf):
        while b"\r\n\r\n" not in buf:
            data = conn.recv(65536)
            if not data:
                return None, b""
            buf += data
        head, buf = buf.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        method, path, _version = lines[0].split(" ", 2)
        headers = []
        for line in lines[1:]:
            k, _, v = line.partition(":")
            headers.append((k.strip(), v.strip()))
        length = int(next((v for k, v in headers if k.lower() == "content-length"), "0"))
        while len(buf) < length:
            data = conn.recv(65536)
            if not data:
                return None, b""
            buf += data
        body, buf = buf[:length], buf[length:]
        return {"method": method, "path": path, "headers": headers, "body": body, "t": time.monotonic()}, buf

    def _rule_for(self, req):
        with self._lock:
            for r in self.rules:
                if r.take(req["method"], req["path"]):
                    return r
        return None

    def _record(self, req, status, rule):
        with self._lock:
            self._log.append({"method": req["method"], "path": req["path"],
                              "headers": {k.lower(): v for k, v in req["headers"]}, "status": status,
                              "rule": rule.kind if rule else None, "t": req["t"]})

    def _handle(self, conn, req, upstream):
        """Answers one request; returns (upstream connection, whether the client connection stays open)."""
        rule = self._rule_for(req)
        kind = rule.kind if rule else None
        p = rule.params if rule else {}
        if kind == "status":
            status = p.get("status", 503)
            code = p.get("code", S3_CODES.get(status, "InternalError"))
            body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
                    f'<Message>injected by the fault proxy</Message></Error>').encode()
            extra = [("Retry-After", str(p["retry_after"]))] if "retry_after" in p else []
            self._record(req, status, rule)
            self._send(conn, status, "Injected", [("Content-Type", "application/xml")] + extra, body, req)
            return upstream, True
        if kind == "redirect":
            status = p.get("status", 307)
            self._record(req, status, rule)
            self._send(conn, status, "Redirect", [("Location", p["location"])], b"", req)
            return upstream, True
        if kind == "replace":
            p["action"]()
        headers = req["headers"]
        if kind == "require_bearer":
            auth = [v for k, v in headers if k.lower() == "authorization"]
            if auth != [f"Bearer {p['token']}"]:
                self._record(req, 401, rule)
                self._send(conn, 401, "Unauthorized", [("WWW-Authenticate", "Bearer")], b"no valid bearer token", req)
                return upstream, True
            headers = [(k, v) for k, v in headers if k.lower() != "authorization"]
        if kind == "drop_request_headers":
            drop = {n.lower() for n in p["names"]}
            headers = [(k, v) for k, v in headers if k.lower() not in drop]
        if kind == "set_request_headers":
            names = {n.lower() for n in p["headers"]}
            headers = [(k, v) for k, v in headers if k.lower() not in names] + list(p["headers"].items())
        if kind == "stall" and p.get("after_bytes") is None:
            if self._stop.wait(p["seconds"]):
                raise _Closed()
        upstream, status, reason, rheaders, body = self._relay(upstream, req, headers)
        self._record(req, status, rule)
        if kind == "pad_body":
            body += b"\0" * p["extra"]
        if kind == "flip" and len(body) > p.get("offset", 0):
            n = p.get("offset", 0)
            body = body[:n] + bytes([body[n] ^ 0xFF]) + body[n + 1:]
        if kind == "strip_response_headers":
            strip = {n.lower() for n in p["names"]}
            rheaders = [(k, v) for k, v in rheaders if k.lower() not in strip]
        if kind == "overstate":
            head = self._head_bytes(status, reason, rheaders, b"\0" * (len(body) + p.get("extra", 1)), req)
            conn.sendall(head + body)
            return upstream, False
        if kind == "drop":
            self._send_partial(conn, status, reason, rheaders, body, req, p.get("after_bytes", 0))
            if p.get("reset"):
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            return upstream, False
        if kind == "stall" and p.get("after_bytes") is not None:
            n = p["after_bytes"]
            self._send_partial(conn, status, reason, rheaders, body, req, n)
            if self._stop.wait(p["seconds"]):
                raise _Closed()
            conn.sendall(body[n:])
            return upstream, True
        self._send(conn, status, reason, rheaders, body, req)
        return upstream, True

    def _relay(self, upstream, req, headers):
        """Sends the request upstream on a kept connection (a new one if it was closed)."""
        for attempt in (0, 1):
            if upstream is None:
                upstream = http.client.HTTPConnection(*self.upstream, timeout=120)
            try:
                upstream.putrequest(req["method"], req["path"], skip_host=True, skip_accept_encoding=True)
                for k, v in headers:
                    if k.lower() not in HOP_BY_HOP:
                        upstream.putheader(k, v)
                if req["body"] or req["method"] in ("PUT", "POST"):
                    upstream.putheader("Content-Length", str(len(req["body"])))
                upstream.endheaders(req["body"] or None)
                resp = upstream.getresponse()
                body = resp.read()
                rheaders = [(k, v) for k, v in resp.getheaders() if k.lower() not in HOP_BY_HOP]
                if req["method"] == "HEAD":
                    length = resp.getheader("Content-Length")
                    if length is not None:
                        rheaders.append(("Content-Length", length))
                if resp.will_close:
                    upstream.close()
                    upstream = None
                return upstream, resp.status, resp.reason, rheaders, body
            except (http.client.HTTPException, OSError):
                upstream.close()
                upstream = None
                if attempt == 1:
                    return None, 502, "Bad Gateway", [], b""
        raise AssertionError("unreachable")

    @staticmethod
    def _head_bytes(status, reason, headers, body, req):
        lines = [f"HTTP/1.1 {status} {reason}"] + [f"{k}: {v}" for k, v in headers]
        if req["method"] != "HEAD" or not any(k.lower() == "content-length" for k, _ in headers):
            lines.append(f"Content-Length: {len(body)}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    def _send(self, conn, status, reason, headers, body, req):
        data = self._head_bytes(status, reason, headers, body, req)
        conn.sendall(data if req["method"] == "HEAD" else data + body)

    def _send_partial(self, conn, status, reason, headers, body, req, nbytes):
        conn.sendall(self._head_bytes(status, reason, headers, body, req) + body[:nbytes])
