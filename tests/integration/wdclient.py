"""A raw-protocol client for weightd, and safetensors helpers, for the integration tests.

Written from docs/protocol.md and docs/protocol-framing.md alone, so that the
tests check the daemon against the documented wire format rather than against
libweightd. A frame is a 4-byte little-endian length and that many bytes of
JSON; descriptors come as SCM_RIGHTS with the first byte of their frame.
The reader never asks the kernel for a byte past the frame it is reading, so
descriptors are always attributed to the right frame.
"""
import array
import json
import mmap
import os
import random
import socket
import struct
import time

MAX_FRAME = 16 * 1024 * 1024
MAX_FDS = 16
PROTOCOL = 1
ALIGN = 256


class WDError(Exception):
    """An error reply: .code is the wire name, .reply the whole frame."""

    def __init__(self, reply):
        err = reply.get("error", {})
        self.code = err.get("code")
        self.message = err.get("message")
        self.reply = reply
        super().__init__(f"{self.code}: {self.message}")


class Closed(Exception):
    """The daemon closed the connection (EOF or reset)."""


def frame(obj):
    """The bytes of one frame carrying obj (a dict, or raw bytes/str as the body)."""
    if isinstance(obj, (bytes, bytearray)):
        body = bytes(obj)
    elif isinstance(obj, str):
        body = obj.encode()
    else:
        body = json.dumps(obj, separators=(",", ":")).encode()
    return struct.pack("<I", len(body)) + body


