"""Shared helpers for the reference cross-checks.

The reference is the `safetensors` package (0.8.0), used only through
`safetensors.serialize` (raw buffers described by `TensorSpec`) and
`safetensors.deserialize(bytes)`. The thing under test is
`weightctl inspect PATH [--json]` (the binary named by $WEIGHTCTL).
"""
import ctypes
import json
import os
import re
import shutil
import socket
import struct
import subprocess
import tempfile
import time
from dataclasses import dataclass, field

import safetensors

# Bits per element of every dtype the reference knows (safetensors/src/tensor.rs
# `Dtype::bitsize`). test_reference.py checks this table against the installed
# package, so a drift in either shows up as a failure, not a silent skip.
DTYPE_BITS = {
    "BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8,
    "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32,
    "C64": 64, "F64": 64, "I64": 64, "U64": 64,
}

# The names `TensorSpec(dtype=...)` takes for each header dtype. F6_* have no
# constructor name in 0.8.0; files holding them are packed by hand (pack()).
SPEC_DTYPE = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16",
    "I32": "int32", "U32": "uint32", "I64": "int64", "U64": "uint64",
    "F16": "float16", "F32": "float32", "F64": "float64", "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn", "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2": "float8_e5m2", "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F8_E8M0": "float8_e8m0fnu", "F4": "float4_e2m1fn_x2", "C64": "complex64",
}

CTL_TIMEOUT_S = 60


def weightctl_path():
    """The weightctl binary: $WEIGHTCTL, else build/weightctl in the repository."""
    path = os.environ.get("WEIGHTCTL")
    if not path:
        here = os.path.dirname(os.path.abspath(__file__))
        path = os.path.join(here, "..", "..", "build", "weightctl")
    return os.path.abspath(path)


def tensor_bytes(dtype, shape):
    """Byte count of a tensor (assumes the bit count is whole bytes)."""
    n = 1
    for d in shape:
        n *= d
    return n * DTYPE_BITS[dtype] // 8


def fill(nbytes, seed):
    """Deterministic non-trivial bytes (never all zero when nbytes > 0)."""
    out = bytearray()
    x = (seed * 2654435761 + 12345) & 0xFFFFFFFF
    while len(out) < nbytes:
        x = (x * 1103515245 + 12345) & 0xFFFFFFFF
        out += struct.pack("<I", x | 0x01010101)
    return bytes(out[:nbytes])


# ---------------------------------------------------------------------------
# Writing files.

def serialize(tensors, metadata=None):
    """Serializes {name: (dtype, shape, data)} with the reference package.

    dtype is the header code ("BF16"), shape the logical shape written in the
    header, data the raw bytes. For F4, TensorSpec doubles the last dimension
    (it takes the packed storage shape), so it is halved here.
    """
    keep = []
    specs = {}
    for name, (dtype, shape, data) in tensors.items():
        buf = ctypes.create_string_buffer(bytes(data), max(1, len(data)))
        keep.append(buf)
        spec_shape = list(shape)
        if dtype == "F4" and spec_shape:
            assert spec_shape[-1] % 2 == 0, "F4 needs an even last dimension"
            spec_shape[-1] //= 2
        specs[name] = safetensors.TensorSpec(dtype=SPEC_DTYPE[dtype], shape=spec_shape,
                                             data_ptr=ctypes.addressof(buf), data_len=len(data))
        assert specs[name].shape == list(shape)
    out = safetensors.serialize(specs, metadata)
    del keep
    return bytes(out)


def pack(header, data=b"", n=None, tail=b""):
    """A file: 8-byte little-endian n, the header (str or bytes), data, tail.

    n defaults to the header's length; pass it to lie about the length.
    """
    hb = header.encode("utf-8") if isinstance(header, str) else bytes(header)
    if n is None:
        n = len(hb)
    return struct.pack("<Q", n) + hb + bytes(data) + bytes(tail)


