"""Gemma 4 in llama.cpp's GGUF layout (its converter's Gemma4Model): the metadata that differs from Gemma 3's,
and the tensor names of the parts Gemma 3 lacks.

    {arch}.attention.key_length        the full layers' head size (global_head_dim); key_length_swa: head_dim
    {arch}.attention.head_count_kv     one count for all, or per layer (full layers' own KV heads)
    {arch}.feed_forward_length         one width, or per layer (E2B's KV-shared layers: twice as wide)
    {arch}.attention.shared_kv_layers  num_kv_shared_layers
    {arch}.embedding_length_per_layer_input, per_layer_token_embd [vocab_per_layer, layers * d]
    rope_freqs                         the full layers' proportional rope: 1 for each rotated angle, 1e30
                                       (no rotation) for the rest of each half
    blk.N.ffn_gate_inp.scale / ffn_down_exps.scale: the router's scale and per-expert scales;
    blk.N.ffn_gate_up_exps [E, 2I, H]: the experts stacked as transformers keeps them.

Norm weights are stored as the checkpoint has them (Gemma 4 scales by w, not 1 + w). No torch.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

# Names outside the weight/bias pattern: GGUF name (layer as {}) -> checkpoint name.
GGUF_OTHER_NAMES = {"per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",
                    "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
                    "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight",
                    "blk.{}.layer_output_scale.weight": "model.layers.{}.layer_scalar",
                    "blk.{}.ffn_gate_inp.scale": "model.layers.{}.router.scale",
                    "blk.{}.ffn_down_exps.scale": "model.layers.{}.router.per_expert_scale",
                    "blk.{}.ffn_gate_up_exps.weight": "model.layers.{}.experts.gate_up_proj",
                    "blk.{}.ffn_down_exps.weight": "model.layers.{}.experts.down_proj"}


def gguf_other_name(name: str) -> str | None:
    """The checkpoint name of a GGUF tensor in GGUF_OTHER_NAMES, or None."""
    parts = name.split(".")
    if len(parts) > 2 and parts[0] == "blk" and parts[1].isdigit():
        pattern = ".".join(["blk", "{}", *parts[2:]])
        hf = GGUF_OTHER_NAMES.get(pattern)
        return None if hf is None else hf.format(parts[1])
    return GGUF_OTHER_NAMES.get(name)


def gemma4_fields(key: Callable[..., Any], tensors: dict[str, Any], n_layers: int, layer_windows: tuple[int, ...],
                  n_heads: int) -> dict[str, Any]:
    """ModelArchConfig fields of a gemma4 file that override the generic reading (head sizes, KV heads, widths,
    rope) and add Gemma 4's own."""
    from gguf.quants import dequantize

    sliding = [bool(w) for w in layer_windows] or [False] * n_layers
    full = next((i for i in range(n_layers) if not sliding[i]), None)
    kv = key("attention.head_count_kv", n_heads)
    kv = list(kv) if isinstance(kv, (list, tuple)) else [kv] * n_layers
    first_sliding = next((i for i in range(n_layers) if sliding[i]), 0)
    ff = key("feed_forward_length")
    head_full = int(key("attention.key_length"))
    out: dict[str, Any] = {
        "head_dim": int(key("attention.key_length_swa", 0) or head_full),
        "num_key_value_heads": int(kv[first_sliding]),
        "intermediate_size": int(min(ff) if isinstance(ff, (list, tuple)) else ff),
        "global_head_dim": head_full,
        "num_global_key_value_heads": int(kv[full]) if full is not None else 0,
        "num_kv_shared_layers": int(key("attention.shared_kv_layers", 0) or 0),
        "hidden_size_per_layer_input": int(key("embedding_length_per_layer_input", 0) or 0),
        "partial_rotary_factor": 1.0,
        "rope_scaling": None,
    }
    if full is not None:  # values are the keys where a full layer that projects K/V has no v
        out["attention_k_eq_v"] = (f"blk.{full}.attn_k.weight" in tensors
                                   and f"blk.{full}.attn_v.weight" not in tensors)
    table = tensors.get("per_layer_token_embd.weight")
    if table is not None:
        out["vocab_size_per_layer_input"] = int(table.shape[1])
    freqs = tensors.get("rope_freqs.weight")
    if freqs is not None:  # the full layers' proportional rope
        factors = dequantize(freqs.data, freqs.tensor_type).reshape(-1)
        rotated = int(np.sum(factors < 1e10))
        out["rope_scaling"] = {"rope_type": "proportional", "partial_rotary_factor": 2 * rotated / head_full}
    n_experts = int(key("expert_count") or 0)
    if n_experts:
        out.update(num_experts=n_experts, num_experts_per_tok=int(key("expert_used_count")),
                   moe_intermediate_size=int(key("expert_feed_forward_length")), norm_topk_prob=True,
                   moe_layers=tuple(i for i in range(n_layers) if f"blk.{i}.ffn_gate_inp.weight" in tensors))
    return out
