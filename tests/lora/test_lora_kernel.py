"""The C++ multi-LoRA kernel (LoRAMapping, LoRALinear, LlamaDecodeStack.set_lora) on every ISA build this CPU
runs, against a float64 reference of the same update and against vlite.lora.ops.add_lora_linear: mixed slots
with rows of no adapter, empty slots, non-contiguous rows, ranks per slot, fused-projection offsets, strided
views, float32 and bfloat16; T = 0 and no adapter rows are no-ops; bad arguments are named."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from vlite import _custom_ops
from vlite.layers.quantization import quantize_int8
from vlite.lora.layout import LoRASlice
from vlite.lora.ops import LoRAKernelMeta, add_lora_linear

ISAS = [pytest.param(isa, marks=pytest.mark.skipif(isa not in _custom_ops.supported_isas(),
                                                   reason=f"this CPU cannot run the {isa} build"))
        for isa in _custom_ops.ISAS]
F32, BF16 = torch.float32, torch.bfloat16


@pytest.fixture(params=ISAS)
def ops(request):
    module = _custom_ops.load(request.param)
    if module is None:
        pytest.skip("no C++ kernels on this machine")
    assert module.isa().startswith(request.param)
    return module


def make_slot(ranks: list[int], parts: list[tuple[int, int]], k: int, dtype: torch.dtype, gen: torch.Generator
              ) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """One slot's modules: module j of rank ranks[j] writing columns [off, off + n) for parts[j] = (off, n)."""
    return [((torch.randn(r, k, generator=gen) * 0.3).to(dtype), (torch.randn(r, n, generator=gen) * 0.3).to(dtype),
             off) for r, (off, n) in zip(ranks, parts)]


def reference(out: torch.Tensor, x: torch.Tensor, token_slot: list[int], slots: dict) -> torch.Tensor:
    """out + each row's update in float64 (h kept exact, as the kernel keeps it in float32)."""
    expected = out.double()
    for t, s in enumerate(token_slot):
        for a, b_t, off in slots.get(s, []) if s >= 0 else []:
            h = a.double() @ x[t].double()
            expected[t, off:off + b_t.shape[1]] += h @ b_t.double()
    return expected


def check(out: torch.Tensor, expected: torch.Tensor) -> None:
    if out.dtype == F32:
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    else:  # one rounding of the float32 sum: within a bf16 step of the exact value
        torch.testing.assert_close(out.double(), expected, rtol=2 ** -7, atol=1e-2)


QKV = (576, [(0, 576), (576, 192), (768, 192)], 960)  # SmolLM2's fused qkv: K, module parts, out_features
ODD = (40, [(3, 24), (30, 7)], 40)  # K and n not multiples of 16, columns no module covers


@pytest.mark.parametrize("wdtype,xdtype,odtype", [(F32, F32, F32), (BF16, BF16, BF16), (F32, BF16, BF16),
                                                  (BF16, F32, F32), (BF16, BF16, F32)])
@pytest.mark.parametrize("shape", [QKV, ODD], ids=["qkv", "odd"])
@pytest.mark.parametrize("token_slot", [[2], [-1, 0], [2, -1, 0, 2, 2, -1, 1, 0],
                                        [(t * 7) % 4 - 1 for t in range(33)]], ids=["1", "2", "8", "33"])
def test_matches_reference(ops, wdtype, xdtype, odtype, shape, token_slot) -> None:
    """Slot 1 holds no module (its rows unchanged), slot 3 is never used; slots 0 and 2 differ in rank and
    in the modules they cover; 33 rows over 3 slots run the multi-threaded path."""
    k, parts, n_out = shape
    gen = torch.Generator().manual_seed(len(token_slot) + k)
    slots = {0: make_slot([16, 8, 8][:len(parts)], parts, k, wdtype, gen),
             2: make_slot([5, 3][:len(parts) - 1], parts[1:], k, wdtype, gen),
             3: make_slot([4] * len(parts), parts, k, wdtype, gen)}
    mapping = ops.LoRAMapping()
    mapping.set(torch.tensor(token_slot, dtype=torch.int32))
    assert mapping.has_lora() == any(s >= 0 for s in token_slot) and mapping.num_tokens() == len(token_slot)
    lin = ops.LoRALinear(mapping, 4, n_out, k)
    for s, modules in slots.items():
        lin.set_slot(s, modules)
    x = torch.randn(len(token_slot), k, generator=gen).to(xdtype)
    out = torch.randn(len(token_slot), n_out, generator=gen).to(odtype)
    expected = reference(out, x, token_slot, slots)
    lin.apply(out, x)
    check(out, expected)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_a_row_has_the_same_bits_alone_or_batched(ops, dtype) -> None:
    """A decode row alone (one thread, b_t read row by row) and in a 40-row step (register blocks, two
    threads): every sum in the same order, so a request's output does not depend on the batch."""
    gen = torch.Generator().manual_seed(6)
    k, parts, n_out = QKV
    mapping = ops.LoRAMapping()
    lin = ops.LoRALinear(mapping, 3, n_out, k)
    for s in range(3):
        lin.set_slot(s, make_slot([16, 16, 16], parts, k, dtype, gen))
    x, out = torch.randn(40, k, generator=gen).to(dtype), torch.randn(40, n_out, generator=gen).to(dtype)
    batched = out.clone()
    mapping.set(torch.arange(40, dtype=torch.int32) % 3)
    lin.apply(batched, x)
    for t in (0, 17, 39):
        alone = out[t:t + 1].clone()
        mapping.set(torch.tensor([t % 3], dtype=torch.int32))
        lin.apply(alone, x[t:t + 1])
        assert torch.equal(alone[0], batched[t])


