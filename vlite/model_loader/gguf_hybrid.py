"""Qwen3.5, Qwen3.5-MoE and Qwen3-Next GGUF files (llama.cpp's qwen35, qwen35moe, qwen3next) in Hugging Face terms:
the linear-attention metadata as `ModelArchConfig` fields, checked against the file's tensor records before any
tensor data is read, and the tensors put back into the checkpoint's names, row order and values, so that the model
classes (vlite/models/qwen3_5.py, qwen3_next.py) run them as they run a Hugging Face folder.

What llama.cpp's converter (convert_hf_to_gguf.py: conversion/qwen.py's Qwen3NextModel, and the Qwen3.5 classes
derived from it) writes, and what is undone here (i: the layer; "tiled": see below):

    Hugging Face (model.layers.i.)          GGUF (blk.i.)                  the converter's change
    linear_attn.in_proj_qkv [q; k; v]       attn_qkv                       v rows tiled
    linear_attn.in_proj_z                   attn_gate                      rows tiled
    linear_attn.in_proj_b, in_proj_a        ssm_beta, ssm_alpha            rows tiled
    linear_attn.in_proj_qkvz (Qwen3-Next)   attn_qkv, attn_gate            regrouped from per-key-head [q k v z]
                                                                           groups to [all q; all k; all v], [all z]
                                            ssm_in (older files)           as is
    linear_attn.in_proj_ba (Qwen3-Next)     ssm_ba                         as is: per key head, its b rows then a
    linear_attn.conv1d [C, 1, K]            ssm_conv1d [C, K]              squeezed; v channels tiled
    linear_attn.A_log                       ssm_a                          -exp(A_log); tiled
    linear_attn.dt_bias                     ssm_dt.bias                    tiled
    linear_attn.norm                        ssm_norm                       as is
    linear_attn.out_proj                    ssm_out                        input columns tiled
    input_layernorm                         attn_norm                      + 1 (every RMSNorm but the DeltaNet's:
    post_attention_layernorm                post_attention_norm            + 1  the checkpoint scales by 1 + weight,
    self_attn.q_norm, k_norm; model.norm    attn_q_norm, k_norm; output_norm + 1  ggml by the weight)
    self_attn.q_proj [q_h; gate_h per head] attn_q                         as is (neox rotary: no permutation)
    self_attn.q/k/v_proj (--fuse-qkv)       attn_qkv of an attention layer rows stacked [q_proj; k; v]
    mlp.experts.{e}.*_proj                  ffn_{gate,up,down}_exps        stacked [E, rows, K]; gate and up as one
                                                                           ffn_gate_up_exps (--fuse-gate-up-exps)
    mlp.shared_expert.*_proj                ffn_{gate,up,down}_shexp
    mlp.shared_expert_gate [1, hidden]      ffn_gate_inp_shexp             1-D after llama-quantize

Qwen3-Next's projections thus come out as Qwen3.5's four (in_proj_qkv, _z, _b, _a): the config says
linear_grouped_projections=False, and quantized ones stay packed.

"Tiled" (qwen35 and qwen35moe files, where there are r > 1 value heads per key head): Hugging Face orders the value
heads by key head (value heads j*r .. j*r + r-1 read key head j); the converter writes them in the order ggml
broadcasts, the first value head of every key head, then the second, ... Every per-value-head row, conv channel,
entry and out_proj input column moves with its head; here they move back (quantized rows are independent; out_proj's
columns move in whole blocks, `PackedTensors.col_groups`: K-quants converted to 32-input blocks, the values kept;
value heads narrower than 32 dequantized). qwen3next files keep Hugging Face's order.

Metadata ({arch}. keys): ssm.conv_kernel = linear_conv_kernel_dim, ssm.state_size = linear_key_head_dim,
ssm.group_count = linear_num_key_heads, ssm.time_step_rank = linear_num_value_heads, ssm.inner_size =
linear_num_value_heads * linear_value_head_dim; attention.recurrent_layers (a flag per block, written when the
config lists layer_types), else full_attention_interval (every n-th layer attends; llama.cpp's default 4);
rope.dimension_count (the rotated dims); rope.dimension_sections (Qwen3.5's multimodal rotary sections: with a text
position on all three axes, ordinary rotary); expert_shared_feed_forward_length (the shared expert's width);
nextn_predict_layers: blocks after the model's own holding its multi-token-prediction head, skipped as the
Hugging Face loader skips mtp.* tensors.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Callable, Union

import numpy as np

from vlite.model_arch import ModelArchConfig

if TYPE_CHECKING:  # the header's part (gguf_config) imports no torch
    from vlite.layers.packed import PackedTensors

Value = Union[np.ndarray, "PackedTensors"]

# A Gated DeltaNet layer's GGUF tensors (after "blk.i.") -> Hugging Face's (after "model.layers.i.linear_attn.").
LINEAR_TENSORS = {
    "attn_qkv.weight": "in_proj_qkv.weight",
    "attn_gate.weight": "in_proj_z.weight",
    "ssm_beta.weight": "in_proj_b.weight",
    "ssm_alpha.weight": "in_proj_a.weight",
    "ssm_ba.weight": "in_proj_ba.weight",  # Qwen3-Next: split into in_proj_b and in_proj_a
    "ssm_in.weight": "in_proj_qkvz.weight",  # older Qwen3-Next files: split into in_proj_qkv and in_proj_z
    "ssm_conv1d.weight": "conv1d.weight",
    "ssm_a": "A_log",
    "ssm_dt.bias": "dt_bias",
    "ssm_norm.weight": "norm.weight",
    "ssm_out.weight": "out_proj.weight",
}
# The projections among them (what a quantized file quantizes).
LINEAR_MATRICES = ("attn_qkv.weight", "attn_gate.weight", "ssm_beta.weight", "ssm_alpha.weight", "ssm_ba.weight",
                   "ssm_in.weight", "ssm_out.weight")
# Tensors a DeltaNet layer has in one of two forms (the second: Qwen3-Next's grouped projections)
_ALTERNATIVES = ((("attn_qkv.weight", "attn_gate.weight"), ("ssm_in.weight",)),
                 (("ssm_beta.weight", "ssm_alpha.weight"), ("ssm_ba.weight",)))
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
# Tensors of an attention layer (a DeltaNet layer has none of them)
_ATTENTION = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "attn_q_norm.weight",
              "attn_k_norm.weight")


def block_of(name: str) -> tuple[int, str] | None:
    """(layer, the rest) of a per-layer GGUF tensor name, None for the model's global tensors."""
    m = _BLOCK_RE.match(name)
    return None if m is None else (int(m.group(1)), m.group(2))


