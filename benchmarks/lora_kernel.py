"""Time of the C++ multi-LoRA update (LoRALinear.apply) against the torch op (vlite.lora.ops.add_lora_linear),
at SmolLM2-135M's shapes: 30 layers x 4 fused projections, all 7 modules, every ISA build this CPU runs.

    python benchmarks/lora_kernel.py [--ranks 8 16] [--rows 1 32] [--reps 20] [--stack]

A "step" runs every layer's 4 projections once (120 calls from Python, each layer's own adapter tensors,
so that the weights stream from cache or memory as in a model, not from L1). T = 1: one row under slot 0;
T = 32: rows spread round-robin over 3 slots. Printed: us per call (the step / 120) and ms per step.
`--stack`: instead, the fused decode layers (LlamaDecodeStack, random int8 weights) with and without set_lora,
the speed ratio the targets are about (embedding and lm_head not included).
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable

import torch

from vlite import _custom_ops
from vlite.layers.quantization import quantize_int8
from vlite.lora.layout import LoRASlice
from vlite.lora.ops import LoRAKernelMeta, add_lora_linear

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, LAYERS = 576, 9, 3, 64, 1536, 30
Q, KV = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
# projection: (in_features, [(out_offset, n) per module])
PROJECTIONS = {"qkv": (HIDDEN, [(0, Q), (Q, KV), (Q + KV, KV)]), "o": (Q, [(0, HIDDEN)]),
               "gate_up": (HIDDEN, [(0, INTER), (INTER, INTER)]), "down": (INTER, [(0, HIDDEN)])}
SLOTS = 3


def out_features(parts: list[tuple[int, int]]) -> int:
    return parts[-1][0] + parts[-1][1]


def timed(step: Callable[[], None], reps: int) -> float:
    """The fastest of `reps` steps after a warm-up (the least disturbed by other processes)."""
    for _ in range(min(reps, 3)):
        step()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return min(times)


def adapters(rank: int, wdtype: torch.dtype, gen: torch.Generator) -> list[dict[str, list[list[tuple]]]]:
    """Per layer, per projection, per slot: the modules (a [r, K], b_t [r, n], out_offset)."""
    return [{p: [[((torch.randn(rank, k, generator=gen) * 0.05).to(wdtype),
                   (torch.randn(rank, n, generator=gen) * 0.05).to(wdtype), off) for off, n in parts]
                 for _ in range(SLOTS)] for p, (k, parts) in PROJECTIONS.items()} for _ in range(LAYERS)]


def token_slots(rows: int) -> torch.Tensor:
    return torch.arange(rows, dtype=torch.int32) % SLOTS


def kernel_step(ops: Any, weights: list, slots: torch.Tensor, dtype: torch.dtype) -> tuple[Callable[[], None], Any]:
    mapping = ops.LoRAMapping()
    mapping.set(slots)
    lins, bufs = [], {}
    for layer in weights:
        for p, (k, parts) in PROJECTIONS.items():
            lin = ops.LoRALinear(mapping, SLOTS, out_features(parts), k)
            for s, modules in enumerate(layer[p]):
                lin.set_slot(s, modules)
            lins.append((lin, p))
    t = slots.numel()
    for p, (k, parts) in PROJECTIONS.items():
        bufs[p] = (torch.randn(t, out_features(parts)).to(dtype), torch.randn(t, k).to(dtype))

    def step() -> None:
        for lin, p in lins:
            lin.apply(*bufs[p])
    return step, mapping


def torch_step(weights: list, slots: torch.Tensor, dtype: torch.dtype, rank: int) -> Callable[[], None]:
    """The torch op on the layout's zero-padded stacked weights (what the Python path runs without the kernel)."""
    stacked = []
    for layer in weights:
        for p, (k, parts) in PROJECTIONS.items():
            r = rank * len(parts)
            a = torch.zeros(SLOTS, r, k, dtype=dtype)
            b = torch.zeros(SLOTS, out_features(parts), r, dtype=dtype)
            for s, modules in enumerate(layer[p]):
                for j, (aj, bj, off) in enumerate(modules):
                    a[s, j * rank:(j + 1) * rank] = aj
                    b[s, off:off + bj.shape[1], j * rank:(j + 1) * rank] = bj.T
            slices = tuple(LoRASlice(off, off + n, j * rank, (j + 1) * rank) for j, (off, n) in enumerate(parts))
            stacked.append((p, a, b, slices))
    t = slots.numel()
    bufs = {p: (torch.randn(t, out_features(parts)).to(dtype), torch.randn(t, k).to(dtype))
            for p, (k, parts) in PROJECTIONS.items()}

    def step() -> None:
        meta = LoRAKernelMeta.make(slots)  # once per step, as the model runner does
        for p, a, b, slices in stacked:
            add_lora_linear(*bufs[p], meta, a, b, slices)
    return step