def test_agrees_with_add_lora_linear(ops) -> None:
    """The torch op on the layout's zero-padded stacked weights (output_slices) computes the same update."""
    gen = torch.Generator().manual_seed(1)
    k, parts, n_out = QKV
    max_rank, ranks = 16, {0: [16, 16, 16], 1: [8, 4, 2]}
    a = torch.zeros(2, 3 * max_rank, k)
    b = torch.zeros(2, n_out, 3 * max_rank)
    token_slot = [1, -1, 0, 1, 1, 0, -1]
    mapping = ops.LoRAMapping()
    mapping.set(torch.tensor(token_slot, dtype=torch.int32))
    lin = ops.LoRALinear(mapping, 2, n_out, k)
    for s, rs in ranks.items():
        modules = make_slot(rs, parts, k, F32, gen)
        lin.set_slot(s, modules)
        for j, (aj, bj, off) in enumerate(modules):
            a[s, j * max_rank:j * max_rank + aj.shape[0]] = aj
            b[s, off:off + bj.shape[1], j * max_rank:j * max_rank + aj.shape[0]] = bj.T
    slices = tuple(LoRASlice(off, off + n, j * max_rank, (j + 1) * max_rank) for j, (off, n) in enumerate(parts))
    x, out = torch.randn(len(token_slot), k, generator=gen), torch.randn(len(token_slot), n_out, generator=gen)
    expected = add_lora_linear(out.clone(), x, LoRAKernelMeta.make(torch.tensor(token_slot)), a, b, slices)
    lin.apply(out, x)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_strided_x_and_out(ops, dtype) -> None:
    """x a column-strided or row-strided view, out a view with a longer row stride: the rows written are out's."""
    gen = torch.Generator().manual_seed(2)
    k, parts, n_out = ODD
    token_slot = [0, -1, 0, 0]
    slots = {0: make_slot([6, 3], parts, k, dtype, gen)}
    mapping = ops.LoRAMapping()
    mapping.set(torch.tensor(token_slot, dtype=torch.int32))
    lin = ops.LoRALinear(mapping, 1, n_out, k)
    lin.set_slot(0, slots[0])
    big = torch.randn(4, 2 * k + 5, generator=gen).to(dtype)
    for x in (big[:, ::2][:, :k], big[:, 5:5 + k]):
        buffer = torch.randn(4, n_out + 9, generator=gen).to(dtype)
        out = buffer[:, 4:4 + n_out]
        before = buffer.clone()
        expected = reference(out, x, token_slot, slots)
        lin.apply(out, x)
        check(out, expected)
        assert torch.equal(buffer[:, :4], before[:, :4]) and torch.equal(buffer[:, 4 + n_out:], before[:, 4 + n_out:])


def test_no_adapter_rows_are_a_no_op(ops) -> None:
    gen = torch.Generator().manual_seed(3)
    mapping = ops.LoRAMapping()
    lin = ops.LoRALinear(mapping, 2, 40, 40)
    lin.set_slot(0, make_slot([4, 4], ODD[1], 40, F32, gen))
    assert not mapping.has_lora() and mapping.num_tokens() == 0  # a new mapping: T = 0
    lin.apply(torch.empty(0, 40), torch.empty(0, 40))
    mapping.set(torch.tensor([], dtype=torch.int32))
    lin.apply(torch.empty(0, 40), torch.empty(0, 40))
    mapping.set(torch.tensor([-1, -1, -1], dtype=torch.int32))
    assert not mapping.has_lora() and mapping.num_tokens() == 3
    out = torch.randn(3, 40, generator=gen)
    before = out.clone()
    lin.apply(out, torch.randn(3, 40, generator=gen))
    mapping.set(torch.tensor([1, 1, 1], dtype=torch.int32))  # slot 1 holds nothing for this projection
    lin.apply(out, torch.randn(3, 40, generator=gen))
    mapping.set(torch.tensor([0, 0, 0], dtype=torch.int32))
    mapping.clear()
    assert not mapping.has_lora() and mapping.num_tokens() == 0
    lin.apply(out, torch.randn(3, 40, generator=gen))
    assert torch.equal(out, before)


