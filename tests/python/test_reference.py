"""Files written by the reference package read identically through weightctl.

Each test serializes tensors with `safetensors.serialize`, writes the bytes to a
file and requires `weightctl inspect --json` to report exactly what
`safetensors.deserialize` (plus the header's offsets) says: names, dtypes,
shapes, offsets, and the file's byte counts.
"""
import pytest
import safetensors

import stref


def check_same(tmp_path, buf, file_name="model.safetensors"):
    """Writes buf, inspects it, and asserts weightctl matches the reference."""
    ref = stref.reference(buf)
    assert ref.ok, f"the reference refused its own file: {ref.error}"
    path = tmp_path / file_name
    path.write_bytes(buf)
    res, js = stref.inspect_json(path)
    assert js is not None, "weightctl refused a file the reference reads\n" + res.describe() + \
        "\n" + stref.hexdump_case(buf, 2048)
    bad = stref.compare_file(ref, js, file_name)
    assert not bad, "weightctl disagrees with the reference:\n  " + "\n  ".join(bad[:40])
    return ref, js


def test_dtype_table_matches_reference():
    """DTYPE_BITS lists exactly the reference's dtypes, in its order, with its sizes."""
    assert stref.reference_dtypes() == list(stref.DTYPE_BITS)
    assert safetensors.__version__ == "0.8.0"
    for dtype, bits in stref.DTYPE_BITS.items():
        nbytes = 8 * bits // 8
        hdr = '{"t":{"dtype":"%s","shape":[8],"data_offsets":[0,%d]}}' % (dtype, nbytes)
        assert stref.reference(stref.pack(hdr, bytes(nbytes))).ok, dtype
        hdr = '{"t":{"dtype":"%s","shape":[8],"data_offsets":[0,%d]}}' % (dtype, nbytes + 1)
        assert not stref.reference(stref.pack(hdr, bytes(nbytes + 1))).ok, dtype


def test_every_dtype(tmp_path, weightctl):
    """One tensor of every dtype TensorSpec can write, in assorted shapes."""
    shapes = [[2, 3], [4], [1, 2, 2], [3, 1, 1, 2], [6], [2, 2, 2]]
    tensors = {}
    for i, dtype in enumerate(sorted(stref.SPEC_DTYPE)):
        shape = shapes[i % len(shapes)]
        tensors[f"model.t{i}.{dtype.lower()}"] = (dtype, shape, stref.fill(stref.tensor_bytes(dtype, shape), i))
    buf = stref.serialize(tensors)
    ref, js = check_same(tmp_path, buf)
    assert sorted(t.dtype for t in ref.tensors.values()) == sorted(stref.SPEC_DTYPE)
    assert js["shards"][0]["header_bytes"] % 8 == 0  # the serializer pads to 8


def test_sub_byte_dtypes(tmp_path, weightctl):
    """F4 and F6 tensors (packed), including the smallest whole-byte shapes."""
    buf = stref.pack_tensors([
        ("f4.a", "F4", [2]), ("f4.b", "F4", [3, 4]), ("f4.c", "F4", [0]),
        ("f6a.a", "F6_E2M3", [4]), ("f6a.b", "F6_E2M3", [2, 6]), ("f6a.c", "F6_E2M3", [3, 0]),
        ("f6b.a", "F6_E3M2", [8]), ("f6b.b", "F6_E3M2", [1, 1, 4]), ("tail", "U8", [3]),
    ])
    check_same(tmp_path, buf)
    f4 = stref.serialize({"w": ("F4", [4, 6], stref.fill(12, 1)), "s": ("BF16", [3], stref.fill(6, 2))})
    ref, _ = check_same(tmp_path, f4, "f4.safetensors")
    assert ref.tensors["w"].shape == [4, 6] and ref.tensors["w"].end - ref.tensors["w"].begin == 12


def test_scalars_and_zero_size(tmp_path, weightctl):
    """Shape [] (one element) and tensors with a zero dimension (no bytes)."""
    tensors = {}
    for i, dtype in enumerate(sorted(stref.SPEC_DTYPE)):
        if dtype == "F4":
            continue  # a scalar F4 is 4 bits: not a whole byte, refused
        tensors[f"scalar.{dtype}"] = (dtype, [], stref.fill(stref.tensor_bytes(dtype, []), i))
    for i, shape in enumerate([[0], [3, 0], [0, 5, 7], [1, 0, 1]]):
        tensors[f"empty.{i}"] = ("F32", shape, b"")
    tensors["empty.f4"] = ("F4", [0], b"")
    tensors["empty.bf16"] = ("BF16", [0, 4096], b"")
    ref, js = check_same(tmp_path, stref.serialize(tensors))
    assert ref.tensors["scalar.F64"].shape == []
    assert sum(1 for t in ref.tensors.values() if t.begin == t.end) == 6