def decode_stack(ops: Any, dtype: torch.dtype, rows: int, gen: torch.Generator) -> tuple[Any, Callable[[], Any]]:
    """SmolLM2-135M's 30 decoder layers on random int8 weights, one decode row per request (context 256)."""
    stack = ops.LlamaDecodeStack()
    shapes = [(Q + 2 * KV, HIDDEN), (HIDDEN, Q), (2 * INTER, HIDDEN), (HIDDEN, INTER)]
    for _ in range(LAYERS):
        linears = []
        for n, k in shapes:
            t = quantize_int8(torch.randn(n, k, generator=gen) * 0.05).tiled()
            linears.append([ops.PackedLinear(t.qt, t.scales, t.mins, t.fmt, t.sub, t.n, None)])
        norm = torch.ones(HIDDEN, dtype=dtype)
        stack.add_layer(norm, norm, 1e-5, linears, None, HEADS, KV_HEADS, HEAD_DIM)
    bs, ctx = 16, 256
    blocks = ctx // bs
    caches = [torch.randn(2, KV_HEADS, rows * blocks, bs, HEAD_DIM, generator=gen).to(dtype) for _ in range(LAYERS)]
    block_table = torch.arange(rows * blocks).view(rows, blocks)
    seq_lens = torch.full((rows,), ctx)
    slot_mapping = block_table[:, -1] * bs + bs - 1
    hidden = torch.randn(rows, HIDDEN).to(dtype)
    cos, ssin = torch.ones(rows, HEAD_DIM), torch.zeros(rows, HEAD_DIM)
    return stack, lambda: stack.forward(hidden, cos, ssin, caches, slot_mapping, block_table, seq_lens,
                                        HEAD_DIM ** -0.5, None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--isas", nargs="+", default=_custom_ops.supported_isas())
    parser.add_argument("--stack", action="store_true")
    args = parser.parse_args()
    print(f"torch threads {torch.get_num_threads()}; per call = step / {4 * LAYERS}")
    gen = torch.Generator().manual_seed(0)
    cases = [(F, X) for F in (torch.float32, torch.bfloat16) for X in (torch.float32, torch.bfloat16)]
    for rank in args.ranks if not args.stack else []:
        for wdtype, dtype in cases:
            weights = adapters(rank, wdtype, gen)
            for rows in args.rows:
                slots = token_slots(rows)
                line = f"rank {rank:2d} w {str(wdtype)[6:]:8s} x/out {str(dtype)[6:]:8s} T {rows:2d}:"
                if wdtype == dtype:
                    ref = timed(torch_step(weights, slots, dtype, rank), max(3, args.reps // 4))
                    line += f"  torch {ref * 1e6 / (4 * LAYERS):7.1f} us {ref * 1e3:6.2f} ms |"
                for isa in args.isas:
                    step, _ = kernel_step(_custom_ops.load(isa), weights, slots, dtype)
                    sec = timed(step, args.reps)
                    line += f"  {isa} {sec * 1e6 / (4 * LAYERS):6.1f} us {sec * 1e3:5.2f} ms"
                print(line, flush=True)
    if args.stack:
        for isa in args.isas:
            ops = _custom_ops.load(isa)
            for dtype, wdtype in ((torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16),
                                  (torch.float32, torch.float32)):
                for rank in args.ranks:
                    weights = adapters(rank, wdtype, gen)
                    for rows in args.rows:
                        stack, forward = decode_stack(ops, dtype, rows, gen)
                        mapping = ops.LoRAMapping()
                        keep = []
                        for i, layer in enumerate(weights):
                            lins = []
                            for p, (k, parts) in PROJECTIONS.items():
                                lin = ops.LoRALinear(mapping, SLOTS, out_features(parts), k)
                                for s, modules in enumerate(layer[p]):
                                    lin.set_slot(s, modules)
                                lins.append(lin)
                            stack.set_lora(i, *lins)
                            keep.append(lins)
                        slots = token_slots(rows)
                        # interleaved, so that the machine's other load weighs on both alike
                        base, with_lora = [], []
                        for _ in range(args.reps + 3):
                            mapping.clear()  # no adapter rows: set_lora's updates are no-ops
                            base.append(timed(forward, 1))
                            mapping.set(slots)
                            with_lora.append(timed(forward, 1))
                        b, w = min(base[3:]), min(with_lora[3:])
                        print(f"{isa} stack x {str(dtype)[6:]:8s} w {str(wdtype)[6:]:8s} rank {rank:2d} T {rows:2d}: "
                              f"base {b * 1e3:5.2f} ms, with LoRA {w * 1e3:5.2f} ms, speed {b / w:.2f}x", flush=True)


if __name__ == "__main__":
    main()