def linear_attention_fields(arch: str, key: Callable[..., Any], n_layers: int) -> dict[str, Any]:
    """The linear-attention fields of a hybrid's header (`key(name, default)`: the value of {arch}.name)."""

    def need(name: str) -> int:
        value = key(name)
        if value is None:
            raise ValueError(f"GGUF metadata key {arch}.{name} is missing (a {arch} file needs it)")
        return int(value)

    kernel, key_dim, key_heads = need("ssm.conv_kernel"), need("ssm.state_size"), need("ssm.group_count")
    value_heads, inner = need("ssm.time_step_rank"), need("ssm.inner_size")
    if value_heads < 1 or inner % value_heads:
        raise ValueError(f"{arch}.ssm.inner_size ({inner}) must be {arch}.ssm.time_step_rank ({value_heads}, the "
                         f"value heads) times the value head size")
    recurrent, _ = _layer_pattern(arch, key, n_layers)
    return {"linear_layers": tuple(i for i, r in enumerate(recurrent) if r), "linear_conv_kernel_dim": kernel,
            "linear_num_key_heads": key_heads, "linear_num_value_heads": value_heads,
            "linear_key_head_dim": key_dim, "linear_value_head_dim": inner // value_heads,
            "linear_grouped_projections": False}  # Qwen3-Next's groups are split at load (module docstring)


def _layer_pattern(arch: str, key: Callable[..., Any], n_layers: int) -> tuple[list[bool], str]:
    """Which of the model's layers are DeltaNet layers, and the metadata that says so (as llama.cpp reads it)."""
    flags = key("attention.recurrent_layers")
    if flags is not None:
        flags = list(flags) if isinstance(flags, (list, tuple)) else [flags]
        if len(flags) < n_layers:
            raise ValueError(f"{arch}.attention.recurrent_layers has {len(flags)} flags for {n_layers} layers")
        return [bool(f) for f in flags[:n_layers]], f"{arch}.attention.recurrent_layers"
    interval = int(key("full_attention_interval", 4))
    if interval < 1:
        raise ValueError(f"{arch}.full_attention_interval must be >= 1, got {interval}")
    return [(i + 1) % interval != 0 for i in range(n_layers)], f"{arch}.full_attention_interval ({interval})"


