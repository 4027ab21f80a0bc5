"""An independent reference for the plan presets of docs/protocol.md ("Plans").

Written from the protocol document alone (vLLM's tensor-parallel semantics):
given a checkpoint and a preset spec it lists the outputs one rank must get,
each as pieces of source tensors ({"tensor", "dim", "start", "end"} or
{"zeros": rows}), and computes their bytes with numpy views (BF16/F16 as
uint16, F8 as uint8, F32 as uint32: bytes only, never values). A spec the
document says cannot be served raises Impossible, which lists every problem
with the names (tensors, config keys, fields) a refusal may mention.

    ck = Checkpoint(path)
    outs = build(ck, preset="auto", tp_size=2, tp_rank=1, fuse=True)
    data = materialize(ck, outs["model.layers.0.self_attn.qkv_proj.weight"])
"""
import json
import os
import re
import struct
from dataclasses import dataclass, field

import numpy as np

import stref

VOCAB_PAD = 64

AUTO = {
    "qwen3": "dense", "qwen2": "dense", "llama": "dense", "mistral": "dense",
    "qwen3_moe": "qwen3_moe", "qwen2_moe": "qwen3_moe",
    "deepseek_v3": "deepseek_v3", "deepseek_v2": "deepseek_v3", "glm4_moe": "deepseek_v3",
    "kimi_k2": "deepseek_v3",
}
FAMILIES = ("dense", "qwen3_moe", "deepseek_v3")

_UINT = {1: np.uint8, 2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}


# ---- reading a checkpoint -----------------------------------------------------


def read_header(buf):
    """(header dict without __metadata__, metadata, data start) of a safetensors file."""
    (n,) = struct.unpack("<Q", buf[:8])
    header = json.loads(bytes(buf[8:8 + n]).decode("utf-8"))
    meta = header.pop("__metadata__", None)
    return header, meta, 8 + n


@dataclass
class SourceTensor:
    dtype: str
    shape: list
    file: str
    begin: int
    end: int


class Checkpoint:
    """A checkpoint directory (index or model.safetensors) or a bare file, read whole."""

    def __init__(self, path):
        self.path = str(path)
        self.tensors = {}
        self.files = {}
        self.metadata = {}
        self.config = None
        if os.path.isdir(self.path):
            index = os.path.join(self.path, "model.safetensors.index.json")
            if os.path.exists(index):
                with open(index) as f:
                    wmap = json.load(f)["weight_map"]
                files = sorted(set(wmap.values()))
            else:
                files = ["model.safetensors"]
            cfg = os.path.join(self.path, "config.json")
            if os.path.exists(cfg):
                with open(cfg) as f:
                    self.config = json.load(f)
            base = self.path
        else:
            base, files = os.path.dirname(self.path), [os.path.basename(self.path)]
        for fname in files:
            with open(os.path.join(base, fname), "rb") as f:
                buf = f.read()
            header, meta, start = read_header(buf)
            self.files[fname] = buf
            self.metadata[fname] = meta
            for name, info in header.items():
                assert name not in self.tensors, f"{name} in two shards"
                b, e = info["data_offsets"]
                self.tensors[name] = SourceTensor(info["dtype"], list(info["shape"]), fname, start + b, start + e)

    def has(self, name):
        return name in self.tensors

    def shape(self, name):
        return self.tensors[name].shape

    def dtype(self, name):
        return self.tensors[name].dtype

    def raw(self, name):
        t = self.tensors[name]
        return self.files[t.file][t.begin:t.end]

    def array(self, name):
        """The tensor as an unsigned-integer array of its element size, its shape."""
        t = self.tensors[name]
        size = stref.DTYPE_BITS[t.dtype] // 8
        a = np.frombuffer(self.files[t.file], dtype=_UINT[size], count=(t.end - t.begin) // size,
                          offset=t.begin)
        return a.reshape(t.shape)


# ---- plans --------------------------------------------------------------------


@dataclass
class Piece:
    tensor: str = None  # None: zeros
    dim: int = 0
    start: int = 0
    end: int = 0  # for zeros, end - start is the row count

    def spec(self):
        if self.tensor is None:
            return {"zeros": self.end - self.start}
        return {"tensor": self.tensor, "dim": self.dim, "start": self.start, "end": self.end}


