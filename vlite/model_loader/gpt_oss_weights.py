"""gpt-oss checkpoints' tensors in the names and layout vlite's loaders share.

A gpt-oss checkpoint stacks each layer's experts in 3-D tensors, in matmul (not Linear) layout:

    mlp.experts.gate_up_proj       [E, H, 2I]   gate and up interleaved: columns 0, 2, 4, ... gate; 1, 3, ... up
    mlp.experts.gate_up_proj_bias  [E, 2I]      interleaved alike
    mlp.experts.down_proj          [E, I, H]
    mlp.experts.down_proj_bias     [E, H]
    mlp.router.weight / .bias      [E, H] / [E]

and the published ones (openai/gpt-oss-20b, -120b) hold the expert matrices as MXFP4 instead: `{name}_blocks`
uint8 [E, rows, cols / 32, 16] (two FP4 values a byte, low nibble first) and `{name}_scales` uint8
[E, rows, cols / 32] (a power of two, 127 = 1), rows being the Linear layout's output rows (gate_up's
interleaved). vlite's models read what every mixture reads (vlite.layers.moe.SparseMoE, and the GGUF loader's
split of ffn_*_exps): per expert `mlp.experts.{e}.{gate,up,down}_proj.weight` [out, in] with their biases,
the router as `mlp.gate`.

MXFP4 blocks are dequantized to float here, exactly (every FP4 value times a power of two is a float32, and a
bf16 where the scale is in range): vlite's CPU kernels have no MXFP4 format for Hugging Face checkpoints, so the
experts then run as any dense (or --quantization int8/int4 re-quantized) weights. GGUF files' MXFP4 experts
(ggml type MXFP4) take the GGUF loader's packed path instead (vlite.model_loader.gguf_quants.to_packed).
"""

from __future__ import annotations

import re
from typing import Callable, Iterator

import torch

from vlite.model_arch import ModelArchConfig

__all__ = ["hf_tensors", "dequantize_mxfp4"]

# FP4 (E2M1) values by their 4-bit code: sign bit 3, then exponent and mantissa (transformers' FP4_VALUES)
_FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_EXPERTS = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$")
_ROUTER = re.compile(r"^(model\.layers\.\d+\.mlp)\.router\.(weight|bias)$")


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 blocks uint8 [..., G, 16] and scales uint8 [..., G] -> float32 [..., G * 32]: element 2j of a group
    is byte j's low nibble, 2j + 1 its high one, each FP4 value times 2 ** (scale - 127)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape \
            or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks uint8 [..., G, 16] with scales uint8 [..., G], got {blocks.dtype} "
                         f"{list(blocks.shape)} and {scales.dtype} {list(scales.shape)}")
    lut = torch.tensor(_FP4_VALUES, dtype=torch.float32)
    values = torch.stack((lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]), dim=-1).flatten(-2)
    values = torch.ldexp(values, scales.to(torch.int32)[..., None] - 127)
    return values.flatten(-2)


def hf_tensors(stored: Iterator[tuple[str, Callable[[], torch.Tensor]]], config: ModelArchConfig,
               dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's (name, read) pairs -> (vlite name, tensor of `dtype`): experts split per expert into
    Linear layout (MXFP4 ones dequantized once both blocks and scales were read), the router renamed; every
    other tensor as stored."""
    pending: dict[str, dict[str, torch.Tensor]] = {}  # an MXFP4 tensor's blocks or scales, until the other comes
    for name, read in stored:
        router = _ROUTER.match(name)
        if router:
            yield f"{router.group(1)}.gate.{router.group(2)}", read().to(dtype)
            continue
        experts = _EXPERTS.match(name)
        if not experts:
            yield name, read().to(dtype)
            continue
        prefix, proj, kind = experts.group(1), experts.group(2), experts.group(3) or ""
        if kind in ("_blocks", "_scales"):
            parts = pending.setdefault(f"{prefix}.{proj}", {})
            parts[kind] = read()
            if len(parts) < 2:
                continue
            del pending[f"{prefix}.{proj}"]
            linear = dequantize_mxfp4(parts["_blocks"], parts["_scales"])  # [E, out, in]
            yield from _split(prefix, proj, linear, config, dtype)
        elif kind == "_bias":
            yield from _split(prefix, proj, read(), config, dtype, bias=True)
        else:  # dense [E, in, out] (a float checkpoint, e.g. transformers' save_pretrained)
            yield from _split(prefix, proj, read().transpose(1, 2), config, dtype)
    if pending:
        raise ValueError(f"MXFP4 tensors without their blocks or scales: {sorted(pending)}")


def _split(prefix: str, proj: str, stacked: torch.Tensor, config: ModelArchConfig, dtype: torch.dtype,
           bias: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """A stacked [E, out(, in)] weight or bias -> each expert's, gate_up's interleaved rows de-interleaved."""
    e_count, rows = stacked.shape[0], stacked.shape[1]
    width = 2 * config.moe_intermediate_size if proj == "gate_up_proj" else config.hidden_size
    if e_count != config.num_experts or rows != width:
        raise ValueError(f"{prefix}.{proj}{'_bias' if bias else ''}: {e_count} experts of {rows} output rows, the "
                         f"config needs {config.num_experts} of {width}")
    suffix = "bias" if bias else "weight"
    for e in range(e_count):
        if proj == "down_proj":
            yield f"{prefix}.{e}.down_proj.{suffix}", stacked[e].to(dtype).contiguous()
            continue
        yield f"{prefix}.{e}.gate_proj.{suffix}", stacked[e, 0::2].to(dtype).contiguous()
        yield f"{prefix}.{e}.up_proj.{suffix}", stacked[e, 1::2].to(dtype).contiguous()