def check_tensors(config: ModelArchConfig, arch: str, key: Callable[..., Any], tensors: dict[str, tuple[int, ...]]
                  ) -> None:
    """The header's tensor records (name -> shape, numpy order) against the metadata, before any data is read:
    each layer holds the tensors of the mixer the layer pattern gives it, and every DeltaNet tensor the shape the
    ssm.* keys give; a ValueError naming the tensor and the key otherwise."""
    c = config
    _, source = _layer_pattern(arch, key, c.num_hidden_layers)
    by_layer: dict[int, dict[str, tuple[int, ...]]] = {}
    for name, shape in tensors.items():
        block = block_of(name)
        if block is not None and block[0] < c.num_hidden_layers:
            by_layer.setdefault(block[0], {})[block[1]] = shape
    hk, hv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    conv, inner, hidden, kernel = c.linear_conv_dim, hv * dv, c.hidden_size, c.linear_conv_kernel_dim
    want = {"attn_qkv.weight": (conv, hidden), "attn_gate.weight": (inner, hidden),
            "ssm_in.weight": (conv + inner, hidden), "ssm_beta.weight": (hv, hidden), "ssm_alpha.weight": (hv, hidden),
            "ssm_ba.weight": (2 * hv, hidden), "ssm_conv1d.weight": (conv, kernel), "ssm_a": (hv,),
            "ssm_dt.bias": (hv,), "ssm_norm.weight": (dv,), "ssm_out.weight": (hidden, inner)}
    keys = (f"{arch}.ssm.conv_kernel={kernel}, ssm.group_count={hk}, ssm.state_size={dk}, ssm.time_step_rank={hv}, "
            f"ssm.inner_size={inner}, embedding_length={hidden}")
    linear = set(c.linear_layers)
    for i in range(c.num_hidden_layers):
        names = by_layer.get(i, {})
        ssm = sorted(n for n in names if n.startswith("ssm_"))
        attention = sorted(n for n in names if n in _ATTENTION)
        if i in linear and attention:
            raise ValueError(f"tensor blk.{i}.{attention[0]} is full attention's, but {source} makes layer {i} a "
                             f"Gated DeltaNet (linear-attention) layer")
        if i not in linear and ssm:
            raise ValueError(f"tensor blk.{i}.{ssm[0]} is a Gated DeltaNet (linear-attention) layer's, but {source} "
                             f"makes layer {i} a full-attention layer")
        if i not in linear:
            continue
        required = [n for n in want if not any(n in a + b for a, b in _ALTERNATIVES)]
        required += [n for a, b in _ALTERNATIVES for n in (b if b[0] in names else a)]
        missing = [f"blk.{i}.{n}" for n in required if n not in names]
        if missing:
            raise ValueError(f"{source} makes layer {i} a Gated DeltaNet (linear-attention) layer, but the file lacks "
                             f"its tensors {missing}")
        for n, shape in names.items():
            if n in want and tuple(shape) != want[n]:
                raise ValueError(f"tensor blk.{i}.{n} has shape {list(shape)}, the metadata ({keys}) needs "
                                 f"{list(want[n])}")


