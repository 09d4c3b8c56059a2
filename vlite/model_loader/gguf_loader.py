"""Load a GGUF file of any family the registry reads (vlite/models/registry.py) into Hugging Face-named tensors.

Quantized tensors stay in their own blocks (`PackedTensors`, vlite/model_loader/gguf_quants.py,
not a value changed); the model decides per layer whether to run them packed or dequantize them.
Dense ones (F32/F16/BF16) are cast to the requested dtype.
"""

from __future__ import annotations

import dataclasses
import os
import re
import struct
from pathlib import Path
from typing import Any, Iterator, Union

import numpy as np
import torch

from vlite.layers import weight_arena
from vlite.layers.packed import PackedTensors
from vlite.model_arch import ModelArchConfig, expected_weight_names, ignored_weight_names
from vlite.model_loader import gguf_gemma4, gguf_hybrid
from vlite.model_loader.gguf_config import arch_from_gguf_metadata
from vlite.model_loader.gguf_quants import DENSE_TYPES, SUPPORTED_TYPES, to_packed
from vlite.model_loader.gguf_reader import GGUFReader
from vlite.models.registry import spec_for

Weight = Union[torch.Tensor, PackedTensors]

# GGUF per-layer tensor base names (llama.cpp's, shared by every family vlite reads) -> Hugging Face names.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# Tensors that carry no weights for the HF layout (rope_freqs and Phi-3's LongRoPE factors are folded into
# the config).
_SKIPPED = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z0-9_]+)\.(weight|bias)$")
# A mixture layer's experts, stacked [experts, rows, K]: gate, up and down in the order of expert_names
# (gate_up: gate's rows then up's, llama.cpp's --fuse-gate-up-exps); their biases [experts, rows] (gpt-oss).
_EXPERTS_RE = re.compile(r"^blk\.(\d+)\.ffn_(gate_up|gate|up|down)_exps\.(weight|bias)$")
_EXPERT_PARTS = ("gate", "up", "down")
# One-row weights the models read as dense [1, K] tensors whatever the file's type (a quantizer may pack them;
# llama-quantize writes them 1-D, without the trailing dim of 1): the shared expert's gate.
_DENSE_ROWS = (".shared_expert_gate.weight",)
# Hugging Face parameters named without a `.weight` (GGUF names every tensor with one): gpt-oss's sinks.
_BARE = (".self_attn.sinks.weight",)


def gguf_to_hf_name(name: str, layer_names: dict[str, str] | None = None) -> str | None:
    """Map a GGUF tensor name to its HF name; None if it is not recognised. `layer_names`: the
    family's own per-layer names (registry.ModelSpec.gguf_layer_names), which take precedence."""
    m = _LAYER_RE.match(name)
    if m:
        layer, base, kind = m.groups()
        hf = (layer_names or {}).get(base) or _LAYER_NAMES.get(base)
        return None if hf is None else f"model.layers.{layer}.{hf}.{kind}"
    base, _, kind = name.rpartition(".")
    hf = _GLOBAL_NAMES.get(base)
    return None if hf is None or kind not in ("weight", "bias") else f"{hf}.{kind}"


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's rotary row permutation of a Q or K projection.

    The converter regroups each head's rows from HF's rotate-half order
    (first half, second half) into interleaved pairs; this restores HF order.
    Works for weights (rows, cols) and biases (rows,).
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf(path: Path, dtype: torch.dtype) -> tuple[ModelArchConfig, dict[str, Weight]]:
    """Read config and all weights of a GGUF file (dense ones cast to ``dtype``)."""
    config, tensors = iter_gguf(path, dtype)
    weights = dict(tensors)
    _check_complete(path, config, weights)
    return config, weights


def open_gguf(path: Path) -> Any:
    """The file's header and a memory map of it (`gguf_reader.GGUFReader`); a file it cannot parse (truncated: a
    download cut short; not GGUF) is an error naming the file and its size, before any work."""
    try:
        return GGUFReader(str(path))
    except (ValueError, IndexError, OSError, struct.error) as e:
        size = os.path.getsize(path)
        raise ValueError(f"{path}: not a readable GGUF file ({size} bytes; truncated or damaged?): {e}") from e