class Conn:
    """One connection to the daemon.

    recv() returns (message, fds); request()/call() send a request with a fresh
    id and wait for its final reply, keeping its progress events in
    self.events[id] and any unrelated frame in self.backlog.
    """

    def __init__(self, path, hello=True, timeout=60.0, client="integration-tests", handles=None, features=None):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # A blocking connect waits for room in a full listen backlog (a
        # nonblocking one fails with EAGAIN); the per-test time limit bounds it.
        self.sock.connect(path)
        self.sock.settimeout(timeout)
        self.next_id = 1
        self.events = {}
        self.backlog = []
        self.hello_reply = None
        if hello:
            # handles: the handle kinds this client accepts; None sends none (as clients did before the field).
            extra = {} if handles is None else {"handles": handles}
            if features is not None:  # the attach features asked for (tensor_table)
                extra["features"] = features
            self.hello_reply = self.call("hello", protocol=PROTOCOL, client=client, **extra)

    # ---- context management ----------------------------------------------

    def close(self):
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def settimeout(self, t):
        self.sock.settimeout(t)

    # ---- raw sending ------------------------------------------------------

    def send_raw(self, data, fds=None):
        """Sends bytes as they are; fds (if any) ride on the first byte."""
        if fds:
            anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
            n = self.sock.sendmsg([data], anc)
            if n < len(data):
                self.sock.sendall(data[n:])
        else:
            self.sock.sendall(data)

    def send(self, obj, fds=None):
        self.send_raw(frame(obj), fds)

    # ---- receiving --------------------------------------------------------

    def _recv_exact(self, n, fds):
        buf = bytearray()
        while len(buf) < n:
            try:
                data, anc, flags, _ = self.sock.recvmsg(
                    n - len(buf), socket.CMSG_SPACE(MAX_FDS * 4), socket.MSG_CMSG_CLOEXEC)
            except ConnectionResetError as e:
                raise Closed(f"connection reset after {len(buf)} of {n} bytes") from e
            for level, kind, cdata in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    a = array.array("i")
                    a.frombytes(cdata[: len(cdata) - len(cdata) % a.itemsize])
                    fds.extend(a)
            if flags & socket.MSG_CTRUNC:
                raise AssertionError("the daemon sent more descriptors than a frame may carry")
            if not data:
                raise Closed(f"EOF after {len(buf)} of {n} bytes")
            buf += data
        return bytes(buf)

    def recv(self):
        """One frame: (parsed JSON, list of received fds)."""
        fds = []
        try:
            hdr = self._recv_exact(4, fds)
            (n,) = struct.unpack("<I", hdr)
            assert 0 < n <= MAX_FRAME, f"the daemon sent a frame of {n} bytes"
            body = self._recv_exact(n, fds)
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return json.loads(body), fds

    def recv_msg(self):
        """One frame whose descriptors are closed; the parsed JSON."""
        msg, fds = self.recv()
        for fd in fds:
            os.close(fd)
        return msg

    def expect_closed(self, timeout=5.0):
        """Reads until EOF; returns the frames read before it."""
        self.sock.settimeout(timeout)
        got = []
        while True:
            try:
                got.append(self.recv_msg())
            except Closed:
                return got

    # ---- requests ---------------------------------------------------------

    def take_id(self):
        i = self.next_id
        self.next_id += 1
        return i

    def start(self, op, **fields):
        """Sends a request without waiting; returns its id."""
        rid = fields.pop("id", None)
        if rid is None:
            rid = self.take_id()
        req = {"op": op, "id": rid}
        req.update(fields)
        self.send(req)
        return rid

    def wait(self, rid, on_event=None):
        """The final reply to request rid: (reply, fds). Events go to self.events."""
        for i, (m, fds) in enumerate(self.backlog):
            if m.get("id") == rid and "event" not in m:
                del self.backlog[i]
                return m, fds
        while True:
            m, fds = self.recv()
            if m.get("id") == rid:
                if "event" in m:
                    assert not fds
                    self.events.setdefault(rid, []).append(m)
                    if on_event is not None:
                        on_event(m)
                    continue
                return m, fds
            self.backlog.append((m, fds))

    def request(self, op, **fields):
        """Sends op and returns (final reply, fds), error replies included."""
        return self.wait(self.start(op, **fields))

    def call(self, op, **fields):
        """Sends op and returns its successful reply; raises WDError on an error reply.

        Received descriptors are closed: use request() to keep them.
        """
        m, fds = self.request(op, **fields)
        for fd in fds:
            os.close(fd)
        if "error" in m:
            raise WDError(m)
        assert m.get("ok") is True, m
        return m

    def error(self, op, **fields):
        """Sends op, which must fail; returns the error code."""
        m, fds = self.request(op, **fields)
        for fd in fds:
            os.close(fd)
        assert "error" in m, f"{op} {fields} succeeded: {m}"
        assert "ok" not in m, m
        return m["error"]["code"]

    def status(self):
        return self.call("status")

    def attach(self, **fields):
        """attach: (reply, memfd). The caller owns the fd."""
        m, fds = self.request("attach", **fields)
        if "error" in m:
            for fd in fds:
                os.close(fd)
            raise WDError(m)
        handles = m["handles"]
        assert len(handles) == 1 and handles[0]["kind"] == "fd", m
        assert len(fds) == 1, f"attach carried {len(fds)} descriptors"
        assert handles[0]["fd_index"] == 0
        return m, fds[0]


# ---- safetensors --------------------------------------------------------------


class Shard:
    """One safetensors file: its header, parsed here, and a read-only mapping."""

    def __init__(self, path):
        self.path = path
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            hdr = json.loads(f.read(n))
            self.size = os.fstat(f.fileno()).st_size
            self.map = mmap.mmap(f.fileno(), 0, mmap.MAP_SHARED, mmap.PROT_READ) if self.size else None
        self.data_start = 8 + n
        hdr.pop("__metadata__", None)
        self.tensors = hdr

    def tensor_range(self, name):
        b, e = self.tensors[name]["data_offsets"]
        return self.data_start + b, self.data_start + e

    def close(self):
        if self.map is not None:
            self.map.close()
            self.map = None


