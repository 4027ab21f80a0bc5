"""The corpus of single files both readers must judge alike.

hand_cases() covers every rule of the format by hand; mutation_cases()
derives seeded random variants of valid files. Each case is (label, bytes).
Neither list says what the verdict should be: the reference decides, and
test_corpus.py requires weightctl to agree.
"""
import json
import random
import re
import struct

from stref import DTYPE_BITS, fill, pack, serialize

U64_MAX = 2**64 - 1
F32_1 = '"dtype":"F32","shape":[1],"data_offsets":[0,4]'  # the members of a 4-byte tensor


def t(dtype="F32", shape=(1,), offs=(0, 4)):
    """One tensor object as JSON text."""
    return '{"dtype":"%s","shape":%s,"data_offsets":[%d,%d]}' % (
        dtype, json.dumps(list(shape)).replace(" ", ""), offs[0], offs[1])


def one(value, nbytes=4, **kw):
    """A header {"a": value} (value is JSON text) with nbytes of data."""
    return ('{"a":%s}' % value, nbytes, kw)


def with_extra(extra, nbytes=4):
    """A valid 4-byte tensor carrying an ignored member "x": extra."""
    return ('{"a":{%s,"x":%s}}' % (F32_1, extra), nbytes, {})


class Corpus:
    """Collects (label, bytes) cases; labels must be unique."""

    def __init__(self):
        self.cases = []
        self.labels = set()

    def add(self, label, buf):
        assert label not in self.labels, label
        self.labels.add(label)
        self.cases.append((label, bytes(buf)))

    def hdr(self, label, header, nbytes=0, n=None, tail=b"", data=None):
        """A file from header text (str or bytes) with nbytes of filler data."""
        if data is None:
            data = fill(nbytes, len(self.cases))
        self.add(label, pack(header, data, n=n, tail=tail))

    def spec(self, label, spec):
        header, nbytes, kw = spec
        self.hdr(label, header, nbytes, **kw)


# ---------------------------------------------------------------------------
# Hand-written cases, one group per rule.