def gguf_arch(path: Path, reader: Any = None) -> ModelArchConfig:
    """The file's config, with the type of its linear weights, read from the header alone (no tensor data)."""
    reader = reader or open_gguf(path)
    check_tensor_types(path, reader)
    config = arch_from_gguf_metadata(reader)
    spec = spec_for(config.architecture)
    layer_names = {"ffn_gate_inp": f"{config.moe_prefix}.gate", **spec.gguf_layer_names}
    if spec.gguf_linear_attention:  # the layer pattern and DeltaNet shapes against the tensor records
        arch = reader.fields["general.architecture"].contents()
        shapes = {t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors}
        try:
            gguf_hybrid.check_tensors(config, arch, lambda k, d=None: _metadata(reader, f"{arch}.{k}", d), shapes)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
    linear_types = set()
    for t in reader.tensors:
        if t.name in _SKIPPED:
            continue
        hf_name = gguf_to_hf_name(t.name, layer_names)
        block = gguf_hybrid.block_of(t.name)
        if ((_EXPERTS_RE.match(t.name) and t.name.endswith(".weight") and config.num_experts)
                or (hf_name or "").endswith("_proj.weight")
                or (config.linear_layers and block is not None and block[1] in gguf_hybrid.LINEAR_MATRICES)):
            linear_types.add(t.tensor_type.name)
    if linear_types:
        config = dataclasses.replace(
            config, source_quantization=linear_types.pop() if len(linear_types) == 1 else "mixed")
    return config


def check_tensor_types(path: Path, reader: Any) -> None:
    """Every tensor's GGUF type is one vlite reads, from the header alone: else an error naming the first tensor
    that is not, its type and the supported types, before any weight is read."""
    readable = DENSE_TYPES + SUPPORTED_TYPES
    for t in reader.tensors:
        name = getattr(t.tensor_type, "name", str(t.tensor_type))
        if name not in readable and t.name not in _SKIPPED:
            raise ValueError(f"{path}: tensor {t.name!r} has GGUF type {name}, which vlite cannot read; "
                             f"supported: {', '.join(readable)}")


def _metadata(reader: Any, name: str, default: Any = None) -> Any:
    field = reader.fields.get(name)
    return default if field is None else field.contents()


def iter_gguf(path: Path, dtype: torch.dtype) -> tuple[ModelArchConfig, Iterator[tuple[str, Weight]]]:
    """The file's config, and its weights one at a time (a tensor-parallel rank keeps only its shard of
    each, so no process holds the whole model)."""
    reader = open_gguf(path)
    weight_arena.register_file_map(reader.data, str(path))  # tiled tensors give their pages back
    config = gguf_arch(path, reader)
    return config, _gguf_tensors(path, reader, config, dtype)