def test_only_zero_size_tensors(tmp_path, weightctl):
    """A file whose data section is empty."""
    check_same(tmp_path, stref.serialize({"a": ("F16", [0], b""), "b": ("I64", [2, 0], b"")}))


def test_no_tensors(tmp_path, weightctl):
    """serialize({}) writes a header and nothing else; the reference reads it."""
    check_same(tmp_path, stref.serialize({}))
    check_same(tmp_path, stref.serialize({}, {"format": "pt"}), "meta_only.safetensors")


NON_ASCII_NAMES = [
    "модель.слой.0.weight", "层.权重", "emoji.\U0001F642", "e\u0301.combining",
    "tab\tname", 'quote"back\\slash', "ctrl\x01\x1f", "line\u2028sep", "", "a/b/../c",
    "del\x7f", "bmp.end\uffff", "astral.\U0010FFFF", "private\ue000", "nbsp\u00a0x",
    "x" * 4096, "Ω" * 300,
]


def test_non_ascii_names(tmp_path, weightctl):
    """Names with non-ASCII, escapes, control characters, empty and long names."""
    tensors = {name: ("BF16", [2], stref.fill(4, i)) for i, name in enumerate(NON_ASCII_NAMES)}
    ref, _ = check_same(tmp_path, stref.serialize(tensors))
    assert set(ref.tensors) == set(NON_ASCII_NAMES)


def test_names_with_nul(tmp_path, weightctl):
    """Names holding U+0000 are distinct names to the reference."""
    tensors = {"a\x00b": ("U8", [1], b"\x01"), "a\x00c": ("U8", [1], b"\x02"), "a": ("U8", [1], b"\x03")}
    ref, _ = check_same(tmp_path, stref.serialize(tensors))
    assert len(ref.tensors) == 3


def test_metadata(tmp_path, weightctl):
    """__metadata__ with non-ASCII and escaped text; an empty map."""
    meta = {"format": "pt", "ключ": "значение", "quote": 'a"b\\c\n', "": "", "emoji": "\U0001F600",
            "long": "v" * 10000}
    t = {"w": ("F32", [2, 2], stref.fill(16, 3))}
    ref, js = check_same(tmp_path, stref.serialize(t, meta))
    assert ref.metadata == meta
    ref, js = check_same(tmp_path, stref.serialize(t, {}), "empty_meta.safetensors")
    assert js["shards"][0]["metadata"] == {}
    ref, js = check_same(tmp_path, stref.serialize(t), "no_meta.safetensors")
    assert js["shards"][0]["metadata"] is None


def test_metadata_with_nul(tmp_path, weightctl):
    """Metadata keys and values holding U+0000 keep it in the reference."""
    meta = {"nul": "x\x00y", "k\x00ey": "v"}
    ref, _ = check_same(tmp_path, stref.serialize({"w": ("U8", [1], b"\x05")}, meta))
    assert ref.metadata == meta


def test_many_tensors(tmp_path, weightctl):
    """Thousands of tensors: a header of a few hundred KiB."""
    tensors = {}
    dtypes = ["BF16", "F32", "F8_E4M3", "I64", "U8"]
    for i in range(3000):
        dtype = dtypes[i % len(dtypes)]
        shape = [1 + i % 7, 1 + i % 5]
        tensors[f"model.layers.{i // 10}.mlp.experts.{i % 10}.weight"] = (
            dtype, shape, stref.fill(stref.tensor_bytes(dtype, shape), i))
    ref, js = check_same(tmp_path, stref.serialize(tensors, {"format": "pt"}))
    assert js["tensor_count"] == 3000 and ref.n > 200_000


@pytest.mark.parametrize("dtype", sorted(stref.SPEC_DTYPE))
def test_single_dtype_files(tmp_path, weightctl, dtype):
    """A file with one dtype only: its bytes_by_dtype has that one entry."""
    shape = [4, 6]
    data = stref.fill(stref.tensor_bytes(dtype, shape), 7)
    ref, js = check_same(tmp_path, stref.serialize({"w": (dtype, shape, data)}))
    assert {k: v for k, v in js["bytes_by_dtype"].items() if v} == {dtype: stref.tensor_bytes(dtype, shape)}


def test_plain_output(tmp_path, weightctl):
    """inspect without --json succeeds quietly on stderr for a valid file."""
    path = tmp_path / "model.safetensors"
    path.write_bytes(stref.serialize({"w": ("BF16", [2], b"\x01\x02\x03\x04")}))
    res = stref.run_ctl(["inspect", str(path)])
    assert res.returncode == 0 and res.stderr == "", res.describe()
    assert res.stdout.strip(), "inspect printed nothing"