def test_clear_slot_drops_the_references(ops) -> None:
    """set_slot references the tensors (an in-place change shows), clear_slot lets them go."""
    gen = torch.Generator().manual_seed(4)
    mapping = ops.LoRAMapping()
    mapping.set(torch.tensor([0, 1], dtype=torch.int32))
    lin = ops.LoRALinear(mapping, 2, 40, 40)
    modules = make_slot([4], [(0, 40)], 40, F32, gen)
    lin.set_slot(0, modules)
    lin.set_slot(1, make_slot([4], [(0, 40)], 40, F32, gen))
    a, b_t, _ = modules[0]
    b_t.mul_(2)  # seen by the kernel: not a copy
    x, out = torch.randn(2, 40, generator=gen), torch.zeros(2, 40)
    lin.apply(out, x)
    torch.testing.assert_close(out[0], (a @ x[0]) @ b_t)
    ref = weakref.ref(a)
    del modules, a, b_t
    gc.collect()
    assert ref() is not None
    lin.clear_slot(0)
    gc.collect()
    assert ref() is None
    out = torch.zeros(2, 40)
    lin.apply(out, x)
    assert torch.equal(out[0], torch.zeros(40)) and out[1].abs().sum() > 0


def test_bad_arguments_are_named(ops) -> None:
    mapping = ops.LoRAMapping()
    lin = ops.LoRALinear(mapping, 2, 40, 32)
    a, b_t = torch.randn(4, 32), torch.randn(4, 20)
    with pytest.raises(RuntimeError, match="slot 2 is out of range"):
        lin.set_slot(2, [(a, b_t, 0)])
    with pytest.raises(RuntimeError, match="slot -1 is out of range"):
        lin.clear_slot(-1)
    with pytest.raises(RuntimeError, match="a must be"):
        lin.set_slot(0, [(torch.randn(4, 31), b_t, 0)])
    with pytest.raises(RuntimeError, match="b_t must be"):
        lin.set_slot(0, [(a, torch.randn(5, 20), 0)])
    with pytest.raises(RuntimeError, match="exceeds out_features"):
        lin.set_slot(0, [(a, b_t, 21)])
    with pytest.raises(RuntimeError, match="share a dtype"):
        lin.set_slot(0, [(a, b_t.bfloat16(), 0)])
    with pytest.raises(RuntimeError, match="contiguous"):
        lin.set_slot(0, [(a, torch.randn(20, 4).T, 0)])
    with pytest.raises(RuntimeError, match="overlap"):
        lin.set_slot(0, [(a, b_t, 0), (a, b_t, 19)])
    with pytest.raises(RuntimeError, match="token_slot"):
        mapping.set(torch.tensor([0, -2], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="token_slot"):
        mapping.set(torch.tensor([0.0]))
    lin.set_slot(0, [(a, b_t, 0), (a, b_t, 20)])
    mapping.set(torch.tensor([0, 1, -1], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="out must be"):
        lin.apply(torch.zeros(3, 41), torch.zeros(3, 32))
    with pytest.raises(RuntimeError, match="out must be"):
        lin.apply(torch.zeros(2, 40), torch.zeros(2, 32))  # T differs from the mapping's
    with pytest.raises(RuntimeError, match="out must be"):
        lin.apply(torch.zeros(40, 3).T, torch.zeros(3, 32))
    with pytest.raises(RuntimeError, match="x must be"):
        lin.apply(torch.zeros(3, 40), torch.zeros(3, 33))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        lin.apply(torch.zeros(3, 40, dtype=torch.float64), torch.zeros(3, 32))
    mapping.set(torch.tensor([0, 2], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="slot 2 is out of range"):
        lin.apply(torch.zeros(2, 40), torch.zeros(2, 32))


def _decode_layer(ops, hidden, layer, lora, cos, ssin, kv, slot_mapping, block_table, seq_lens, scale):
    """llama_decode_layer (decode_layer.cpp) step by step from Python, each LoRA applied after its projection."""
    norm1, norm2, eps, linears, heads, kv_heads, d = layer
    t = hidden.shape[0]

    def linear(x, i, residual=None):
        return ops.quant_linear(x, *linears[i], residual, None, None, None)

    x = ops.rms_norm(hidden, norm1, eps)
    qkv = linear(x, 0)
    lora[0].apply(qkv, x)
    ops.rotary_inplace(qkv, heads + kv_heads, d, cos, ssin)
    qkv3 = qkv.view(t, heads + 2 * kv_heads, d)
    ops.write_kv_cache(qkv3[:, heads:heads + kv_heads], qkv3[:, heads + kv_heads:], kv, slot_mapping)
    o = ops.paged_decode_attention(qkv3[:, :heads], kv[0], kv[1], block_table, seq_lens, scale).view(t, heads * d)
    h = linear(o, 1, hidden)
    lora[1].apply(h, o)
    y = ops.rms_norm(h, norm2, eps)
    gate_up = linear(y, 2)
    lora[2].apply(gate_up, y)
    act = ops.silu_and_mul(gate_up)
    out = linear(act, 3, h)
    lora[3].apply(out, act)
    return out


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_decode_stack_applies_lora_after_each_projection(ops, dtype) -> None:
    """The fused decode layers with set_lora give exactly the kernels called one by one with the same
    LoRALinear applied at the documented places (and differ from the layers without LoRA)."""
    gen = torch.Generator().manual_seed(5)
    hidden_size, heads, kv_heads, d, inter, n_layers, bs = 64, 4, 2, 16, 96, 2, 16
    q, kvd = heads * d, kv_heads * d
    shapes = [(q + 2 * kvd, hidden_size), (hidden_size, q), (2 * inter, hidden_size), (hidden_size, inter)]
    stack, layers = ops.LlamaDecodeStack(), []
    for _ in range(n_layers):
        linears = []
        for n, k in shapes:
            t = quantize_int8(torch.randn(n, k, generator=gen) * 0.2).tiled()
            linears.append((t.qt, t.scales, t.mins, t.fmt, t.sub, t.n))
        norms = [(1 + 0.2 * torch.randn(hidden_size, generator=gen)).to(dtype) for _ in range(2)]
        layer = (norms[0], norms[1], 1e-6, linears, heads, kv_heads, d)
        stack.add_layer(norms[0], norms[1], 1e-6, [[ops.PackedLinear(*w, None)] for w in linears], None, heads,
                        kv_heads, d)
        layers.append(layer)
    token_slot = [1, -1, 0, 1]
    t = len(token_slot)
    mapping = ops.LoRAMapping()
    mapping.set(torch.tensor(token_slot, dtype=torch.int32))
    loras = []
    parts = [[(0, q), (q, kvd), (q + kvd, kvd)], [(0, hidden_size)], [(0, inter), (inter, inter)], [(0, hidden_size)]]
    for _ in range(n_layers):
        per_layer = []
        for (n, k), p in zip(shapes, parts):
            lin = ops.LoRALinear(mapping, 2, n, k)
            for s in range(2):
                lin.set_slot(s, make_slot([8 - 4 * s] * len(p), p, k, dtype, gen))
            per_layer.append(lin)
        loras.append(per_layer)
    hidden = torch.randn(t, hidden_size, generator=gen).to(dtype)
    angles = torch.rand(t, d // 2, generator=gen) * 3
    cos = torch.cat([angles.cos()] * 2, 1)
    ssin = torch.cat([-angles.sin(), angles.sin()], 1)
    seq_lens = torch.tensor([5, 1, 17, 9])
    block_table = torch.arange(2 * t).view(t, 2)
    pos = seq_lens - 1  # each row's new token
    slot_mapping = block_table.gather(1, (pos // bs)[:, None])[:, 0] * bs + pos % bs
    caches = [torch.randn(2, kv_heads, 2 * t, bs, d, generator=gen).to(dtype) for _ in range(n_layers)]
    args = (cos, ssin)
    tail = (slot_mapping, block_table, seq_lens, d ** -0.5)

    plain = stack.forward(hidden, *args, [c.clone() for c in caches], *tail, None)
    for i, per_layer in enumerate(loras):
        stack.set_lora(i, *per_layer)
    fused = stack.forward(hidden, *args, [c.clone() for c in caches], *tail, None)
    expected = hidden
    for layer, per_layer, cache in zip(layers, loras, caches):
        expected = _decode_layer(ops, expected, layer, per_layer, *args, cache.clone(), *tail)
    assert torch.equal(fused, expected)
    assert torch.equal(fused[1], plain[1])  # no adapter: its own keys and values only, unchanged
    assert not torch.equal(fused[0], plain[0])
    for i in range(n_layers):  # None: no update for that projection
        stack.set_lora(i, None, None, None, None)
    assert torch.equal(stack.forward(hidden, *args, [c.clone() for c in caches], *tail, None), plain)