def _gguf_tensors(path: Path, reader: Any, config: ModelArchConfig, dtype: torch.dtype
                  ) -> Iterator[tuple[str, Weight]]:
    spec = spec_for(config.architecture)
    permuted = spec.gguf_qk_permuted
    layer_names = {"ffn_gate_inp": f"{config.moe_prefix}.gate", **spec.gguf_layer_names}
    linear = set(config.linear_layers)
    ignored = ignored_weight_names(config)
    for t in reader.tensors:
        if t.name in _SKIPPED or gguf_to_hf_name(t.name, layer_names) in ignored:
            continue
        block = gguf_hybrid.block_of(t.name)
        if block is not None and block[0] >= config.num_hidden_layers and spec.gguf_linear_attention:
            continue  # a multi-token-prediction block after the model's layers (nextn_predict_layers)
        other = gguf_gemma4.gguf_other_name(t.name) if spec.name == "gemma4" else None
        if other is not None:  # Gemma 4's scales, per-layer tables and stacked experts (kept [E * rows, K])
            dims = tuple(int(d) for d in reversed(t.shape.tolist()))
            value = _packed_or_dense(path, t.name, t.data, t.tensor_type,
                                     (int(np.prod(dims[:-1])), dims[-1]) if len(dims) == 3 else dims)
            yield other, value if isinstance(value, PackedTensors) else _to_torch(value, dtype)
            continue
        experts = _EXPERTS_RE.match(t.name)
        if experts and config.num_experts:
            yield from _split_experts(path, t, config, int(experts.group(1)), experts.group(2), dtype,
                                      experts.group(3)).items()
            continue
        # GGUF lists dims fastest-first; numpy (row-major) wants them reversed.
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        if block is not None and spec.gguf_linear_attention and (
                (block[0] in linear and block[1] in gguf_hybrid.LINEAR_TENSORS) or block[1] == "attn_qkv.weight"):
            value = _packed_or_dense(path, t.name, t.data, t.tensor_type, shape)
            parts = (gguf_hybrid.linear_tensors(config, spec.gguf_linear_attention == "tiled", *block, value)
                     if block[0] in linear else gguf_hybrid.attention_qkv(config, block[0], value))
            for hf_name, part in parts:
                yield hf_name, part if isinstance(part, PackedTensors) else _to_torch(part, dtype)
            continue
        hf_name = gguf_to_hf_name(t.name, layer_names)
        if hf_name is None:
            raise ValueError(f"{path}: unexpected tensor {t.name!r} for a {config.architecture} GGUF file")
        if hf_name.endswith(_BARE):
            hf_name = hf_name.removesuffix(".weight")
        n_head = None
        if permuted:  # rows back from llama.cpp's interleaved-rotary order
            n_head = (config.num_attention_heads if ".self_attn.q_proj." in hf_name else
                      config.num_key_value_heads if ".self_attn.k_proj." in hf_name else None)
        value = _packed_or_dense(path, t.name, t.data, t.tensor_type, shape)
        if hf_name.endswith(_DENSE_ROWS):
            value = value.dequantize(torch.float32).numpy() if isinstance(value, PackedTensors) else value
            value = value.reshape(1, -1)
        if isinstance(value, PackedTensors):
            if n_head is not None:  # rows are independent in the packed layout: reorder them
                value = value.rows(torch.from_numpy(unpermute_qk(np.arange(shape[0]), n_head)))
            yield hf_name, value
            continue
        if n_head is not None:
            value = unpermute_qk(value, n_head)
        if config.norm_unit_offset and hf_name.endswith("norm.weight"):
            # llama.cpp's converter stores Gemma's (and Qwen3.5's) RMSNorm weights with the 1 of (1 + weight)
            # added (ggml multiplies by the weight as is); back to the checkpoint's meaning
            value = value.astype(np.float64) - 1.0
        yield hf_name, _to_torch(value, dtype)


def _split_experts(path: Path, t: Any, config: ModelArchConfig, layer: int, part: str,
                   dtype: torch.dtype, kind: str = "weight") -> dict[str, Weight]:
    """One stacked expert tensor [experts, rows, K] -> each expert's 2-D weight under the checkpoint's
    name; quantized ones stay in their blocks (each expert's rows are whole blocks of the stack: the same
    path, `to_packed`, for every GGUF type, MXFP4 included). A fused gate_up stack holds each expert's gate
    rows, then its up rows. `kind` "bias": a stack of biases [experts, rows] -> each expert's (gpt-oss)."""
    dims = [int(d) for d in reversed(t.shape.tolist())]
    if len(dims) != (2 if kind == "bias" else 3):
        raise ValueError(f"{path}: tensor {t.name!r} has shape {dims}, not a stack of each expert's {kind}")
    e_count, rows, k = dims if kind == "weight" else (*dims, 0)
    if e_count != config.num_experts:
        raise ValueError(f"{path}: tensor {t.name!r} holds {e_count} experts, the metadata says {config.num_experts}")
    parts = ("gate", "up") if part == "gate_up" else (part,)
    if rows % len(parts):
        raise ValueError(f"{path}: tensor {t.name!r} has {rows} rows per expert, not gate's and up's alike")
    n = rows // len(parts)
    names = [config.expert_names[_EXPERT_PARTS.index(p)] for p in parts]
    out: dict[str, Weight] = {}
    for e in range(e_count):
        value = _packed_or_dense(path, t.name, t.data[e], t.tensor_type, (rows, k) if k else (rows,))
        for j, name in enumerate(names):
            hf_name = f"model.layers.{layer}.{config.moe_prefix}.experts.{e}.{name}.{kind}"
            if isinstance(value, PackedTensors):
                out[hf_name] = value if len(parts) == 1 else value.rows(torch.arange(j * n, (j + 1) * n))
            else:
                out[hf_name] = _to_torch(value[j * n:(j + 1) * n], dtype)
    return out