def pack_tensors(entries, metadata=None, pad_to=1, data_seed=0):
    """A valid file laid out by hand from [(name, dtype, shape)], in order.

    Used for what serialize() cannot write (F6 dtypes). Returns the bytes.
    """
    header = {}
    if metadata is not None:
        header["__metadata__"] = metadata
    data = bytearray()
    for i, (name, dtype, shape) in enumerate(entries):
        nb = tensor_bytes(dtype, shape)
        header[name] = {"dtype": dtype, "shape": list(shape),
                        "data_offsets": [len(data), len(data) + nb]}
        data += fill(nb, data_seed + i)
    hb = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    if len(hb) % pad_to:
        hb += b" " * (pad_to - len(hb) % pad_to)
    return pack(hb, data)


# ---------------------------------------------------------------------------
# The reference's view of a file.

@dataclass
class RefTensor:
    dtype: str
    shape: list
    begin: int
    end: int


@dataclass
class RefFile:
    ok: bool
    error: str = ""
    n: int = 0
    file_bytes: int = 0
    tensors: dict = field(default_factory=dict)  # name -> RefTensor
    metadata: object = None  # dict or None

    @property
    def data_bytes(self):
        return self.file_bytes - 8 - self.n


def _dtype_of(v):
    if isinstance(v, dict):  # the {"F32": null} enum form serde accepts
        (k,) = v.keys()
        return k
    return v


def reference(buf, on_tensor=None):
    """The reference verdict on a file's bytes, and on success its layout.

    Names, dtypes, shapes and data come from `safetensors.deserialize`. It
    does not report offsets, so they come from parsing the header here; each
    tensor's data from deserialize must equal the file bytes at those offsets,
    which ties the two together. on_tensor(name, data), when given, sees
    each tensor's data as deserialize returned it.
    """
    buf = bytes(buf)
    try:
        items = safetensors.deserialize(buf)
    except Exception as e:  # noqa: BLE001 - any failure is the verdict
        return RefFile(ok=False, error=f"{type(e).__name__}: {e}", file_bytes=len(buf))
    (n,) = struct.unpack("<Q", buf[:8])
    header = json.loads(buf[8:8 + n].decode("utf-8"))
    meta = header.pop("__metadata__", None)
    out = RefFile(ok=True, n=n, file_bytes=len(buf), metadata=meta)
    start = 8 + n
    view = memoryview(buf)
    for name, info in items:
        raw = header[name]
        if isinstance(raw, list):
            dt, shape, offs = raw
        else:
            dt, shape, offs = raw["dtype"], raw["shape"], raw["data_offsets"]
        dt = _dtype_of(dt)
        assert dt == info["dtype"] and list(shape) == list(info["shape"]), (name, raw, info)
        b, e = offs
        data = info["data"]
        assert len(data) == e - b and data == view[start + b:start + e], (
            f"reference data of {name!r} differs from file bytes at {b}..{e}")
        if on_tensor is not None:
            on_tensor(name, data)
        out.tensors[name] = RefTensor(info["dtype"], list(info["shape"]), b, e)
    assert len(out.tensors) == len(items)
    return out


def reference_dtypes():
    """The dtype names the installed package accepts, from its own error text."""
    probe = pack('{"t":{"dtype":"NO_SUCH_DTYPE","shape":[],"data_offsets":[0,0]}}')
    try:
        safetensors.deserialize(probe)
    except Exception as e:  # noqa: BLE001
        m = re.search(r"expected one of (.*?) at line", str(e))
        assert m, str(e)
        return re.findall(r"`([A-Z0-9_]+)`", m.group(1))
    raise AssertionError("the reference accepted an unknown dtype")


# ---------------------------------------------------------------------------
# Running weightctl.

@dataclass
class CtlResult:
    args: list
    returncode: int
    stdout: str
    stderr: str

    def describe(self):
        return (f"weightctl {' '.join(self.args)}: exit {self.returncode}\n"
                f"  stderr: {self.stderr!r}\n  stdout: {self.stdout[:400]!r}")


def run_ctl(args, timeout=CTL_TIMEOUT_S, cwd=None):
    """Runs weightctl; a death by signal or a timeout fails the test."""
    p = subprocess.run([weightctl_path()] + list(args), capture_output=True, timeout=timeout, cwd=cwd)
    res = CtlResult(list(args), p.returncode, p.stdout.decode("utf-8", "replace"),
                    p.stderr.decode("utf-8", "replace"))
    assert p.returncode >= 0, f"killed by signal {-p.returncode}: " + res.describe()
    return res


