"""A GGUF file's header as a `ModelArchConfig`, in Hugging Face terms.

llama.cpp's metadata keys (`{arch}.embedding_length`, ...) map onto config.json's fields; what a file
shows only by its tensors (biases, q/k norms, an untied head, the mixture layers) is read from their
names, and rope scaling stored as tensors (llama3's divisors, LongRoPE's factor lists) is turned back
into the dict config.json would hold. No torch.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from vlite.layers.rope_scaling import llama3_rope_from_factors, longrope_scaling, yarn_scaling
from vlite.model_arch import ModelArchConfig
from vlite.model_loader.gguf_hybrid import linear_attention_fields
from vlite.models.registry import ModelSpec, spec_for, spec_for_gguf
from vlite.utils import extend_ids

__all__ = ["arch_from_gguf_metadata"]

# llama3 rope parameters used when a GGUF file only stores the precomputed factors
# and no original context length; any value gives the same frequencies once the
# low/high factors are fitted to it.
_DEFAULT_LLAMA3_ORIGINAL_CONTEXT = 8192
# llama.cpp scales Gemma's queries by head_dim ** -0.5 (GGUF stores no query_pre_attn_scalar), but by
# (hidden / heads) ** -0.5 for the one checkpoint of each family whose query_pre_attn_scalar is that,
# recognised by its layer count: Gemma 2 27B (46 layers), Gemma 3 27B (62).
_GGUF_GEMMA_HIDDEN_QUERY_SCALE = {"gemma2": 46, "gemma3": 62}
# Mixture families vlite reads from GGUF (vlite's name -> what the file's general.architecture says), and those of
# them with one gated shared expert (ffn_*_shexp, ffn_gate_inp_shexp).
_GGUF_MIXTURES = {"qwen3_moe": "qwen3moe", "mixtral": "llama (Mixtral)", "qwen35moe": "qwen35moe",
                  "qwen3next": "qwen3next", "gpt-oss": "gpt-oss"}
_GGUF_SHARED_EXPERT = ("qwen35moe", "qwen3next")
# What llama.cpp assumes where a family's GGUF file leaves a key out (Gemma 2 files converted before the
# converter wrote them: the window of 4096 and the soft-caps 50 and 30 of every Gemma 2 checkpoint).
# gpt-oss: its checkpoints' YaRN leaves the correction range unrounded (config.json's rope_parameters truncate:
# false), which files do not record (llama.cpp's own rope rounds it; vlite follows the checkpoints, as transformers).
_GGUF_UNSAID: dict[str, dict[str, Any]] = {
    "gemma2": {"sliding_window": 4096, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
    "gpt-oss": {"yarn_truncate": False}}


def arch_from_gguf_metadata(reader: Any) -> ModelArchConfig:
    """The record of a GGUF header (`gguf_reader.GGUFReader`: metadata plus the optional ``rope_freqs`` tensor)."""
    arch = _field(reader, "general.architecture")
    spec = spec_for_gguf(arch)

    def key(name: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{name}", default)

    if key("expert_count") and arch == "llama":  # llama.cpp writes Mixtral as "llama" with expert tensors
        spec = spec_for("mixtral")
    hidden = int(key("embedding_length"))
    n_heads = int(key("attention.head_count"))
    n_kv = key("attention.head_count_kv", n_heads)  # per layer in Gemma 4 files (gguf_gemma4)
    n_kv = int(n_kv[0] if isinstance(n_kv, (list, tuple)) else n_kv)
    # llama.cpp's n_embd_head_k and n_rot: rotary may turn fewer dims than a head has (Phi-4-mini)
    head_dim = int(key("attention.key_length", 0) or hidden // n_heads)
    rotary_dims = int(key("rope.dimension_count", 0) or head_dim)

    tensor_names = {t.name: t for t in reader.tensors}
    vocab = key("vocab_size")
    if vocab is None:
        vocab = int(tensor_names["token_embd.weight"].shape[1])
    theta = float(key("rope.freq_base", 10000.0))
    max_pos = int(key("context_length", 2048))

    rope_scaling: dict[str, Any] | None = None
    scaling_type = key("rope.scaling.type")
    if scaling_type not in (None, "none"):
        rope_scaling = {"rope_type": scaling_type, "factor": float(key("rope.scaling.factor", 1.0))}
        orig = key("rope.scaling.original_context_length")
        if orig is not None:
            rope_scaling["original_max_position_embeddings"] = int(orig)
        if scaling_type == "yarn":  # llama.cpp's yarn_* keys where the converter wrote them
            for name, field in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow")):
                if key(f"rope.scaling.{field}") is not None:
                    rope_scaling[name] = float(key(f"rope.scaling.{field}"))
            truncate = _GGUF_UNSAID.get(spec.name, {}).get("yarn_truncate")
            rope_scaling = yarn_scaling({**rope_scaling, **({} if truncate is None else {"truncate": truncate})},
                                        max_pos)
    elif "rope_factors_short.weight" in tensor_names:  # Phi-3 LongRoPE: both factor lists as tensors
        from gguf.quants import dequantize

        factors = {f"{k}_factor": [float(f) for f in dequantize(t.data, t.tensor_type).reshape(-1)]
                   for k in ("short", "long") for t in [tensor_names[f"rope_factors_{k}.weight"]]}
        attention = key("rope.scaling.attn_factor")
        rope_scaling, max_pos = longrope_scaling(
            {"original_max_position_embeddings": key("rope.scaling.original_context_length")},
            {"rope_type": "longrope", **factors,
             **({} if attention is None else {"attention_factor": float(attention)})}, max_pos)
    elif "rope_freqs.weight" in tensor_names and spec.name != "gemma4":  # gemma4's: its proportional rope
        # llama.cpp bakes llama3 rope scaling into per-frequency divisors.
        from gguf.quants import dequantize

        t = tensor_names["rope_freqs.weight"]
        factors = dequantize(t.data, t.tensor_type).reshape(-1).astype(np.float64)
        orig = key("rope.scaling.original_context_length")
        rope_scaling = llama3_rope_from_factors(
            factors, theta, head_dim, int(orig) if orig else _DEFAULT_LLAMA3_ORIGINAL_CONTEXT
        )

    eos: list[int] = []
    for k in ("eos_token_id", "eot_token_id", "eom_token_id"):
        extend_ids(eos, _field(reader, f"tokenizer.ggml.{k}"))
    if spec.gguf_end_of_turn and _field(reader, "tokenizer.ggml.eot_token_id") is None:
        extend_ids(eos, _gguf_token_ids(reader, spec.gguf_end_of_turn))
    bos = _field(reader, "tokenizer.ggml.bos_token_id")

    # block_count also counts the multi-token-prediction blocks llama.cpp keeps after the model's (Qwen3.5)
    n_layers = int(key("block_count")) - int(key("nextn_predict_layers", 0) or 0)
    layer_windows: tuple[int, ...] = ()
    unsaid = _GGUF_UNSAID.get(spec.name, {})
    window = int(key("attention.sliding_window", unsaid.get("sliding_window", 0)) or 0)
    if window and spec.sliding_global_every is not None:
        pattern = key("attention.sliding_window_pattern")  # newer files: per layer True = sliding
        if isinstance(pattern, list):
            sliding = [bool(p) for p in pattern]
        else:  # llama.cpp's fixed pattern for the family (or a count written as the key)
            every = int(pattern or spec.sliding_global_every)
            sliding = [every == 0 or (i + 1) % every != 0 for i in range(n_layers)]
        layer_windows = tuple(window if s else 0 for s in sliding)
    optional = {"rope_local_theta": key("rope.freq_base_swa"),
                **{k: key(k, unsaid.get(k)) for k in ("attn_logit_softcapping", "final_logit_softcapping")}}
    if spec.features.get("scale_embeddings"):
        # Gemma: GGUF stores no query_pre_attn_scalar (see _GGUF_GEMMA_HIDDEN_QUERY_SCALE)
        big = n_layers == _GGUF_GEMMA_HIDDEN_QUERY_SCALE.get(spec.name)
        optional["query_pre_attn_scalar"] = hidden / n_heads if big else head_dim
    # Optional parts show in the tensors a file has; the architecture's fixed features win, so a
    # file lacking one of its tensors fails as "missing tensors", not with a wrong model.
    features = {**spec.defaults, **{k: float(v) for k, v in optional.items() if v},
                "attention_bias": "blk.0.attn_q.bias" in tensor_names,
                "attention_out_bias": "blk.0.attn_output.bias" in tensor_names,
                "mlp_bias": "blk.0.ffn_up.bias" in tensor_names,
                "qk_norm": "blk.0.attn_q_norm.weight" in tensor_names,
                "partial_rotary_factor": rotary_dims / head_dim, **spec.features}
    nope_every = spec.gguf_nope_every
    features.update(_gguf_moe(spec, key, tensor_names, n_layers) if spec.name != "gemma4" else {})
    if spec.gguf_linear_attention:  # Qwen3.5 / Qwen3-Next: Gated DeltaNet layers among the attention layers
        features.update(linear_attention_fields(arch, key, n_layers))
    sizes = dict(intermediate_size=key("feed_forward_length") or key("expert_feed_forward_length"),
                 num_key_value_heads=n_kv, head_dim=head_dim, rope_scaling=rope_scaling)
    if spec.name == "gemma4":  # per-layer head sizes, widths and KV heads, per-layer inputs, KV sharing, mixtures
        from vlite.model_loader.gguf_gemma4 import gemma4_fields

        features.update(gemma4_fields(key, tensor_names, n_layers, layer_windows, n_heads))
        sizes = {k: features.pop(k) for k in sizes}
    return ModelArchConfig(
        architecture=spec.name,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(sizes["intermediate_size"]),
        num_hidden_layers=n_layers,
        num_attention_heads=n_heads,
        num_key_value_heads=sizes["num_key_value_heads"],
        head_dim=sizes["head_dim"],
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=theta,
        rope_scaling=sizes["rope_scaling"],
        max_position_embeddings=max_pos,
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(eos),
        layer_windows=layer_windows,
        nope_layers=tuple(i for i in range(n_layers) if nope_every and (i + 1) % nope_every == 0),
        **features,
    )


def _gguf_moe(spec: ModelSpec, key: Any, tensor_names: dict[str, Any], n_layers: int) -> dict[str, Any]:
    """The mixture-of-experts fields of a GGUF file ({} for a dense model). The mixture layers are those
    with a router tensor (ffn_gate_inp): files of models with dense layers among them (Qwen3-MoE's
    mlp_only_layers) hold plain ffn_* tensors there. Families vlite runs only densely, and shared experts
    but the one gated shared expert of Qwen3.5-MoE / Qwen3-Next (expert_shared_feed_forward_length wide), are
    refused by name."""
    n_experts = int(key("expert_count") or 0)
    if not n_experts:
        return {}
    if spec.name not in _GGUF_MIXTURES:
        raise ValueError(f"{spec.gguf_name or spec.name} GGUF files with experts (mixtures of experts) are not "
                         f"supported; GGUF mixtures vlite reads: {', '.join(_GGUF_MIXTURES.values())}")
    shared = int(key("expert_shared_feed_forward_length") or 0) if spec.name in _GGUF_SHARED_EXPERT else 0
    if key("expert_shared_count") not in (None, 0, 1 if shared else 0):
        raise ValueError(f"GGUF file with shared experts (expert_shared_count={key('expert_shared_count')}): "
                         f"not supported")
    norm = key("expert_weights_norm")
    return {"num_experts": n_experts, "num_experts_per_tok": int(key("expert_used_count")),
            "moe_intermediate_size": int(key("expert_feed_forward_length") or key("feed_forward_length")),
            "norm_topk_prob": bool(spec.features.get("norm_topk_prob", spec.defaults.get("norm_topk_prob", False))
                                   if norm is None else norm),
            "moe_layers": tuple(i for i in range(n_layers) if f"blk.{i}.ffn_gate_inp.weight" in tensor_names),
            **({"shared_expert_intermediate_size": shared} if shared else {})}


def _field(reader: Any, name: str, default: Any = None) -> Any:
    """Scalar/string/array value of a GGUF metadata key, or ``default`` if absent."""
    field = reader.fields.get(name)
    if field is None:
        return default
    return field.contents()


def _gguf_token_ids(reader: Any, texts: tuple[str, ...]) -> list[int]:
    """The ids of the vocabulary tokens spelled as one of `texts`, in id order (compared as raw bytes)."""
    field = reader.fields.get("tokenizer.ggml.tokens")
    if field is None:
        return []
    wanted = {t.encode() for t in texts}
    return [i for i, token in enumerate(field.string_bytes()) if token in wanted]