def _packed_or_dense(path: Path, name: str, data: np.ndarray, qtype: Any,
                     shape: tuple[int, ...]) -> Union[PackedTensors, np.ndarray]:
    """One tensor's data: a quantized matrix in its own blocks, anything dense as an array of `shape`;
    a GGUF type vlite cannot read is an error naming the file and the tensor."""
    from gguf.quants import dequantize

    try:
        packed = to_packed(data, qtype, shape) if len(shape) == 2 else None
    except ValueError as e:
        raise ValueError(f"{path}: tensor {name!r}: {e}") from e
    if packed is not None:
        return packed
    if qtype.name not in DENSE_TYPES:
        raise ValueError(f"{path}: tensor {name!r} has GGUF type {qtype.name}, which vlite cannot read; "
                         f"supported: {DENSE_TYPES + SUPPORTED_TYPES}")
    return dequantize(data, qtype).reshape(shape)


def _to_torch(arr: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    arr = np.ascontiguousarray(arr, dtype=np.float32)
    if not arr.flags.writeable:  # F32 tensors are views of the read-only memory map
        arr = arr.copy()
    return torch.from_numpy(arr).to(dtype)




def _check_complete(path: Path, config: ModelArchConfig, weights: dict[str, Weight]) -> None:
    """Fail early, naming the tensors, if the file lacks a weight the model needs or has one it does not use."""
    expected = expected_weight_names(config)
    missing = sorted(expected - weights.keys())
    if missing:
        raise ValueError(f"{path}: missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    extra = sorted(weights.keys() - expected)
    if extra:
        raise ValueError(f"{path}: tensors a {config.architecture} model does not use: {extra[:5]}")
    _check_shapes(path, config, weights)


def _check_shapes(path: Path, config: ModelArchConfig, weights: dict[str, Weight]) -> None:
    """The embedding, the head and every layer's attention and dense-MLP projections have the shapes the
    metadata gives (a file whose tensors disagree with its header fails here, naming the tensor)."""
    c = config
    expected = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size), "lm_head.weight": (c.vocab_size,
                                                                                                 c.hidden_size)}
    first_shared = c.num_hidden_layers - c.num_kv_shared_layers  # Gemma 4's MLPs may be wider from here

    def by_suffix(layer: int) -> dict[str, tuple[int, int]]:  # a layer's heads: Gemma 4's full layers have their own
        d = c.layer_head_dim(layer)
        q_out, kv_out = c.num_attention_heads * d, c.layer_kv_heads(layer) * d
        q_rows = 2 * q_out if c.attn_output_gate else q_out  # Qwen3.5: each head's query, then its output gate
        mlp = {".mlp.gate_proj.weight": (c.intermediate_size, c.hidden_size),
               ".mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),
               ".mlp.down_proj.weight": (c.hidden_size, c.intermediate_size)} if layer < first_shared else {}
        return {".self_attn.q_proj.weight": (q_rows, c.hidden_size),
                ".self_attn.k_proj.weight": (kv_out, c.hidden_size),
                ".self_attn.v_proj.weight": (kv_out, c.hidden_size),
                ".self_attn.o_proj.weight": (c.hidden_size, q_out), **mlp}
    for name, w in weights.items():
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else 0
        want = expected.get(name) or next((v for k, v in by_suffix(layer).items() if name.endswith(k)), None)
        got = tuple(w.shape)
        if want is not None and ".experts." not in name and got != want:
            raise ValueError(f"{path}: tensor {name} has shape {list(got)}, the metadata's {c.architecture} "
                             f"config needs {list(want)}")