def error_line_problem(res):
    """None when res is a clean failure (exit 1, one 'weightctl: ' stderr line)."""
    if res.returncode != 1:
        return f"expected exit 1, got {res.returncode}"
    lines = res.stderr.splitlines()
    if len(lines) != 1 or not res.stderr.endswith("\n"):
        return f"expected exactly one stderr line, got {len(lines)}: {res.stderr!r}"
    if not lines[0].startswith("weightctl: "):
        return f"stderr line does not start with 'weightctl: ': {lines[0]!r}"
    return None


def inspect_json(path):
    """Runs inspect --json; returns (CtlResult, parsed JSON or None)."""
    res = run_ctl(["inspect", str(path), "--json"])
    if res.returncode != 0:
        return res, None
    try:
        return res, json.loads(res.stdout)
    except ValueError as e:
        raise AssertionError(f"inspect --json printed invalid JSON ({e}): {res.stdout[:800]!r}")


def expect_error(path, *needles):
    """inspect PATH must fail cleanly, its message naming each needle."""
    res = run_ctl(["inspect", str(path)])
    problem = error_line_problem(res)
    assert problem is None, problem + "\n" + res.describe()
    for needle in needles:
        assert needle in res.stderr, f"message does not name {needle!r}: {res.stderr!r}"
    return res


# ---------------------------------------------------------------------------
# Comparing inspect --json with the reference.

def short(value, limit=160):
    """repr(value), cut to limit characters."""
    r = repr(value)
    return r if len(r) <= limit else r[:limit] + f"...({len(r)} chars)"


def describe_difference(got, want):
    """A short account of how weightctl's value differs from the reference's."""
    if isinstance(got, dict) and isinstance(want, dict):
        keys = sorted(set(got) | set(want), key=repr)
        diff = [f"[{short(k, 60)}] weightctl {short(got.get(k, '<absent>'))}, "
                f"reference {short(want.get(k, '<absent>'))}"
                for k in keys if got.get(k, object()) != want.get(k, object())]
        return f"{len(diff)} entries differ: " + "; ".join(diff[:8])
    return f"weightctl says {short(got)}, reference {short(want)}"


def compare_shard(ref, shard, index, tensors_json, expect_file=None):
    """Mismatches between one shard of inspect --json and a RefFile."""
    bad = []

    def eq(what, got, want):
        if got != want:
            bad.append(f"{what}: " + describe_difference(got, want))

    if expect_file is not None:
        eq("shard file", shard.get("file"), expect_file)
    eq("shard tensors", shard.get("tensors"), len(ref.tensors))
    eq("header_bytes", shard.get("header_bytes"), ref.n)
    eq("data_start", shard.get("data_start"), 8 + ref.n)
    eq("data_bytes", shard.get("data_bytes"), ref.data_bytes)
    eq("file_bytes", shard.get("file_bytes"), ref.file_bytes)
    eq("metadata", shard.get("metadata"), ref.metadata)
    mine = [t for t in tensors_json if t.get("shard") == index]
    got_names = [t.get("name") for t in mine]
    if sorted(got_names, key=repr) != sorted(ref.tensors, key=repr):
        missing = sorted(set(ref.tensors) - set(got_names), key=repr)[:10]
        extra = sorted(set(got_names) - set(ref.tensors), key=repr)[:10]
        bad.append(f"tensor names differ: {len(got_names)} vs {len(ref.tensors)}; "
                   f"missing {missing!r}, unexpected {extra!r}")
    for t in mine:
        r = ref.tensors.get(t.get("name"))
        if r is None:
            continue
        nm = t["name"]
        eq(f"{nm!r} dtype", t.get("dtype"), r.dtype)
        eq(f"{nm!r} shape", t.get("shape"), r.shape)
        eq(f"{nm!r} data_offsets", t.get("data_offsets"), [r.begin, r.end])
    return bad


