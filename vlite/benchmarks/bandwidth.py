"""Decode as a memory-bound pass: the bytes of weights a decode step reads, and the machine's measured
read bandwidth to set them against (`vlite bench latency` prints both at batch size 1).

A one-token step reads every linear weight once (the embedding only for its one row), so at batch size
1 decode tokens/s x those bytes is the bandwidth decode achieves. The reference is a multi-threaded
streaming read in vlite's C++ kernels over huge-page memory like the weights' (`read_bandwidth`):
torch's reductions read slower than the kernels do.
"""

from __future__ import annotations

from typing import Any, Optional


def decode_weight_bytes(model: Any) -> int:
    """Bytes of the weights a one-token decode step reads: every packed linear's tiles (QuantizedLinear),
    and the dense 2-D parameters but the embedding table (of which a step reads one row)."""
    import torch

    from vlite.layers.quantization import QuantizedLinear

    seen: dict[int, int] = {}
    embed = getattr(getattr(model, "model", model), "embed_tokens", None)
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            t = module.tiled
            parts = (t.qt, t.scales, t.mins) if t is not None else (module.dense,)
            for p in parts:
                if p is not None:
                    seen[p.data_ptr()] = p.numel() * p.element_size()
        for p in module.parameters(recurse=False):
            if p.dim() == 2 and p is not embed and p.dtype.is_floating_point:
                seen[p.data_ptr()] = p.numel() * p.element_size()
    if isinstance(getattr(model, "lm_head", None), torch.Tensor):  # a dense head (tied: the embedding itself)
        head = model.lm_head
        seen[head.data_ptr()] = head.numel() * head.element_size()
    return sum(seen.values())


def measure_read_bandwidth(gib: float = 1.0, iters: int = 5) -> Optional[float]:
    """GB/s of the kernels' streaming read over `gib` GiB of huge-page memory, or None without the kernels."""
    import torch

    from vlite import _custom_ops
    from vlite.layers import weight_arena

    kernels = _custom_ops.load()
    if kernels is None:
        return None
    buf = weight_arena.empty((int(gib * 2**30),), torch.uint8)
    buf.fill_(1)  # every page mapped before the clock starts
    return float(kernels.read_bandwidth(buf, iters))


def decode_bandwidth_report(model: Any, decode_tokens_per_s: float) -> dict[str, Optional[float]]:
    """Bytes per decode token, the GB/s decode reaches, the measured read bandwidth and the share of it."""
    per_token = decode_weight_bytes(model)
    achieved = per_token * decode_tokens_per_s / 1e9
    measured = measure_read_bandwidth()
    return {"decode_weight_bytes_per_token": per_token, "decode_gb_per_s": achieved,
            "read_bandwidth_gb_per_s": measured,
            "decode_share_of_read_bandwidth": achieved / measured if measured else None}


def format_bandwidth(report: dict[str, Optional[float]]) -> str:
    line = (f"decode weight bytes per token: {report['decode_weight_bytes_per_token'] / 1e6:.1f} MB, "
            f"{report['decode_gb_per_s']:.1f} GB/s")
    if report["read_bandwidth_gb_per_s"]:
        line += (f" = {100 * report['decode_share_of_read_bandwidth']:.0f}% of the measured read bandwidth "
                 f"({report['read_bandwidth_gb_per_s']:.1f} GB/s, the kernels' threads streaming 1 GiB)")
    return line