class Checkpoint:
    """A checkpoint: a .safetensors file, or a directory with an index or model.safetensors."""

    def __init__(self, path):
        self.path = path
        self.shards = {}
        self.where = {}  # tensor name -> shard file name
        if os.path.isdir(path):
            index = os.path.join(path, "model.safetensors.index.json")
            if os.path.exists(index):
                with open(index) as f:
                    wm = json.load(f)["weight_map"]
                for fname in sorted(set(wm.values())):
                    self.shards[fname] = Shard(os.path.join(path, fname))
                self.where = dict(wm)
            else:
                self.shards["model.safetensors"] = Shard(os.path.join(path, "model.safetensors"))
        else:
            self.shards[os.path.basename(path)] = Shard(path)
        if not self.where:
            for fname, sh in self.shards.items():
                for t in sh.tensors:
                    self.where[t] = fname
        for name, fname in self.where.items():
            assert name in self.shards[fname].tensors, f"{name} not in {fname}"

    def header(self, name):
        return self.shards[self.where[name]].tensors[name]

    def tensor_bytes(self, name):
        sh = self.shards[self.where[name]]
        b, e = sh.tensor_range(name)
        return sh.map, b, e

    def payload_bytes(self):
        return sum(self.header(n)["data_offsets"][1] - self.header(n)["data_offsets"][0] for n in self.where)

    def close(self):
        for sh in self.shards.values():
            sh.close()


def map_readonly(fd):
    """Maps a whole memfd PROT_READ, MAP_SHARED; returns (mmap, size)."""
    size = os.fstat(fd).st_size
    return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ), size


CHUNK = 8 << 20


def ranges_equal(a, a0, b, b0, n):
    """Whether a[a0:a0+n] == b[b0:b0+n], compared in chunks."""
    off = 0
    while off < n:
        k = min(CHUNK, n - off)
        if a[a0 + off : a0 + off + k] != b[b0 + off : b0 + off + k]:
            return False
        off += k
    return True


def first_difference(a, a0, b, b0, n):
    """The first offset where the two ranges differ, or None."""
    off = 0
    while off < n:
        k = min(CHUNK, n - off)
        x = a[a0 + off : a0 + off + k]
        y = b[b0 + off : b0 + off + k]
        if x != y:
            for i in range(k):
                if x[i] != y[i]:
                    return off + i
        off += k
    return None


DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2,
               "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def write_safetensors(path, tensors, seed=0, metadata=None):
    """Writes a safetensors file. tensors: list of (name, dtype, shape).

    The bytes of each tensor are a deterministic function of (seed, name), never
    all equal, so a stale or misplaced copy shows as a difference.
    """
    hdr = {}
    off = 0
    for name, dtype, shape in tensors:
        n = DTYPE_BYTES[dtype]
        for d in shape:
            n *= d
        hdr[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    if metadata:
        hdr["__metadata__"] = metadata
    text = json.dumps(hdr, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name, dtype, shape in tensors:
            b, e = hdr[name]["data_offsets"]
            f.write(pattern_bytes(f"{seed}:{name}", e - b))
    os.replace(tmp, path)
    return off


def pattern_bytes(key, n):
    """n deterministic pseudo-random bytes keyed by key (a str)."""
    return random.Random(key).randbytes(n)


def wait_until(pred, timeout=10.0, interval=0.02, what="condition"):
    """Polls pred() until it returns a true value; returns it, or fails after timeout."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


# ---- checking an attached set -------------------------------------------------------

def expected_seals():
    import fcntl

    return fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def check_tensor_table(reply, ckpt, whole=True):
    """Checks an attach reply's tensor table against the files' headers.

    Returns {name: entry}. Offsets must be 256-aligned, inside the slab and
    non-overlapping; names, dtypes, shapes and byte counts must match.
    """
    slab = reply["bytes"]
    assert reply["handles"][0]["bytes"] == slab, reply["handles"]
    table = {}
    for t in reply["tensors"]:
        assert t["name"] not in table, f"tensor {t['name']} listed twice"
        table[t["name"]] = t
        h = ckpt.header(t["name"])
        assert t["dtype"] == h["dtype"], (t, h)
        assert t["shape"] == h["shape"], (t, h)
        b, e = h["data_offsets"]
        assert t["nbytes"] == e - b, (t, h)
        assert isinstance(t["offset"], int) and t["offset"] % ALIGN == 0, t
        assert 0 <= t["offset"] and t["offset"] + t["nbytes"] <= slab, (t, slab)
    if whole:
        assert set(table) == set(ckpt.where), set(ckpt.where) ^ set(table)
    spans = sorted((t["offset"], t["offset"] + t["nbytes"], t["name"]) for t in table.values())
    for (b0, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
        assert e0 <= b1, f"{n0} [{b0},{e0}) overlaps {n1} [{b1},{e1})"
    return table


def check_sealed(fd, size):
    """The memfd is sealed against writes, growth and shrinking, and cannot be mapped writable."""
    import errno
    import fcntl

    seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    want = expected_seals()
    assert seals & want == want, f"seals {seals:#x}, want at least {want:#x}"
    try:
        m = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as e:
        assert e.errno in (errno.EPERM, errno.EACCES), e
    else:
        m.close()
        raise AssertionError("a sealed memfd was mapped PROT_WRITE, MAP_SHARED")
    for bad in (lambda: os.pwrite(fd, b"x", 0), lambda: os.ftruncate(fd, size + 4096),
                lambda: os.ftruncate(fd, 0), lambda: fcntl.fcntl(fd, fcntl.F_ADD_SEALS, 0)):
        try:
            bad()
        except OSError as e:
            assert e.errno in (errno.EPERM, errno.EBADF, errno.EACCES), e
        else:
            raise AssertionError("a write, resize or seal change of the memfd succeeded")
    assert os.fstat(fd).st_size == size or os.fstat(fd).st_size >= size


def verify_attached(reply, fd, ckpt, names=None, whole=True):
    """Compares tensors of an attached set with the files byte for byte.

    names: the tensors to compare (default: all). Returns the bytes compared.
    """
    table = check_tensor_table(reply, ckpt, whole=whole)
    m, size = map_readonly(fd)
    try:
        assert size >= reply["bytes"], (size, reply["bytes"])
        total = 0
        for name in names if names is not None else sorted(table):
            t = table[name]
            src, b, e = ckpt.tensor_bytes(name)
            if not ranges_equal(m, t["offset"], src, b, e - b):
                d = first_difference(m, t["offset"], src, b, e - b)
                raise AssertionError(f"tensor {name}: byte {d} of {e - b} differs from the file "
                                     f"(slab offset {t['offset']})")
            total += e - b
        return total
    finally:
        m.close()


# ---- tensor digests (common/manifest.h) -------------------------------------------------

LEAF_BYTES = 256 << 10


def tensor_digest(b):
    """A tensor digest as hex (manifest.h's tree), from the PyPI xxhash package: XXH3-128 of the bytes
    when they fit one LEAF_BYTES leaf, else XXH3-128 of the canonical digests of their leaves (from the
    first byte, the last one shorter), concatenated in order. Chunk and file digests are plain XXH3-128."""
    import xxhash  # only the tests that check digests need it (tests/requirements.txt)
    b = memoryview(b).cast("B")
    if len(b) <= LEAF_BYTES:
        return xxhash.xxh3_128(b).hexdigest()
    leaves = b"".join(xxhash.xxh3_128(b[i:i + LEAF_BYTES]).digest() for i in range(0, len(b), LEAF_BYTES))
    return xxhash.xxh3_128(leaves).hexdigest()


# ---- the binary tensor table and the progress page (docs/protocol.md) -----------------

_M64 = (1 << 64) - 1
_P1, _P2, _P3, _P4, _P5 = (11400714785074694791, 14029467366897019727, 1609587929392839161,
                           9650029242287828579, 2870177450012600261)


def _rotl(x, r):
    return ((x << r) | (x >> (64 - r))) & _M64


def _xround(acc, v):
    return (_rotl((acc + v * _P2) & _M64, 31) * _P1) & _M64


def xxh64(data):
    """XXH64 with seed 0, written from its specification (the table's checksum)."""
    n, p = len(data), 0
    if n >= 32:
        v = [(_P1 + _P2) & _M64, _P2, 0, (-_P1) & _M64]
        words = struct.unpack_from(f"<{(n // 32) * 4}Q", data)
        for i in range(0, len(words), 4):
            v = [_xround(v[k], words[i + k]) for k in range(4)]
        p = (n // 32) * 32
        h = (_rotl(v[0], 1) + _rotl(v[1], 7) + _rotl(v[2], 12) + _rotl(v[3], 18)) & _M64
        for x in v:
            h = ((h ^ _xround(0, x)) * _P1 + _P4) & _M64
    else:
        h = _P5
    h = (h + n) & _M64
    while n - p >= 8:
        (k,) = struct.unpack_from("<Q", data, p)
        h = (_rotl(h ^ _xround(0, k), 27) * _P1 + _P4) & _M64
        p += 8
    if n - p >= 4:
        (k,) = struct.unpack_from("<I", data, p)
        h = (_rotl(h ^ ((k * _P1) & _M64), 23) * _P2 + _P3) & _M64
        p += 4
    while p < n:
        h = (_rotl(h ^ ((data[p] * _P5) & _M64), 11) * _P1) & _M64
        p += 1
    h ^= h >> 33
    h = (h * _P2) & _M64
    h ^= h >> 29
    h = (h * _P3) & _M64
    return h ^ (h >> 32)


def parse_tensor_table(buf, check_sum=True):
    """Reads a binary tensor table (version 1) into {"slab_bytes", "tensors": [JSON-form entries]}.

    Written from docs/protocol.md, "The binary tensor table", as an oracle
    independent of libweightd's reader.
    """
    buf = bytes(buf)
    assert buf[:8] == b"WDTENSOR", buf[:8]
    version, header_bytes, checksum, total, slab, count, rec_off, rec_bytes, flags, dims_off, ndims, \
        index_off, strings_off, strings_bytes = struct.unpack_from("<IIQQQQQIIQQQQQ", buf, 8)
    assert version == 1 and header_bytes == 128 and flags == 0 and total == len(buf)
    if check_sum:
        assert checksum == xxh64(buf[24:]), "checksum"
    assert rec_off == header_bytes and rec_bytes == 64
    assert dims_off == rec_off + count * rec_bytes and index_off == dims_off + 8 * ndims
    assert strings_off == index_off + (4 * count + 7) // 8 * 8 and strings_off + strings_bytes == total
    tensors = []
    for i in range(count):
        off, nbytes, dim0, ndim, name_len, name_off = struct.unpack_from("<QQQIIQ", buf, rec_off + i * rec_bytes)
        dtype = buf[rec_off + i * rec_bytes + 40: rec_off + i * rec_bytes + 56].rstrip(b"\0").decode()
        shape = list(struct.unpack_from(f"<{ndim}q", buf, dims_off + 8 * dim0))
        name = buf[strings_off + name_off: strings_off + name_off + name_len].decode()
        assert buf[strings_off + name_off + name_len] == 0
        tensors.append({"name": name, "dtype": dtype, "shape": shape, "offset": off, "nbytes": nbytes})
    index = struct.unpack_from(f"<{count}I", buf, index_off)
    names = [tensors[i]["name"].encode() for i in index]
    assert names == sorted(names) and len(set(names)) == count, "the index orders the names"
    return {"slab_bytes": slab, "tensors": tensors}


def read_fd(fd, size):
    """The first size bytes of a memfd."""
    return os.pread(fd, size, 0)


STATES = {0: "loading", 1: "ready", 2: "failed", 3: "canceled"}


class ProgressPage:
    """An early attach's progress page, mapped read-only (docs/protocol.md, "The progress page")."""

    def __init__(self, fd):
        self.map = mmap.mmap(fd, 4096, mmap.MAP_SHARED, mmap.PROT_READ)
        magic, version = struct.unpack_from("<II", self.map, 0)
        assert magic == 0x50504457 and version == 1, (hex(magic), version)

    def read(self):
        """(seq, state name, ready_bytes, total_bytes, error code, message)."""
        seq, state, ready, total, error = struct.unpack_from("<IIQQi", self.map, 8)
        msg = self.map[64:64 + 256].split(b"\0", 1)[0].decode(errors="replace")
        return seq, STATES.get(state, state), ready, total, error, msg

    @property
    def state(self):
        return self.read()[1]

    @property
    def ready(self):
        return self.read()[2]

    def close(self):
        self.map.close()