def compare_file(ref, js, file_name):
    """Mismatches between inspect --json of one bare file and a RefFile."""
    bad = []
    if js.get("layout") != "file":
        bad.append(f"layout {js.get('layout')!r}, expected 'file'")
    shards = js.get("shards") or []
    if len(shards) != 1:
        return bad + [f"{len(shards)} shards, expected 1"]
    tensors = js.get("tensors") or []
    bad += compare_shard(ref, shards[0], 0, tensors, expect_file=file_name)
    bad += compare_totals(js, [ref])
    return bad


def compare_totals(js, refs):
    """Mismatches in the checkpoint-wide fields against RefFiles (one per shard)."""
    bad = []
    all_t = [t for r in refs for t in r.tensors.values()]
    if js.get("tensor_count") != len(all_t):
        bad.append(f"tensor_count {js.get('tensor_count')!r}, reference {len(all_t)}")
    total = sum(t.end - t.begin for t in all_t)
    if js.get("total_bytes") != total:
        bad.append(f"total_bytes {js.get('total_bytes')!r}, reference {total}")
    by = {}
    for t in all_t:
        by[t.dtype] = by.get(t.dtype, 0) + (t.end - t.begin)
    got = {k: v for k, v in (js.get("bytes_by_dtype") or {}).items() if v}
    want = {k: v for k, v in by.items() if v}
    if got != want:
        bad.append("bytes_by_dtype: " + describe_difference(got, want))
    tensors = js.get("tensors") or []
    try:
        keys = [(t["shard"], t["data_offsets"][0]) for t in tensors]
        if keys != sorted(keys):
            bad.append("tensors are not sorted by shard, then begin offset")
    except (KeyError, IndexError, TypeError) as e:
        bad.append(f"a tensor entry lacks shard or data_offsets: {e!r}")
    return bad


def hexdump_case(buf, limit=4096):
    """The case's prefix and header as hex, plus how the rest looks."""
    head_len = 8
    if len(buf) >= 8:
        (n,) = struct.unpack("<Q", buf[:8])
        head_len = 8 + min(n, len(buf) - 8)
    head = buf[:min(head_len, limit)]
    more = "" if head_len <= limit else f" ...(+{head_len - limit} header bytes)"
    return (f"file {len(buf)} bytes; prefix+header hex: {head.hex()}{more}; "
            f"{len(buf) - head_len} bytes after the header")


# ---- a daemon for tests that go through it -------------------------------------------------------

SANITIZER_MARKS = ("ERROR: AddressSanitizer", "LeakSanitizer", "runtime error:", "ThreadSanitizer")


def weightd_path():
    """$WEIGHTD, else the weightd beside $WEIGHTCTL."""
    p = os.environ.get("WEIGHTD") or os.path.join(os.path.dirname(weightctl_path()), "weightd")
    return os.path.abspath(p)


class Daemon:
    """A weightd (host backend) on a private socket, serving model_root."""

    def __init__(self, model_root, extra=()):
        self.dir = tempfile.mkdtemp(prefix="wdpy-")
        self.socket = os.path.join(self.dir, "s")
        self.log_path = os.path.join(self.dir, "log")
        self.log = open(self.log_path, "wb")
        env = dict(os.environ)
        env.pop("WEIGHTD_SOCKET", None)
        self.proc = subprocess.Popen([weightd_path(), "--foreground", "--backend", "host", "--socket", self.socket,
                                      "--model-root", str(model_root), "--log-level", "warn",
                                      "--set", "metrics_address=", *extra],  # no metrics port shared with other tests
                                     stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 30
        while not self.listening():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                log = self.log_text()
                self.stop()
                raise AssertionError("weightd did not start:\n" + log)
            time.sleep(0.01)

    def listening(self):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(self.socket)
            return True
        except OSError:
            return False
        finally:
            s.close()

    def log_text(self):
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def stop(self):
        """Stops the daemon; returns a complaint (bad exit, sanitizer report) or None."""
        complaint = None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                complaint = "weightd did not stop within 30 s of SIGTERM"
        self.log.close()
        text = self.log_text()
        if complaint is None and self.proc.returncode != 0:
            complaint = f"weightd exited with {self.proc.returncode}"
        if complaint is None and any(m in text for m in SANITIZER_MARKS):
            complaint = "sanitizer report in weightd's log"
        shutil.rmtree(self.dir, ignore_errors=True)
        return complaint and complaint + ":\n" + text[-6000:]