@dataclass
class Output:
    name: str
    dtype: str
    shape: list
    pieces: list = field(default_factory=list)

    @property
    def nbytes(self):
        return stref.tensor_bytes(self.dtype, self.shape)

    def spec(self):
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape),
                "pieces": [p.spec() for p in self.pieces]}


@dataclass
class Problem:
    message: str
    needles: list  # any one of these in a refusal message names the problem


class Impossible(Exception):
    def __init__(self, problems):
        self.problems = problems
        super().__init__("; ".join(p.message for p in problems))

    def needles(self):
        return [n for p in self.problems for n in p.needles]


def family_of(config, preset):
    """The family a preset means for this config, or None when auto cannot tell."""
    if preset == "auto":
        return AUTO.get((config or {}).get("model_type"))
    return preset


class _Builder:
    def __init__(self, ck, family, tp, tpr, ep, epr, experts, fuse):
        self.ck, self.family = ck, family
        self.cfg = ck.config or {}
        self.tp, self.tpr, self.ep, self.epr = tp, tpr, ep, epr
        self.experts, self.fuse = experts, fuse
        self.outputs = {}
        self.used = set()
        self.problems = []

    # -- helpers --

    def problem(self, message, *needles):
        self.problems.append(Problem(message, [n for n in needles if n]))

    def whole(self, name):
        shape = self.ck.shape(name)
        return Piece(name, 0, 0, shape[0] if shape else 1)

    def take(self, name):
        self.used.add(name)
        return name

    def emit(self, name, dtype, shape, pieces):
        assert name not in self.outputs, name
        self.outputs[name] = Output(name, dtype, list(shape), pieces)

    def piece_shape(self, p):
        shape = list(self.ck.shape(p.tensor))
        if shape:
            shape[p.dim] = p.end - p.start
        return shape

    def single(self, name, piece):
        """An output holding one piece of a source tensor, under the source's name."""
        self.take(name)
        self.emit(name, self.ck.dtype(name), self.piece_shape(piece), [piece])

    def replicated(self, name):
        if self.ck.has(name):
            self.single(name, self.whole(name))

    def split(self, n, parts, rank, what, *needles):
        """[lo, hi) of rank's equal share of n, or None (a problem) when parts does not divide n."""
        if n % parts:
            self.problem(f"{what}: {n} does not divide by {parts}", *needles)
            return None
        k = n // parts
        return rank * k, (rank + 1) * k

    def sliced(self, name, dim, parts, rank, what, *needles):
        """The piece of rank's share of tensor name along dim, or None."""
        shape = self.ck.shape(name)
        r = self.split(shape[dim], parts, rank, what, name, *needles)
        if r is None:
            return None
        return Piece(name, dim, r[0], r[1])

    def concat(self, name, pieces, stack=0):
        """An output of pieces laid end to end (stack: that many stacked groups)."""
        if any(p is None for p in pieces):
            return
        for p in pieces:
            self.take(p.tensor)
        dtypes = {self.ck.dtype(p.tensor) for p in pieces}
        assert len(dtypes) == 1, (name, dtypes)
        shapes = [self.piece_shape(p) for p in pieces]
        rest = {tuple(s[1:]) for s in shapes}
        assert len(rest) == 1, (name, shapes)
        rows = sum(s[0] for s in shapes)
        if stack:
            assert rows % stack == 0
            shape = [stack, rows // stack] + list(shapes[0][1:])
        else:
            shape = [rows] + list(shapes[0][1:])
        self.emit(name, dtypes.pop(), shape, pieces)

    # -- the parts of a model --

    def vocab(self, name):
        if not self.ck.has(name):
            return
        self.take(name)
        shape = self.ck.shape(name)
        v = shape[0]
        vp = -(-v // VOCAB_PAD) * VOCAB_PAD
        if vp % self.tp:
            self.problem(f"{name}: padded vocabulary {vp} does not divide by tp_size {self.tp}",
                         name, "vocab", "tp_size")
            return
        per = vp // self.tp
        lo, hi = self.tpr * per, (self.tpr + 1) * per
        pieces = []
        if lo < v:
            pieces.append(Piece(name, 0, lo, min(hi, v)))
        if hi > max(lo, v):
            pieces.append(Piece(None, 0, 0, hi - max(lo, v)))
        self.emit(name, self.ck.dtype(name), [per] + shape[1:], pieces)

    def column(self, name, what, *needles):
        return self.sliced(name, 0, self.tp, self.tpr, what, *needles) if self.ck.has(name) else None

    def row(self, name, what, *needles):
        return self.sliced(name, 1, self.tp, self.tpr, what, *needles) if self.ck.has(name) else None

    def kv_piece(self, name, kv_heads):
        shape = self.ck.shape(name)
        if shape[0] % kv_heads:
            self.problem(f"{name}: {shape[0]} rows are not {kv_heads} heads", name, "num_key_value_heads")
            return None
        hd = shape[0] // kv_heads
        if self.tp <= kv_heads:
            if kv_heads % self.tp:
                self.problem(f"{kv_heads} key/value heads do not divide by tp_size {self.tp}",
                             name, "num_key_value_heads", "heads", "tp_size")
                return None
            per = kv_heads // self.tp
            return Piece(name, 0, self.tpr * per * hd, (self.tpr + 1) * per * hd)
        if self.tp % kv_heads:
            self.problem(f"tp_size {self.tp} is not a multiple of {kv_heads} key/value heads",
                         name, "num_key_value_heads", "heads", "tp_size")
            return None
        h = self.tpr // (self.tp // kv_heads)
        return Piece(name, 0, h * hd, (h + 1) * hd)

    def heads_check(self):
        heads = self.cfg.get("num_attention_heads")
        if heads is None:
            self.problem("config.json lacks num_attention_heads", "num_attention_heads")
            return False
        if heads % self.tp:
            self.problem(f"{heads} attention heads do not divide by tp_size {self.tp}",
                         "num_attention_heads", "heads", "tp_size")
            return False
        return True

    def emit_group(self, fused_name, names_pieces):
        """Unfused: each piece under its source's name; fused: one concatenation."""
        if self.fuse:
            self.concat(fused_name, [p for _, p in names_pieces])
        else:
            for n, p in names_pieces:
                if p is not None:
                    self.single(n, p)

    def gqa_attention(self, p):
        a = p + ".self_attn."
        if not self.ck.has(a + "q_proj.weight"):
            return
        heads_ok = self.heads_check()
        kv = self.cfg.get("num_key_value_heads") or self.cfg.get("num_attention_heads")
        for kind in ("weight", "bias"):
            q = a + "q_proj." + kind
            if not self.ck.has(q):
                continue
            qp = self.column(q, "query rows", "num_attention_heads") if heads_ok else None
            kp = self.kv_piece(a + "k_proj." + kind, kv)
            vp = self.kv_piece(a + "v_proj." + kind, kv)
            self.emit_group(a + "qkv_proj." + kind,
                            [(q, qp), (a + "k_proj." + kind, kp), (a + "v_proj." + kind, vp)])
        if heads_ok:
            op = self.row(a + "o_proj.weight", "o_proj columns")
            if op is not None:
                self.single(a + "o_proj.weight", op)
        self.replicated(a + "q_norm.weight")
        self.replicated(a + "k_norm.weight")

    def mla_attention(self, p):
        a = p + ".self_attn."
        if not self.ck.has(a + "kv_a_proj_with_mqa.weight"):
            return
        heads_ok = self.heads_check()
        if self.ck.has(a + "q_a_proj.weight") and self.fuse:
            self.concat(a + "fused_qkv_a_proj.weight", [self.whole(a + "q_a_proj.weight"),
                                                        self.whole(a + "kv_a_proj_with_mqa.weight")])
        else:
            self.replicated(a + "q_a_proj.weight")
            self.replicated(a + "kv_a_proj_with_mqa.weight")
        self.replicated(a + "q_a_layernorm.weight")
        self.replicated(a + "kv_a_layernorm.weight")
        if heads_ok:
            for n in ("q_b_proj.weight", "q_proj.weight", "kv_b_proj.weight"):
                pc = self.column(a + n, "whole heads", "num_attention_heads")
                if pc is not None:
                    self.single(a + n, pc)
            op = self.row(a + "o_proj.weight", "o_proj columns")
            if op is not None:
                self.single(a + "o_proj.weight", op)

    def dense_mlp(self, m):
        """gate/up column-parallel, down row-parallel (a dense MLP or a shared expert)."""
        if not self.ck.has(m + ".gate_proj.weight"):
            return False
        g = self.column(m + ".gate_proj.weight", "intermediate rows", "intermediate_size")
        u = self.column(m + ".up_proj.weight", "intermediate rows", "intermediate_size")
        self.emit_group(m + ".gate_up_proj.weight", [(m + ".gate_proj.weight", g), (m + ".up_proj.weight", u)])
        d = self.row(m + ".down_proj.weight", "intermediate columns", "intermediate_size")
        if d is not None:
            self.single(m + ".down_proj.weight", d)
        return True

    def local_experts(self, count):
        if self.ep == 1:
            if self.experts is not None:
                self.problem("an experts list needs ep_size > 1", "experts", "ep_size")
            return list(range(count))
        if self.experts is not None:
            bad = [e for e in self.experts if not (isinstance(e, int) and 0 <= e < count)]
            if bad:
                self.problem(f"experts {bad} are not in [0, {count})", "expert")
                return None
            if len(set(self.experts)) != len(self.experts):
                self.problem("an expert is listed twice", "experts")
                return None
            return list(self.experts)
        n, extra = divmod(count, self.ep)
        start = self.epr * n + min(self.epr, extra)
        return list(range(start, start + n + (1 if self.epr < extra else 0)))

    def experts_block(self, m):
        ids = sorted({int(x.group(1)) for name in self.ck.tensors
                      for x in [re.match(re.escape(m) + r"\.experts\.(\d+)\.", name)] if x})
        if not ids:
            return
        count = len(ids)
        assert ids == list(range(count)), ids
        local = self.local_experts(count)
        if local is None:
            return
        # Experts this rank does not hold are dropped (with their scales).
        self.used.update(n for n in self.ck.tensors if n.startswith(m + ".experts."))
        gate, up, down = [], [], []
        for e in local:
            x = f"{m}.experts.{e}."
            if self.ep == 1:
                gate.append(self.column(x + "gate_proj.weight", "moe_intermediate rows", "moe_intermediate_size"))
                up.append(self.column(x + "up_proj.weight", "moe_intermediate rows", "moe_intermediate_size"))
                down.append(self.row(x + "down_proj.weight", "moe_intermediate columns", "moe_intermediate_size"))
            else:
                gate.append(self.whole(x + "gate_proj.weight"))
                up.append(self.whole(x + "up_proj.weight"))
                down.append(self.whole(x + "down_proj.weight"))
        if any(p is None for p in gate + up + down):
            return
        if self.fuse:
            w13 = [p for pair in zip(gate, up) for p in pair]
            self.concat(m + ".experts.w13_weight", w13, stack=len(local))
            self.concat(m + ".experts.w2_weight", down, stack=len(local))
        else:
            for p in gate + up + down:
                self.single(p.tensor, p)

    def layer(self, p):
        if self.family == "deepseek_v3":
            self.mla_attention(p)
        else:
            self.gqa_attention(p)
        m = p + ".mlp"
        self.dense_mlp(m)
        self.experts_block(m)
        self.replicated(m + ".gate.weight")
        self.replicated(m + ".gate.e_score_correction_bias")
        for shared in (m + ".shared_experts", m + ".shared_expert"):
            self.dense_mlp(shared)
        self.replicated(m + ".shared_expert_gate.weight")
        self.replicated(p + ".input_layernorm.weight")
        self.replicated(p + ".post_attention_layernorm.weight")

    # -- FP8 block scales --

    def scales(self):
        qc = self.cfg.get("quantization_config") or {}
        block = qc.get("weight_block_size")
        for out in list(self.outputs.values()):
            srcs = [p.tensor for p in out.pieces if p.tensor is not None]
            scaled = [s for s in srcs if self.ck.has(s + "_scale_inv")]
            if not scaled:
                continue
            if len(scaled) != len(out.pieces):
                self.problem(f"{out.name}: pieces with and without scales", out.name)
                continue
            if not block:
                self.problem(f"{out.name}: no quantization_config.weight_block_size", "weight_block_size")
                continue
            b0, b1 = block
            group = out.shape[1] if len(out.shape) == 3 else out.shape[0]
            pieces, at, ok, rows = [], 0, True, 0
            for p in out.pieces:
                wshape = self.ck.shape(p.tensor)
                bdim = b0 if p.dim == 0 else b1
                if p.start % bdim or (p.end % bdim and p.end != wshape[p.dim]):
                    self.problem(f"{p.tensor}: slice [{p.start}, {p.end}) of dimension {p.dim} is not on "
                                 f"{bdim}-element block boundaries", p.tensor, out.name, "block")
                    ok = False
                    continue
                n = self.piece_shape(p)[0]
                at += n
                if at % group and n % b0:
                    self.problem(f"{out.name}: {p.tensor} ends inside a scale block", p.tensor, out.name, "block")
                    ok = False
                    continue
                s = p.tensor + "_scale_inv"
                self.used.add(s)
                pieces.append(Piece(s, p.dim, p.start // bdim, -(-p.end // bdim)))
            if not ok:
                continue
            sdt = {self.ck.dtype(p.tensor) for p in pieces}
            assert len(sdt) == 1
            shapes = []
            for p in pieces:
                sh = list(self.ck.shape(p.tensor))
                sh[p.dim] = p.end - p.start
                shapes.append(sh)
            rows = sum(s[0] for s in shapes)
            if len(out.shape) == 3:
                shape = [out.shape[0], rows // out.shape[0], shapes[0][1]]
            else:
                shape = [rows, shapes[0][1]]
            self.emit(out.name + "_scale_inv", sdt.pop(), shape, pieces)

    # -- everything --

    def build(self):
        cfg = self.cfg
        layers = sorted({int(x.group(1)) for n in self.ck.tensors
                         for x in [re.match(r"model\.layers\.(\d+)\.", n)] if x})
        for i in layers:
            self.layer(f"model.layers.{i}")
        self.vocab("model.embed_tokens.weight")
        if cfg.get("tie_word_embeddings"):
            self.used.add("lm_head.weight")
        else:
            self.vocab("lm_head.weight")
        self.replicated("model.norm.weight")
        self.scales()
        # Anything no rule names (none in the fixtures) is served whole.
        for name in self.ck.tensors:
            if name not in self.used and not name.endswith("_scale_inv"):
                self.single(name, self.whole(name))
        for name in self.ck.tensors:
            if name not in self.used:
                self.single(name, self.whole(name))


def build(ck, preset="auto", tp_size=1, tp_rank=0, ep_size=1, ep_rank=0, experts=None, fuse=False):
    """{name: Output} for one rank, or raises Impossible."""
    problems = []
    if preset == "whole":  # every tensor whole (the tests never combine it with a split)
        return {n: Output(n, t.dtype, list(t.shape), [Piece(n, 0, 0, t.shape[0] if t.shape else 1)])
                for n, t in ck.tensors.items()}
    if tp_size < 1:
        problems.append(Problem(f"tp_size {tp_size} must be at least 1", ["tp_size"]))
    elif not 0 <= tp_rank < tp_size:
        problems.append(Problem(f"tp_rank {tp_rank} is not below tp_size {tp_size}", ["tp_rank"]))
    if ep_size < 1:
        problems.append(Problem(f"ep_size {ep_size} must be at least 1", ["ep_size"]))
    elif not 0 <= ep_rank < ep_size:
        problems.append(Problem(f"ep_rank {ep_rank} is not below ep_size {ep_size}", ["ep_rank"]))
    family = family_of(ck.config, preset)
    if family not in FAMILIES:
        problems.append(Problem(f"no preset family for {preset!r} / model_type "
                                f"{(ck.config or {}).get('model_type')!r}", ["model_type", "preset"]))
    if problems:
        raise Impossible(problems)
    b = _Builder(ck, family, tp_size, tp_rank, ep_size, ep_rank, experts, fuse)
    b.build()
    if b.problems:
        raise Impossible(b.problems)
    return b.outputs


def materialize(ck, out):
    """The bytes of output out, from its pieces."""
    parts = []
    row_bytes = stref.tensor_bytes(out.dtype, [1] + list(out.shape[1:])) if out.shape else 0
    for p in out.pieces:
        if p.tensor is None:
            parts.append(bytes((p.end - p.start) * row_bytes))
            continue
        a = ck.array(p.tensor)
        if a.ndim == 0:
            parts.append(a.tobytes())
            continue
        idx = [slice(None)] * a.ndim
        idx[p.dim] = slice(p.start, p.end)
        parts.append(np.ascontiguousarray(a[tuple(idx)]).tobytes())
    data = b"".join(parts)
    assert len(data) == out.nbytes, (out.name, len(data), out.nbytes)
    return data


def explicit_plan(outputs):
    """The {"outputs": [...]} plan that lists these outputs."""
    return {"outputs": [outputs[n].spec() for n in sorted(outputs)]}


def block_size(ck):
    qc = (ck.config or {}).get("quantization_config") or {}
    return qc.get("weight_block_size")
