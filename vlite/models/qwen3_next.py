"""Qwen3-Next (80B-A3B): Qwen3.5's hybrid (vlite/models/qwen3_5.py) with its DeltaNet input projections fused per
key-head group in the checkpoint: in_proj_qkvz holds, for each key head, its q, k, then its value heads' v and z
rows; in_proj_ba its value heads' b then a rows. They are put in Qwen3.5's order ([q; k; v], z, b, a) at load."""

from __future__ import annotations

import torch

from vlite.layers.linear import Weights
from vlite.layers.quantization import QuantizationPlan
from vlite.model_arch import ModelArchConfig
from vlite.models.qwen3_5 import Qwen3_5ForCausalLM


def ungroup_projections(cfg: ModelArchConfig, weights: Weights) -> Weights:
    """The checkpoint's grouped in_proj_qkvz / in_proj_ba as Qwen3.5's in_proj_qkv, _z, _b, _a (dense weights). A
    GGUF file's come ungrouped already (linear_grouped_projections false; vlite/model_loader/gguf_hybrid.py)."""
    if not cfg.linear_grouped_projections:
        return weights
    out = dict(weights)
    hk, dk, dv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    per = cfg.linear_num_value_heads // hk  # value heads per key head
    for i in cfg.linear_layers:
        p = f"model.layers.{i}.linear_attn."
        qkvz = out.pop(p + "in_proj_qkvz.weight")
        if not isinstance(qkvz, torch.Tensor):
            raise ValueError(f"{cfg.architecture}: grouped DeltaNet projections of quantized weights are not supported")
        q, k, v, z = qkvz.reshape(hk, 2 * dk + 2 * per * dv, -1).split([dk, dk, per * dv, per * dv], dim=1)
        out[p + "in_proj_qkv.weight"] = torch.cat([t.reshape(-1, t.shape[-1]) for t in (q, k, v)])
        out[p + "in_proj_z.weight"] = z.reshape(-1, z.shape[-1])
        b, a = out.pop(p + "in_proj_ba.weight").reshape(hk, 2 * per, -1).split([per, per], dim=1)
        out[p + "in_proj_b.weight"], out[p + "in_proj_a.weight"] = b.reshape(-1, b.shape[-1]), a.reshape(-1, a.shape[-1])
    return out


class Qwen3NextForCausalLM(Qwen3_5ForCausalLM):
    def __init__(self, cfg: ModelArchConfig, weights: Weights,
                 plan: QuantizationPlan = QuantizationPlan(None), dtype: torch.dtype = torch.float32) -> None:
        super().__init__(cfg, ungroup_projections(cfg, weights), plan, dtype)