def linear_tensors(config: ModelArchConfig, tiled: bool, layer: int, base: str, value: Value
                   ) -> list[tuple[str, Value]]:
    """One DeltaNet tensor of the file (`base`: its name after "blk.{layer}.") as the checkpoint's tensor(s): dense
    ones as float arrays, quantized projections packed (rows reordered, never requantized)."""
    c = config
    hk, hv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    r = hv // hk
    untile = tiled and r > 1
    prefix = f"model.layers.{layer}.linear_attn."
    hf_name = prefix + LINEAR_TENSORS[base]

    def heads(v: Value, size: int, offset: int = 0) -> Value:
        """Rows [offset:] are value heads of `size` rows each, in the file's order: Hugging Face's order."""
        if not untile:
            return v
        index = np.arange(offset + hv * size)
        index[offset:] = offset + value_head_order(hk, r, size)
        return _rows(v, index)

    if base == "attn_qkv.weight":
        return [(hf_name, heads(value, dv, 2 * hk * dk))]
    if base == "attn_gate.weight":
        return [(hf_name, heads(value, dv))]
    if base in ("ssm_beta.weight", "ssm_alpha.weight", "ssm_dt.bias"):
        return [(hf_name, heads(value, 1))]
    if base == "ssm_ba.weight":  # per key head: its r value heads' b rows, then their a rows
        index = np.arange(2 * hv).reshape(hk, 2, r)
        return [(prefix + "in_proj_b.weight", _rows(value, index[:, 0].reshape(-1))),
                (prefix + "in_proj_a.weight", _rows(value, index[:, 1].reshape(-1)))]
    if base == "ssm_in.weight":  # per key head: its q, k, then its value heads' v and z rows
        index = np.arange(hk * (2 * dk + 2 * r * dv)).reshape(hk, -1)
        q, k, v, z = np.split(index, np.cumsum([dk, dk, r * dv]), axis=1)
        return [(prefix + "in_proj_qkv.weight", _rows(value, np.concatenate([q.ravel(), k.ravel(), v.ravel()]))),
                (prefix + "in_proj_z.weight", _rows(value, z.reshape(-1)))]
    if base == "ssm_conv1d.weight":  # [C, K] -> the checkpoint's depthwise [C, 1, K]
        v = heads(value, dv, 2 * hk * dk)
        return [(hf_name, v.reshape(v.shape[0], 1, v.shape[-1]))]
    if base == "ssm_a":  # -exp(A_log) -> A_log
        with np.errstate(divide="ignore", invalid="ignore"):
            return [(hf_name, heads(np.log(-np.asarray(value, dtype=np.float64)), 1))]
    if base == "ssm_out.weight":
        return [(hf_name, _value_head_columns(value, hk, r, dv) if untile else value)]
    return [(hf_name, value)]  # ssm_norm: one weight per value-head dim, shared by the heads


def attention_qkv(config: ModelArchConfig, layer: int, value: Value) -> list[tuple[str, Value]]:
    """An attention layer's fused attn_qkv (llama.cpp's --fuse-qkv) as the checkpoint's q_proj (queries and their
    gates), k_proj and v_proj."""
    c = config
    q, kv = 2 * c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    if value.shape[0] != q + 2 * kv:
        raise ValueError(f"tensor blk.{layer}.attn_qkv.weight has {value.shape[0]} rows, the attention needs "
                         f"{q} + 2 x {kv} (queries and gates, keys, values)")
    p = f"model.layers.{layer}.self_attn."
    return [(p + n, _rows(value, np.arange(a, b))) for n, a, b in (
        ("q_proj.weight", 0, q), ("k_proj.weight", q, q + kv), ("v_proj.weight", q + kv, q + 2 * kv))]


def value_head_order(key_heads: int, per_key: int, size: int) -> np.ndarray:
    """index[i] = the file's row of Hugging Face's row i, for value heads of `size` rows each: Hugging Face's head
    g * per_key + j (value head j of key head g) is the file's head j * key_heads + g."""
    return np.arange(key_heads * per_key * size).reshape(per_key, key_heads, size).transpose(1, 0, 2).reshape(-1)


def _rows(v: Value, index: np.ndarray) -> Value:
    import torch

    from vlite.layers.packed import PackedTensors

    if isinstance(v, PackedTensors):
        return v.rows(torch.from_numpy(np.ascontiguousarray(index, dtype=np.int64)))
    return v[index]


def _value_head_columns(v: Value, key_heads: int, per_key: int, size: int) -> Value:
    """out_proj's input columns (value heads of `size`) back in Hugging Face's order. Quantized: whole blocks move
    (K-quants converted to 32-input blocks first); heads narrower than a block are dequantized (float)."""
    import torch

    from vlite.layers.packed import PackedTensors

    order = value_head_order(key_heads, per_key, 1)
    if isinstance(v, PackedTensors):
        try:
            return v.col_groups(torch.from_numpy(order), size)
        except ValueError:
            v = v.dequantize(torch.float32).numpy()
    return v[:, value_head_order(key_heads, per_key, size)]
