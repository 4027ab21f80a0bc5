"""The tensor table of a checkpoint directory from its safetensors headers, and whole-tensor plans.

Only the index and the headers are read (a few kilobytes per shard), never
tensor data: the daemon reads that. The plugin needs the table for the
tensors it hands to vLLM's own ``load_weights`` (an explicit plan names each
output's dtype and shape, docs/protocol.md "Explicit plans"). The daemon
validates every header itself; this reader only has to find names, dtypes
and shapes in files the daemon accepts.
"""
from __future__ import annotations

import json
import os
import struct
from typing import Iterable

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
HEADER_LIMIT = 100_000_000


def is_url(path: str) -> bool:
    """Whether `path` names a checkpoint by URL (s3://, http://, https://), which the daemon fetches from its
    remote roots: there are no local files to read here."""
    scheme, sep, _ = str(path).partition("://")
    return bool(sep) and scheme.lower() in ("s3", "http", "https")


def _files(path: str) -> list[str]:
    if is_url(path):
        raise FileNotFoundError(f"{path}: a checkpoint named by URL has no local files to read here (only the "
                                f"daemon fetches it)")
    if os.path.isfile(path):
        return [path]
    if os.path.exists(os.path.join(path, SINGLE)):  # read first, as transformers and the daemon do
        return [os.path.join(path, SINGLE)]
    index = os.path.join(path, INDEX)
    if os.path.exists(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        return [os.path.join(path, n) for n in sorted(set(weight_map.values()))]
    raise FileNotFoundError(f"{path}: neither {SINGLE} nor {INDEX}")


def header(file: str) -> dict:
    """The tensor entries of one safetensors file's header (``__metadata__`` left out)."""
    with open(file, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{file}: shorter than a safetensors header")
        (n,) = struct.unpack("<Q", raw)
        if n > HEADER_LIMIT:
            raise ValueError(f"{file}: header of {n} bytes")
        text = f.read(n)
    h = json.loads(text.decode("utf-8"))
    h.pop("__metadata__", None)
    return h


def tensor_table(path: str) -> dict[str, tuple[str, list[int]]]:
    """{tensor name: (dtype, shape)} of every tensor of the checkpoint at `path`."""
    out: dict[str, tuple[str, list[int]]] = {}
    for file in _files(path):
        for name, info in header(file).items():
            if isinstance(info, list):  # serde's array form: [dtype, shape, data_offsets]
                dtype, shape = info[0], info[1]
            else:
                dtype, shape = info["dtype"], info["shape"]
            out[name] = (dtype, list(shape))
    return out


def whole_plan(names: Iterable[str], table: dict[str, tuple[str, list[int]]]) -> dict:
    """The explicit plan that serves each named checkpoint tensor whole, under its own name."""
    outputs = []
    for name in sorted(set(names)):
        dtype, shape = table[name]
        outputs.append({"name": name, "dtype": dtype, "shape": list(shape), "pieces": [{"tensor": name}]})
    return {"outputs": outputs}
