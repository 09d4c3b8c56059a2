"""vlite's lean GGUF header reader reads what gguf's own reader reads: every metadata value and every
tensor view, on a file with every value type and on the real default model; damaged files are errors."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from tests.conftest import GGUF_NAME, default_model_dir
from vlite.model_loader.gguf_loader import open_gguf
from vlite.model_loader.gguf_reader import GGUFReader


def same_as_gguf(path) -> GGUFReader:
    ours, ref = GGUFReader(path), gguf.GGUFReader(path)
    assert list(ours.fields) == [k for k in ref.fields if not k.startswith("GGUF.")]  # gguf's own pseudo-keys
    for name, field in ours.fields.items():
        assert field.types == ref.fields[name].types, name
        if len(field.types) <= 2:  # gguf flattens arrays of arrays (its FIXME); ours keeps them nested
            assert field.contents() == ref.fields[name].contents(), name
    assert len(ours.tensors) == len(ref.tensors)
    for a, b in zip(ours.tensors, ref.tensors):
        assert (a.name, a.tensor_type, a.n_elements, a.n_bytes, a.data_offset) == (
            b.name, b.tensor_type, b.n_elements, b.n_bytes, b.data_offset)
        assert np.array_equal(a.shape, b.shape)
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape and np.array_equal(a.data, b.data)
    return ours


def write_every_type(path, alignment: int = 32) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment != 32:
        w.add_custom_alignment(alignment)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 1.5)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", -2.25)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo 世界")
    w.add_string("t.empty", "")
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, 1.25])
    w.add_array("t.strs", ["a", "", "ünï", "<|x|>"])
    w.add_array("t.bools", [True, False])
    w.add_array("t.nested", [[1, 2], [3]])
    w.add_array("t.none", [])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 7)).astype(np.float16))
    w.add_tensor("i32", np.arange(6, dtype=np.int32).reshape(2, 3))
    for qtype in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0):
        values = rng.standard_normal((4, 64)).astype(np.float32)
        w.add_tensor(qtype.name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("alignment", [32, 64])
def test_every_value_type(tmp_path, alignment):
    path = tmp_path / "every.gguf"
    write_every_type(path, alignment)
    r = same_as_gguf(path)
    assert r.alignment == alignment
    assert r.fields["t.strs"].string_bytes() == [b"a", b"", "ünï".encode(), b"<|x|>"]
    assert r.fields["t.nested"].contents() == [[1, 2], [3]]
    assert len(r.fields["t.strs"]) == 4 and r.fields["t.u64"].contents() == 2**63 + 5


def test_default_model_file():
    r = same_as_gguf(default_model_dir() / GGUF_NAME)
    tokens = r.fields["tokenizer.ggml.tokens"]
    assert len(tokens) == 49152 and tokens.contents()[:3] == [t.decode() for t in tokens.string_bytes()[:3]]


def test_damaged_files(tmp_path):
    path = tmp_path / "every.gguf"
    write_every_type(path)
    data = path.read_bytes()
    last = GGUFReader(path).tensors[-1]
    for cut in (10, 100, 700, last.data_offset + last.n_bytes - 1):  # header, metadata, tensor infos, data
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(ValueError, match=f"cut{cut}.gguf: not a readable GGUF file \\({cut} bytes"):
            open_gguf(bad)
    bad = tmp_path / "magic.gguf"
    bad.write_bytes(b"GGML" + data[4:])
    with pytest.raises(ValueError, match="bad magic"):
        open_gguf(bad)