def _length_prefix(c):
    good = '{"a":%s}' % t()
    for k in range(8):
        c.add(f"len.short.{k}", b"\x02\x00\x00\x00\x00\x00\x00"[:k])
    c.add("len.short.7.brace", b"{}     ")
    c.hdr("len.zero.empty_json", "")
    c.hdr("len.zero.with_data", "", 4)
    c.hdr("len.zero.but_bytes_follow", good, 4, n=0)
    c.hdr("len.braces", "{}")
    c.hdr("len.braces.extra_byte", "{}", tail=b"\x00")
    for n in (100_000_000, 100_000_001, 2**32, 2**32 + len(good), 2**63, U64_MAX - 7, U64_MAX - 8,
              U64_MAX, 2**64 - len(good) - 8):
        c.hdr(f"len.big.{n}", good, 4, n=n)
    c.hdr("len.past_eof.by1", good, 0, n=len(good) + 1)
    c.hdr("len.past_eof.by1_with_data", good, 4, n=len(good) + 5)
    c.hdr("len.past_eof.far", good, 4, n=len(good) + 4096)
    c.hdr("len.short_by1", good, 4, n=len(good) - 1)
    c.hdr("len.short_by_half", good, 4, n=len(good) // 2)
    c.hdr("len.covers_data", good, 4, n=len(good) + 4)
    c.hdr("len.ok.spaces_then_data", good + "    ", 0, data=b"    ")
    c.hdr("len.covers_space_data", good, 0, n=len(good) + 4, data=b"    ")
    c.add("len.only_prefix", struct.pack("<Q", 0))
    c.add("len.only_prefix.n2", struct.pack("<Q", 2))
    c.add("len.high_bytes", b"\x02\x00\x00\x00\x00\x00\x00\x80{}")
    c.add("len.big_endian", struct.pack(">Q", len(good)) + good.encode() + fill(4, 1))


BAD_UTF8 = {
    "overlong_slash": b"\xc0\xaf", "overlong_nul": b"\xc0\x80", "overlong3": b"\xe0\x80\xaf",
    "surrogate_d800": b"\xed\xa0\x80", "surrogate_dfff": b"\xed\xbf\xbf",
    "above_10ffff": b"\xf4\x90\x80\x80", "f5": b"\xf5\x80\x80\x80", "ff": b"\xff", "fe": b"\xfe",
    "truncated2": b"\xc3", "truncated3": b"\xe2\x82", "truncated4": b"\xf0\x9f\x98",
    "lone_continuation": b"\x80", "five_byte": b"\xf8\x88\x80\x80\x80", "latin1_e9": b"\xe9t",
    "c1_bad_continuation": b"\xc3\x28",
}

GOOD_UTF8 = {"e_acute": "é".encode(), "euro": "€".encode(), "emoji": "\U0001F642".encode(),
             "max": "\U0010FFFF".encode(), "u_fffd": "\ufffd".encode(), "bom_inside": b"\xef\xbb\xbf",
             "u_d7ff": "\ud7ff".encode(), "u_e000": "\ue000".encode()}


def _utf8(c):
    for name, seq in list(BAD_UTF8.items()) + list(GOOD_UTF8.items()):
        c.hdr(f"utf8.name.{name}", b'{"n' + seq + b'":' + t().encode() + b"}", 4)
        c.hdr(f"utf8.meta_value.{name}", b'{"__metadata__":{"k":"' + seq + b'"},"a":' + t().encode() + b"}", 4)
        c.hdr(f"utf8.ignored.{name}", b'{"a":{' + F32_1.encode() + b',"x":"' + seq + b'"}}', 4)
    for name, seq in BAD_UTF8.items():
        c.hdr(f"utf8.padding.{name}", b'{"a":' + t().encode() + b"}  " + seq, 4)
        c.hdr(f"utf8.outside_string.{name}", b'{"a":' + t().encode() + b"," + seq + b"}", 4)
    c.hdr("utf8.bom_start", b"\xef\xbb\xbf{}")
    c.hdr("utf8.bom_start.tensor", b"\xef\xbb\xbf" + ('{"a":%s}' % t()).encode(), 4)
    c.hdr("utf8.bom_between_tokens", ('{"a":\ufeff%s}' % t()).encode(), 4)
    c.hdr("utf8.bom_at_end", ('{"a":%s}\ufeff' % t()).encode(), 4)
    c.hdr("utf8.utf16le", ('{"a":%s}' % t()).encode("utf-16-le"), 4)
    c.hdr("utf8.raw_nul_in_name", b'{"a\x00b":' + t().encode() + b"}", 4)


def _json_syntax(c):
    good = '{"a":%s}' % t()
    bad = {
        "truncated_object": good[:-1], "truncated_in_key": '{"a', "truncated_in_value": '{"a":{"dtype":"F3',
        "missing_colon": '{"a" %s}' % t(), "missing_comma": '{"a":{"dtype":"F32" "shape":[1],"data_offsets":[0,4]}}',
        "trailing_comma_object": '{"a":%s,}' % t(), "trailing_comma_inner": '{"a":{%s,}}' % F32_1,
        "trailing_comma_array": '{"a":{"dtype":"F32","shape":[1,],"data_offsets":[0,4]}}',
        "leading_comma": '{,"a":%s}' % t(), "double_comma": '{"a":{"dtype":"F32",,"shape":[1],"data_offsets":[0,4]}}',
        "single_quotes": "{'a':%s}" % t(), "unquoted_key": '{a:%s}' % t(),
        "comment_line": '{"a":%s//c\n}' % t(), "comment_block": '{/*c*/"a":%s}' % t(),
        "two_values": '{"a":%s}{}' % t(), "extra_close": '{"a":%s}}' % t(),
        "unclosed_array": '{"a":{"dtype":"F32","shape":[1,"data_offsets":[0,4]}}',
        "literal_tru": '{"a":{%s,"x":tru}}' % F32_1, "literal_nul": '{"a":{%s,"x":nul}}' % F32_1,
        "literal_True": '{"a":{%s,"x":True}}' % F32_1, "literal_None": '{"a":{%s,"x":None}}' % F32_1,
        "nan": '{"a":{%s,"x":NaN}}' % F32_1, "infinity": '{"a":{%s,"x":Infinity}}' % F32_1,
        "neg_infinity": '{"a":{%s,"x":-Infinity}}' % F32_1, "hex": '{"a":{%s,"x":0x10}}' % F32_1,
        "leading_zero": '{"a":{%s,"x":01}}' % F32_1, "plus": '{"a":{%s,"x":+1}}' % F32_1,
        "dot_first": '{"a":{%s,"x":.5}}' % F32_1, "dot_last": '{"a":{%s,"x":1.}}' % F32_1,
        "minus_only": '{"a":{%s,"x":-}}' % F32_1, "exp_only": '{"a":{%s,"x":1e}}' % F32_1,
        "exp_sign_only": '{"a":{%s,"x":1e+}}' % F32_1, "neg_leading_zero": '{"a":{%s,"x":-01}}' % F32_1,
        "bad_escape_x": '{"a":{%s,"x":"\\x41"}}' % F32_1, "bad_escape_U": '{"a":{%s,"x":"\\U0041"}}' % F32_1,
        "short_u_escape": '{"a":{%s,"x":"\\u12"}}' % F32_1, "bad_hex_escape": '{"a":{%s,"x":"\\u00zz"}}' % F32_1,
        "escape_at_end": '{"a":{%s,"x":"\\"}}' % F32_1, "raw_tab_in_string": '{"a":{%s,"x":"a\tb"}}' % F32_1,
        "raw_newline_in_string": '{"a":{%s,"x":"a\nb"}}' % F32_1,
        "raw_nul_in_string": '{"a":{%s,"x":"a\x00b"}}' % F32_1,
        "raw_1f_in_key": '{"a\x1f":%s}' % t(), "unterminated_string": '{"a":{%s,"x":"abc}}' % F32_1,
        "lone_high_surrogate": '{"a":{%s,"x":"\\ud800"}}' % F32_1,
        "lone_low_surrogate": '{"a":{%s,"x":"\\udc00"}}' % F32_1,
        "reversed_surrogates": '{"a":{%s,"x":"\\udc00\\ud800"}}' % F32_1,
        "high_then_char": '{"a":{%s,"x":"\\ud800x"}}' % F32_1,
        "high_then_high": '{"a":{%s,"x":"\\ud800\\ud800"}}' % F32_1,
        "surrogate_in_name": '{"\\ud83d":%s}' % t(), "key_number": '{1:%s}' % t(), "key_null": '{null:%s}' % t(),
        "array_missing_comma": '{"a":{"dtype":"F32","shape":[1 1],"data_offsets":[0,4]}}',
        "empty_key_colon": '{:%s}' % t(), "only_spaces": "        ", "only_newline": "\n",
        "only_open": "{", "only_close": "}", "colon_value_missing": '{"a":}',
    }
    for name, h in bad.items():
        c.hdr(f"json.{name}", h, 4)
    good_variants = {
        "escaped_solidus": '{"a":{%s,"x":"\\/"}}' % F32_1,
        "escaped_all": '{"a":{%s,"x":"\\"\\\\\\/\\b\\f\\n\\r\\t"}}' % F32_1,
        "pair_surrogate": '{"a":{%s,"x":"\\ud83d\\ude00"}}' % F32_1,
        "upper_hex": '{"a":{%s,"x":"\\uD83D\\uDE00\\u00E9"}}' % F32_1,
        "raw_del": '{"a":{%s,"x":"\x7f"}}' % F32_1, "literals": '{"a":{%s,"x":[true,false,null]}}' % F32_1,
        "nested_ignored": '{"a":{%s,"x":{"y":[1,{"z":[]}],"w":{}}}}' % F32_1,
        "escaped_key_name": '{"\\u0061":%s}' % t(),
        "escaped_field_names": '{"a":{"\\u0064type":"F32","sh\\u0061pe":[1],"data_offsets":[0,4]}}',
        "escaped_dtype_value": '{"a":{"dtype":"F\\u00332","shape":[1],"data_offsets":[0,4]}}',
        "escaped_metadata_key": '{"\\u005f_metadata__":{"k":"v"},"a":%s}' % t(),
    }
    for name, h in good_variants.items():
        c.hdr(f"json.ok.{name}", h, 4)


def _top_level(c):
    for name, h in {"array": "[]", "array_of_tensor": "[%s]" % t(), "null": "null", "true": "true",
                    "number": "1", "string": '"a"', "nested_object": '{"x":{"a":%s}}' % t()}.items():
        c.hdr(f"top.{name}", h, 4)
    c.hdr("top.empty_object", "{}")
    c.hdr("top.empty_object.data", "{}", 4)


def _dtypes(c):
    for dtype, bits in DTYPE_BITS.items():
        nb = 16 * bits // 8
        c.hdr(f"dtype.ok.{dtype}", '{"a":%s}' % t(dtype, [16], (0, nb)), nb)
        c.hdr(f"dtype.size_plus1.{dtype}", '{"a":%s}' % t(dtype, [16], (0, nb + 1)), nb + 1)
        enum_form = '{"dtype":{"%s":null},"shape":[16],"data_offsets":[0,%d]}' % (dtype, nb)
        c.spec(f"dtype.enum_form.{dtype}", one(enum_form, nb))
    bad = ["F33", "f32", "bf16", "", "F32 ", " F32", "F8_E4M3FN", "C128", "Q4_0", "FLOAT32", "F8", "F6",
           "F4_E2M1", "BOOL8", "U128", "Float32", "F32\\u0000", "\\u0000"]
    for i, dtype in enumerate(bad):
        c.spec(f"dtype.bad.{i}", one('{"dtype":"%s","shape":[1],"data_offsets":[0,4]}' % dtype))
    forms = {"number": "1", "null": "null", "array": '["F32"]', "enum_int": '{"F32":1}', "enum_array": '{"F32":[]}',
             "enum_two": '{"F32":null,"F16":null}', "enum_empty": "{}", "enum_lower": '{"f32":null}',
             "enum_object": '{"F32":{}}', "true": "true", "enum_string": '{"F32":"x"}'}
    for name, v in forms.items():
        c.spec(f"dtype.form.{name}", one('{"dtype":%s,"shape":[1],"data_offsets":[0,4]}' % v))


def _shapes(c):
    ok = {"scalar": ([], 4), "zero": ([0], 0), "zero_mid": ([3, 0, 5], 0), "ones64": ([1] * 64, 4),
          "ones1000": ([1] * 1000, 4), "max_then_zero": ([U64_MAX, 0], 0), "zero_then_max": ([0, U64_MAX], 0),
          "big_then_zero": ([2**40, 2**20, 0], 0), "two_pow_63_zero": ([2**63, 1, 0], 0)}
    for name, (shape, nb) in ok.items():
        c.hdr(f"shape.{name}", '{"a":%s}' % t("F32", shape, (0, nb)), nb)
    overflow = {"fold_overflow_before_zero": [U64_MAX, 2, 0], "fold_overflow_2_32": [2**32, 2**32, 0],
                "fold_overflow_mid": [2, U64_MAX, 0], "product_2_64": [2**32, 2**32],
                "bits_overflow_f32": [2**59], "bits_overflow_u8": [2**61], "bits_edge_u8": [2**61 - 1],
                "bits_edge_f32_ok_size": [2**58], "huge_two_dims": [2**31, 2**31]}
    for name, shape in overflow.items():
        c.hdr(f"shape.{name}", '{"a":%s}' % t("U8" if "u8" in name else "F32", shape, (0, 4)), 4)
    bad = {"float": "[1.0]", "exp": "[1e0]", "negative": "[-1]", "neg_zero": "[-0]", "string": '["1"]',
           "null_elem": "[null]", "bool": "[true]", "null": "null", "string_whole": '"1"', "object": "{}",
           "number": "1", "nested": "[[1]]", "beyond_u64": "[18446744073709551616]", "huge": "[1e30]",
           "neg_big": "[-9223372036854775809]", "frac": "[0.5]"}
    for name, v in bad.items():
        c.spec(f"shape.bad.{name}", one('{"dtype":"F32","shape":%s,"data_offsets":[0,4]}' % v))


def _offsets(c):
    forms = {"len1": "[0]", "len3": "[0,4,4]", "empty": "[]", "null": "null", "string": '"0,4"',
             "object": '{"0":0,"1":4}', "float": "[0.0,4]", "float_end": "[0,4.0]", "string_elem": '[0,"4"]',
             "negative": "[-1,3]", "beyond_u64": "[0,18446744073709551616]", "nested": "[[0],[4]]",
             "number": "4", "bool": "[false,4]"}
    for name, v in forms.items():
        c.spec(f"offs.form.{name}", one('{"dtype":"F32","shape":[1],"data_offsets":%s}' % v))
    two = lambda a, b, nb: ('{"a":%s,"b":%s}' % (a, b), nb, {})  # noqa: E731
    c.spec("offs.ok.ordered", two(t(offs=(0, 4)), t(offs=(4, 8)), 8))
    c.spec("offs.ok.reversed_in_json", two(t(offs=(4, 8)), t(offs=(0, 4)), 8))
    c.spec("offs.gap", two(t(offs=(0, 4)), t(offs=(8, 12)), 12))
    c.spec("offs.gap_at_start", two(t(offs=(4, 8)), t(offs=(8, 12)), 12))
    c.spec("offs.overlap", two(t("F32", [2], (0, 8)), t("F32", [2], (4, 12)), 12))
    c.spec("offs.same_range", two(t(offs=(0, 4)), t(offs=(0, 4)), 4))
    c.spec("offs.same_range_8", two(t(offs=(0, 4)), t(offs=(0, 4)), 8))
    c.spec("offs.reversed", one(t("F32", [0], (4, 0)), 4))
    c.spec("offs.reversed_sized", one('{"dtype":"F32","shape":[1],"data_offsets":[4,0]}', 4))
    c.spec("offs.begin_not_zero", one(t(offs=(4, 8)), 8))
    c.spec("offs.ok.zero_size_at_end", two(t(offs=(0, 4)), t("F32", [0], (4, 4)), 4))
    c.spec("offs.ok.zero_size_first", two(t("F32", [0], (0, 0)), t(offs=(0, 4)), 4))
    c.spec("offs.ok.zero_size_same_spot", ('{"a":%s,"b":%s,"c":%s}' % (t(offs=(0, 4)), t("F32", [0], (4, 4)),
                                                                     t("BF16", [0], (4, 4))), 4, {}))
    c.spec("offs.zero_size_past_end", two(t(offs=(0, 4)), t("F32", [0], (8, 8)), 4))
    c.spec("offs.zero_size_far", two(t(offs=(0, 4)), t("F32", [0], (U64_MAX, U64_MAX)), 4))
    c.spec("offs.end_max", one('{"dtype":"U8","shape":[1],"data_offsets":[0,%d]}' % U64_MAX, 1))
    c.spec("offs.begin_max", one('{"dtype":"U8","shape":[1],"data_offsets":[%d,%d]}' % (U64_MAX, 0), 1))
    c.spec("offs.both_max_zero", one(t("U8", [0], (U64_MAX, U64_MAX)), 0))
    # Tensors whose offsets chain past 2^64 (each in bounds of its own size rule).
    big = 2**61 - 8
    chain = ",".join('"t%d":%s' % (i, t("U8", [big], (i * big, (i + 1) * big))) for i in range(9))
    c.spec("offs.chain_past_2_64", ("{%s}" % chain, 0, {}))
    ends = [0, 2**62, 2**63, 2**63 + 2**62, U64_MAX]
    chain = ",".join('"t%d":%s' % (i, t("U8", [ends[i + 1] - ends[i]], (ends[i], ends[i + 1]))) for i in range(4))
    c.spec("offs.chain_to_u64_max", ("{%s}" % chain, 0, {}))
    # Sizes that disagree with shape x dtype.
    c.spec("size.too_small", one(t("F32", [2], (0, 4)), 4))
    c.spec("size.too_big", one(t("F32", [1], (0, 12)), 12))
    c.spec("size.bf16_3", one(t("BF16", [3], (0, 8)), 8))
    c.spec("size.scalar_u64", one(t("U64", [], (0, 4)), 4))
    c.spec("size.zero_dim_with_bytes", one(t("F32", [0], (0, 4)), 4))


def _file_data(c):
    h = '{"a":%s,"b":%s}' % (t(offs=(0, 4)), t("BF16", [2, 3], (4, 16)))
    c.hdr("data.exact", h, 16)
    for k in (1, 7, 8, 4096):
        c.hdr(f"data.extra.{k}", h, 16 + k)
    for k in (1, 4, 15, 16):
        c.hdr(f"data.missing.{k}", h, 16 - k)
    c.hdr("data.extra_zeros", h, 16, tail=bytes(8))


def _duplicates(c):
    c.spec("dup.identical", ('{"a":%s,"a":%s}' % (t(), t()), 4, {}))
    c.spec("dup.last_smaller", ('{"a":%s,"a":%s}' % (t("F32", [2], (0, 8)), t()), 4, {}))
    c.spec("dup.last_smaller.first_fits", ('{"a":%s,"a":%s}' % (t("F32", [2], (0, 8)), t()), 8, {}))
    c.spec("dup.last_bigger", ('{"a":%s,"a":%s}' % (t(), t("F32", [2], (0, 8))), 8, {}))
    c.spec("dup.last_dtype_differs", ('{"a":%s,"a":%s}' % (t("F32", [1], (0, 4)), t("BF16", [2], (0, 4))), 4, {}))
    c.spec("dup.first_bad_type", ('{"a":"junk","a":%s}' % t(), 4, {}))
    c.spec("dup.first_bad_dtype", ('{"a":%s,"a":%s}' % (t("XX"), t()), 4, {}))
    c.spec("dup.first_bad_shape", ('{"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]},"a":%s}' % t(), 4, {}))
    c.spec("dup.last_bad", ('{"a":%s,"a":"junk"}' % t(), 4, {}))
    c.spec("dup.escaped_same_name", ('{"a":%s,"\\u0061":%s}' % (t("F32", [2], (0, 8)), t()), 4, {}))
    c.spec("dup.with_other", ('{"a":%s,"b":%s,"a":%s}' % (t(offs=(0, 4)), t(offs=(4, 8)), t(offs=(8, 12))), 12, {}))
    c.spec("dup.with_other.gap", ('{"a":%s,"b":%s,"a":%s}' % (t(offs=(0, 4)), t(offs=(4, 8)), t(offs=(8, 12))), 8, {}))
    c.spec("dup.metadata", ('{"__metadata__":{},"__metadata__":{},"a":%s}' % t(), 4, {}))
    c.spec("dup.metadata_null_then_map", ('{"__metadata__":null,"__metadata__":{"k":"v"},"a":%s}' % t(), 4, {}))
    c.spec("dup.metadata_escaped", ('{"__metadata__":{},"\\u005f_metadata__":{},"a":%s}' % t(), 4, {}))
    c.spec("dup.metadata_key", ('{"__metadata__":{"k":"v","k":"w"},"a":%s}' % t(), 4, {}))
    for fld, val in (("dtype", '"F32"'), ("shape", "[1]"), ("data_offsets", "[0,4]")):
        c.spec(f"dup.field.{fld}", one("{%s,\"%s\":%s}" % (F32_1, fld, val)))


def _metadata(c):
    forms = {"empty": "{}", "null": "null", "kv": '{"format":"pt"}', "int_value": '{"k":1}', "null_value": '{"k":null}',
             "array_value": '{"k":["v"]}', "object_value": '{"k":{"a":"b"}}', "bool_value": '{"k":true}',
             "string": '"x"', "array": "[]", "number": "1", "true": "true", "empty_key": '{"":""}',
             "non_ascii": '{"ключ":"значение","k":"\\u00e9\\ud83d\\ude00"}',
             "nul_escape": '{"k":"a\\u0000b"}',
             "tensor_shaped": t(), "float_value": '{"k":1.5}'}
    for name, v in forms.items():
        c.hdr(f"meta.{name}", '{"__metadata__":%s,"a":%s}' % (v, t()), 4)
        c.hdr(f"meta.last.{name}", '{"a":%s,"__metadata__":%s}' % (t(), v), 4)
    many = ",".join('"k%d":"v%d"' % (i, i) for i in range(2000))
    c.hdr("meta.many", '{"__metadata__":{%s},"a":%s}' % (many, t()), 4)
    c.hdr("meta.only", '{"__metadata__":{"k":"v"}}')
    c.hdr("meta.upper_is_tensor", '{"__METADATA__":%s}' % t(), 4)
    c.hdr("meta.upper_not_tensor", '{"__METADATA__":{"k":"v"}}')
    c.hdr("meta.near_miss_is_tensor", '{"_metadata_":%s,"__metadata":"x"}' % t(), 4)


def _tensor_forms(c):
    c.spec("form.array", one('["F32",[1],[0,4]]'))
    c.spec("form.array_enum_dtype", one('[{"F32":null},[1],[0,4]]'))
    c.spec("form.array_2", one('["F32",[1]]'))
    c.spec("form.array_4", one('["F32",[1],[0,4],1]'))
    c.spec("form.array_empty", one("[]"))
    c.spec("form.array_wrong_order", one('[[1],"F32",[0,4]]'))
    c.spec("form.array_mixed", ('{"a":["F32",[1],[0,4]],"b":%s}' % t("BF16", [2], (4, 8)), 8, {}))
    c.spec("form.extra_member", with_extra("1"))
    c.spec("form.extra_members_many", one('{"z":0,%s,"y":"s","x":[1,{"q":null}]}' % F32_1))
    c.spec("form.missing.dtype", one('{"shape":[1],"data_offsets":[0,4]}'))
    c.spec("form.missing.shape", one('{"dtype":"F32","data_offsets":[0,4]}'))
    c.spec("form.missing.data_offsets", one('{"dtype":"F32","shape":[1]}'))
    c.spec("form.missing.all", one("{}"))
    c.spec("form.wrong_case_field", one('{"Dtype":"F32","shape":[1],"data_offsets":[0,4]}'))
    c.spec("form.member_order", one('{"data_offsets":[0,4],"shape":[1],"dtype":"F32"}'))
    for name, v in {"null": "null", "string": '"x"', "number": "1", "true": "true"}.items():
        c.spec(f"form.value.{name}", one(v))
    c.hdr("form.empty_name", '{"":%s}' % t(), 4)
    c.hdr("form.long_name", '{"%s":%s}' % ("n" * 100_000, t()), 4)
    c.hdr("form.name_escapes", '{"\\n\\t\\"\\\\\\/\\b\\f\\r":%s}' % t(), 4)
    c.hdr("form.name_nul", '{"a\\u0000b":%s}' % t(), 4)
    c.hdr("form.names_nul_distinct", '{"a\\u0000b":%s,"a\\u0000c":%s,"a":%s}' % (
        t(offs=(0, 4)), t(offs=(4, 8)), t(offs=(8, 12))), 12)
    c.hdr("form.name_non_ascii_escaped", '{"\\u00e9\\u4e2d\\ud83d\\ude00":%s}' % t(), 4)


def _nesting(c):
    # Total container depth, counting the top-level object and the tensor object.
    for depth in (125, 126, 127, 128, 129, 200):
        inner = depth - 2
        c.spec(f"nest.arrays.{depth}", with_extra("[" * inner + "]" * inner))
        c.spec(f"nest.objects.{depth}", with_extra('{"k":' * inner + "1" + "}" * inner))
        mixed = "".join("[" if i % 2 else '{"k":' for i in range(inner))
        close = "".join("]" if i % 2 else "}" for i in reversed(range(inner)))
        c.spec(f"nest.mixed.{depth}", with_extra(mixed + "0" + close))
        c.hdr(f"nest.top_array.{depth}", "[" * depth + "]" * depth)
        c.hdr(f"nest.metadata.{depth}", '{"__metadata__":%s}' % ('{"k":' * (depth - 1) + '"v"' + "}" * (depth - 1)))
    c.spec("nest.unclosed_deep", with_extra("[" * 100_000))


IGNORED_NUMBERS = [
    "0", "-0", "-0.0", "1E+2", "1e-2", "1.5e308", "1e308", "1.7976931348623157e308", "1.7976931348623158e308",
    "1.7976931348623159e308", "1.797693134862315807e308", "1.797693134862315808e308", "1.8e308", "1e309",
    "1e400", "-1e400", "-1.8e308", "1e-400", "4.9e-324", "2.5e-324", "2.4e-324", "1e-99999999999999999999",
    "0e999999999999", "0.0e-99999999999999999999", "1e999999999999999999999", "18446744073709551615",
    "18446744073709551616", "-9223372036854775808", "-9223372036854775809", "123456789012345678901234567890",
    "1" + "0" * 300, "1" + "0" * 308, "1" + "0" * 309, "1" + "0" * 400, "1" + "0" * 400 + "e-300",
    "0." + "0" * 400 + "1e400", "0." + "0" * 400 + "1e800", "179769313486231570" + "0" * 291,
    "179769313486231580" + "0" * 291, "0.1", "3.141592653589793238462643383279",
]


def near_double_max(rng, count):
    """Numbers within a few ulps of DBL_MAX, written several ways.

    serde_json (the reference's parser) turns the first 19-20 significant
    digits into a u64 and scales it by a power of ten in f64 arithmetic,
    reporting "number out of range" when that overflows; it does not round
    correctly near the top of the range, so these numbers probe exactly how
    a reader decides overflow.
    """
    out = []
    for _ in range(count):
        stem = rng.choice(["17976931348623", "179769313486231", "1797693134862315", "17976931348623157",
                           "179769313486231580"])
        digits = stem + "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 6)))
        lead = rng.choice([1, 1, 2, 3, 17])
        frac = digits[lead:] + "0" * rng.choice([0, 0, 3, 25])
        exp = 308 - (lead - 1)
        form = rng.choice(["exp", "exp", "int", "zero_lead", "neg"])
        if form == "exp":
            out.append(f"{digits[:lead]}.{frac}e{exp}")
        elif form == "int":
            out.append(digits + "0" * (309 - len(digits)))
        elif form == "zero_lead":
            out.append(f"0.{digits}e309")
        else:
            out.append(f"-{digits[:lead]}.{frac}E+{exp}")
    return out


def _numbers(c):
    for i, num in enumerate(IGNORED_NUMBERS):
        c.spec(f"num.ignored.{i}.{num[:24]}", with_extra(num))
        c.spec(f"num.ignored_array.{i}.{num[:24]}", with_extra("[%s]" % num))
    for i, num in enumerate(near_double_max(random.Random(308), 60)):
        c.spec(f"num.near_max.{i}.{num[:28]}", with_extra(num))


def _whitespace(c):
    good = '{"a":%s}' % t()
    for name, ws in {"spaces": "    ", "newlines": "\n\n", "tabs": "\t\t", "crlf": "\r\n", "mixed": " \t\r\n"}.items():
        c.hdr(f"ws.leading.{name}", ws + good, 4)
        c.hdr(f"ws.trailing.{name}", good + ws, 4)
        c.hdr(f"ws.between.{name}", good.replace(":", ws + ":" + ws).replace(",", ws + "," + ws), 4)
    for name, ws in {"nul": "\x00", "formfeed": "\x0c", "vtab": "\x0b", "nbsp": "\u00a0", "u2028": "\u2028",
                     "u3000": "\u3000", "zwsp": "\u200b"}.items():
        c.hdr(f"ws.bad_trailing.{name}", (good + ws).encode(), 4)
        c.hdr(f"ws.bad_leading.{name}", (ws + good).encode(), 4)
    c.hdr("ws.pad_to_8", good + " " * (8 - len(good) % 8), 4)
    c.hdr("ws.pad_4096", good + " " * 4096, 4)


def _sub_byte(c):
    cases = [("F4", [1], 1), ("F4", [2], 1), ("F4", [3], 2), ("F4", [2, 3], 3), ("F4", [3, 3], 5), ("F4", [], 1),
             ("F4", [0], 0), ("F4", [2], 2), ("F4", [5, 0], 0), ("F4", [1, 1, 2], 1),
             ("F6_E2M3", [4], 3), ("F6_E2M3", [2], 2), ("F6_E2M3", [8], 6), ("F6_E2M3", [3], 3),
             ("F6_E2M3", [], 1), ("F6_E2M3", [1, 4], 3), ("F6_E2M3", [2, 2], 3), ("F6_E2M3", [4], 4),
             ("F6_E3M2", [4], 3), ("F6_E3M2", [6], 5), ("F6_E3M2", [12], 9), ("F6_E3M2", [2, 6], 9),
             ("F6_E3M2", [0], 0), ("F6_E3M2", [1], 1)]
    for dtype, shape, nb in cases:
        dims = "x".join(map(str, shape)) or "scalar"
        c.hdr(f"subbyte.{dtype}.{dims}.{nb}B", '{"a":%s}' % t(dtype, shape, (0, nb)), nb)
    c.hdr("subbyte.f4_then_u8", '{"a":%s,"b":%s}' % (t("F4", [2], (0, 1)), t("U8", [3], (1, 4))), 4)


def hand_cases():
    """The hand-written corpus: every rule of the format, both sides of each edge."""
    c = Corpus()
    for group in (_length_prefix, _utf8, _json_syntax, _top_level, _dtypes, _shapes, _offsets, _file_data,
                  _duplicates, _metadata, _tensor_forms, _nesting, _numbers, _whitespace, _sub_byte):
        group(c)
    return c.cases


# ---------------------------------------------------------------------------
# Seeded random mutations of valid files.

def base_files():
    """Valid files of assorted shapes to mutate (written by the reference where it can)."""
    bases = []
    bases.append(("serialized.mixed", serialize({
        "model.embed_tokens.weight": ("BF16", [8, 4], fill(64, 1)),
        "model.layers.0.self_attn.q_proj.weight": ("F8_E4M3", [4, 4], fill(16, 2)),
        "model.layers.0.self_attn.q_proj.weight_scale_inv": ("F32", [1, 1], fill(4, 3)),
        "model.norm.weight": ("F32", [4], fill(16, 4)),
        "lm_head.bias": ("F16", [0], b""),
        "step": ("I64", [], fill(8, 5)),
    }, {"format": "pt", "note": "é"})))
    bases.append(("serialized.one", serialize({"w": ("F32", [2, 2], fill(16, 6))})))
    bases.append(("serialized.ints", serialize({"u8": ("U8", [3], fill(3, 7)), "i16": ("I16", [2], fill(4, 8)),
                                                "u64": ("U64", [1], fill(8, 9)),
                                                "b": ("BOOL", [5], b"\x00\x01\x01\x00\x01")})))
    array_form = '{"a":["F32",[1],[0,4]],"b":{"dtype":{"BF16":null},"shape":[2],"data_offsets":[4,8]}}'
    bases.append(("hand.array_form", pack(array_form, fill(8, 10))))
    bases.append(("hand.zero_sizes", pack('{"e":%s,"a":%s,"z":%s,"f":%s}' % (
        t("F32", [0], (0, 0)), t("U8", [2], (0, 2)), t("F64", [3, 0], (2, 2)), t("F4", [4], (2, 4))), fill(4, 11))))
    bases.append(("hand.subbyte", pack('{"x":%s,"y":%s}' % (t("F6_E2M3", [4], (0, 3)), t("F6_E3M2", [2, 4], (3, 9))),
                                       fill(9, 12))))
    bases.append(("hand.spaced", pack('  {\n "__metadata__" : { "k" : "v" } ,\n "a" : %s ,\n "a" : %s\n}\n    ' % (
        t("F32", [3], (0, 12)), t(offs=(0, 4))), fill(4, 13))))
    bases.append(("hand.unicode", pack('{"é\\u00e9":%s,"ключ":%s}' % (t("C64", [1], (0, 8)),
                                                                      t("F16", [2, 1], (8, 12))), fill(12, 14))))
    bases.append(("hand.ignored", pack('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],'
                                       '"x":[1.5e300,-2,{"y":null}],"z":"q"}}', fill(8, 15))))
    return bases


JSON_CHARS = b'{}[]:,"\\ 0123456789-+.eEtrufalsn\x00\n\t'
DTYPE_RE = re.compile(rb'"(%s)"' % b"|".join(re.escape(d.encode()) for d in sorted(DTYPE_BITS, key=len, reverse=True)))


def _with_header(buf, header):
    """buf with its header replaced, n adjusted, data kept."""
    (n,) = struct.unpack("<Q", buf[:8])
    return struct.pack("<Q", len(header)) + header + buf[8 + n:]


def _mutate(rng, buf):
    """One random change to a valid file; returns (kind, new bytes)."""
    (n,) = struct.unpack("<Q", buf[:8])
    if n == 0 or n > len(buf) - 8:
        # An earlier change broke the prefix: only whole-file changes make sense.
        kind = rng.choice(["prefix", "truncate", "append"])
    else:
        kind = None
    header = bytearray(buf[8:8 + n])
    kind = kind or rng.choice(["bitflip", "byte", "json_char", "digit", "digit", "dtype_swap", "dtype_swap",
                       "delete", "insert", "prefix", "truncate", "append", "n_delta", "dup_member", "swap_digits"])
    if kind == "bitflip":
        header[rng.randrange(n)] ^= 1 << rng.randrange(8)
        return kind, buf[:8] + bytes(header) + buf[8 + n:]
    if kind == "byte":
        header[rng.randrange(n)] = rng.randrange(256)
        return kind, buf[:8] + bytes(header) + buf[8 + n:]
    if kind == "json_char":
        header[rng.randrange(n)] = rng.choice(JSON_CHARS)
        return kind, buf[:8] + bytes(header) + buf[8 + n:]
    if kind in ("digit", "swap_digits"):
        spots = [i for i, ch in enumerate(header) if 0x30 <= ch <= 0x39]
        if not spots:
            return _mutate(rng, buf)
        if kind == "digit" or len(spots) < 2:
            i = rng.choice(spots)
            header[i] = rng.choice(b"0123456789")
        else:
            i, j = rng.sample(spots, 2)
            header[i], header[j] = header[j], header[i]
        return kind, buf[:8] + bytes(header) + buf[8 + n:]
    if kind == "dtype_swap":
        found = list(DTYPE_RE.finditer(bytes(header)))
        if not found:
            return _mutate(rng, buf)
        m = rng.choice(found)
        new = rng.choice(list(DTYPE_BITS)).encode()
        hdr = bytes(header[:m.start(1)]) + new + bytes(header[m.end(1):])
        return kind, _with_header(buf, hdr)
    if kind == "delete":
        i = rng.randrange(n)
        return kind, _with_header(buf, bytes(header[:i] + header[i + 1:]))
    if kind == "insert":
        i = rng.randrange(n + 1)
        ch = rng.choice(b' \n\t,:{}[]"0123456789')
        return kind, _with_header(buf, bytes(header[:i]) + bytes([ch]) + bytes(header[i:]))
    if kind == "prefix":
        p = bytearray(buf[:8])
        i = rng.randrange(8)
        if rng.random() < 0.5:
            p[i] ^= 1 << rng.randrange(8)
        else:
            p[i] = rng.randrange(256)
        return kind, bytes(p) + buf[8:]
    if kind == "truncate":
        return kind, buf[:rng.randrange(len(buf))]
    if kind == "append":
        return kind, buf + bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
    if kind == "n_delta":
        d = rng.choice([-8, -2, -1, 1, 2, 8, 64])
        return kind, struct.pack("<Q", max(0, n + d)) + buf[8:]
    if kind == "dup_member":
        # Repeat one top-level member: text between two commas at depth 1.
        text = bytes(header)
        depth, cuts = 0, []
        in_str = esc = False
        for i, ch in enumerate(text):
            if in_str:
                esc = (ch == 0x5C and not esc)
                if ch == 0x22 and not esc:
                    in_str = False
                continue
            if ch == 0x22:
                in_str = True
            elif ch in b"{[":
                depth += 1
                if depth == 1:
                    cuts.append(i + 1)
            elif ch in b"}]":
                if depth == 1:
                    cuts.append(i)
                depth -= 1
            elif ch == 0x2C and depth == 1:
                cuts.append(i)
        if len(cuts) < 2:
            return _mutate(rng, buf)
        k = rng.randrange(len(cuts) - 1)
        member = text[cuts[k]:cuts[k + 1]].strip(b", \n")
        if not member:
            return _mutate(rng, buf)
        pos = cuts[-1]
        return kind, _with_header(buf, text[:pos] + b"," + member + text[pos:])
    raise AssertionError(kind)


def mutation_cases(seed, count):
    """count seeded mutations of base_files(); 1-3 changes each."""
    rng = random.Random(seed)
    bases = base_files()
    out = []
    for i in range(count):
        label, buf = bases[i % len(bases)]
        kinds = []
        for _ in range(rng.choice([1, 1, 1, 2, 3])):
            kind, new = _mutate(rng, buf)
            if len(new) < 8:
                buf = new
                kinds.append(kind)
                break
            buf = new
            kinds.append(kind)
        out.append((f"mut.{seed}.{i}.{label}.{'+'.join(kinds)}", buf))
    return out
