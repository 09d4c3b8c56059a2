"""A Hugging Face folder's config.json (and generation_config.json) as a `ModelArchConfig`.

Handles both the classic ``rope_theta``/``rope_scaling`` keys and the newer ``rope_parameters`` dict
written by transformers 5. The architecture's registry entry (vlite/models/registry.py) adds the
features its config leaves implicit. No torch: the API process parses configs too.
"""

from __future__ import annotations

from typing import Any

from vlite.layers.rope_scaling import ROPE_TYPES, longrope_scaling, yarn_scaling
from vlite.model_arch import ModelArchConfig
from vlite.model_loader.encoder_config import arch_from_encoder_config, num_labels
from vlite.models.registry import (SUPPORTED_HF_ARCHITECTURES, ModelSpec, is_decoder_classifier, spec_for,
                                   spec_for_hf)
from vlite.utils import extend_ids

__all__ = ["arch_from_hf_config"]


def arch_from_hf_config(config: dict[str, Any], generation_config: dict[str, Any] | None = None
                        ) -> ModelArchConfig:
    """The record of a parsed ``config.json`` (and optionally ``generation_config.json``: more EOS ids)."""
    spec = _hf_spec(config)
    if isinstance(config.get("text_config"), dict) and spec.hf_renames:  # an image-text checkpoint: its text model
        config = {**config["text_config"], "architectures": config.get("architectures"),
                  "tie_word_embeddings": config.get("tie_word_embeddings",
                                                    config["text_config"].get("tie_word_embeddings", False))}
    if spec.features.get("is_causal") is False:  # BERT-style encoders: a config of their own
        return arch_from_encoder_config(config, spec)
    if config.get("use_bidirectional_attention") not in (None, False, "vision"):  # "vision": text stays causal
        raise ValueError(f"{spec.name} models with bidirectional attention (embedding models) are not supported")
    if config.get("clip_qkv") is not None:  # OLMoE / OLMo 1 option: q, k, v clamped
        raise ValueError(f"{spec.name} models with clip_qkv are not supported")
    layer_windows = _hf_layer_windows(config, spec)
    hidden = int(config["hidden_size"])
    n_heads = int(config["num_attention_heads"])
    n_kv = int(config.get("num_key_value_heads") or n_heads)
    head_dim = config.get("head_dim") or hidden // n_heads
    rope_theta, rope_scaling, rope_local_theta = _hf_rope(config)
    rope_type = (rope_scaling or {}).get("rope_type", "default")
    if rope_type not in ROPE_TYPES:  # refused with the config, not later when the model is built
        raise ValueError(f"rope scaling {rope_type!r} is not supported yet; vlite supports: "
                         f"{', '.join(ROPE_TYPES)}")
    max_positions = int(config.get("max_position_embeddings", 2048))
    if rope_type == "longrope":
        rope_scaling, max_positions = longrope_scaling(config, rope_scaling, max_positions)
    elif rope_type == "yarn":
        rope_scaling = yarn_scaling(rope_scaling, max_positions)

    eos: list[int] = []
    extend_ids(eos, config.get("eos_token_id"))
    if generation_config:
        extend_ids(eos, generation_config.get("eos_token_id"))
    bos = config.get("bos_token_id")
    if bos is None and generation_config:
        bos = generation_config.get("bos_token_id")

    bias = bool(config.get("attention_bias", False))  # Llama/Qwen3: q, k, v and o alike
    optional = {"rope_local_theta": rope_local_theta,
                **{k: _float_or_none(config.get(k)) for k in (
                    "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping", "swiglu_alpha",
                    "swiglu_limit")},
                # transformers 5 writes it into rope_parameters, 4 at the top level
                "partial_rotary_factor": _float_or_none(config.get("partial_rotary_factor") or (
                    config.get("rope_parameters") or {}).get("partial_rotary_factor"))}
    features = {**spec.defaults, **{k: v for k, v in optional.items() if v is not None},
                "attention_bias": bias, "attention_out_bias": bias,
                "mlp_bias": bool(config.get("mlp_bias", False)),
                # Gemma names its activation hidden_activation (older configs carry both keys)
                "hidden_act": config.get("hidden_activation") or config.get("hidden_act") or "silu",
                **_hf_moe(config), **_hf_linear_attention(config),
                **(_hf_gemma4(config) if spec.name == "gemma4" else {}), **spec.features}
    if is_decoder_classifier((config.get("architectures") or [""])[0]):  # the last token's states -> num_labels
        features.update(classifier="score", num_labels=num_labels(config))
    return ModelArchConfig(
        architecture=spec.name,
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(config.get("intermediate_size") or config["moe_intermediate_size"]),
        num_hidden_layers=int(config["num_hidden_layers"]),
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv,
        head_dim=int(head_dim),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=max_positions,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(eos),
        layer_windows=layer_windows,
        nope_layers=_hf_nope_layers(config),
        **features,
    )


def _hf_spec(config: dict[str, Any]) -> ModelSpec:
    """The registry entry of a config.json: ``architectures[0]``, else its ``model_type``."""
    archs = config.get("architectures")
    if archs:
        return spec_for_hf(archs[0])
    model_type = config.get("model_type") or "llama"  # the oldest Llama configs name neither
    try:
        return spec_for(model_type)
    except ValueError:
        raise ValueError(f"unsupported model_type {model_type!r} (config.json names no architecture); "
                         f"vlite supports: {', '.join(SUPPORTED_HF_ARCHITECTURES)}") from None


def _hf_moe(config: dict[str, Any]) -> dict[str, Any]:
    """The mixture-of-experts fields of a config.json ({} for a dense model). Qwen3-MoE keeps a dense MLP
    on its `mlp_only_layers` and on layers i with (i + 1) % decoder_sparse_step != 0, as transformers does;
    Mixtral and OLMoE name no such keys (every layer a mixture) and size experts by intermediate_size."""
    n_experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    if not n_experts or config.get("enable_moe_block") is False:
        return {}
    n_layers, step = int(config["num_hidden_layers"]), int(config.get("decoder_sparse_step") or 1)
    dense = set(config.get("mlp_only_layers") or ())
    top_k = config.get("num_experts_per_tok") or config.get("top_k_experts")  # Gemma 4: top_k_experts
    return {"num_experts": n_experts, "num_experts_per_tok": int(top_k),
            "moe_intermediate_size": int(config.get("moe_intermediate_size") or config["intermediate_size"]),
            "norm_topk_prob": bool(config.get("norm_topk_prob", False)),
            "moe_layers": tuple(i for i in range(n_layers) if i not in dense and (i + 1) % step == 0)}


def _hf_linear_attention(config: dict[str, Any]) -> dict[str, Any]:
    """The Gated DeltaNet fields of a hybrid's config.json ({} for a model without linear-attention layers):
    `layer_types` ("linear_attention" / "full_attention"), else every `full_attention_interval`-th layer full."""
    if "linear_num_value_heads" not in config:
        return {}
    n_layers = int(config["num_hidden_layers"])
    layer_types = config.get("layer_types")
    if layer_types is None:
        interval = int(config.get("full_attention_interval") or 4)
        layer_types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n_layers)]
    if len(layer_types) != n_layers or set(layer_types) - {"linear_attention", "full_attention"}:
        raise ValueError(f"layer_types {layer_types} is not one of linear_attention/full_attention per layer")
    return {"linear_layers": tuple(i for i, t in enumerate(layer_types) if t == "linear_attention"),
            **{k: int(config[k]) for k in ("linear_conv_kernel_dim", "linear_num_key_heads", "linear_num_value_heads",
                                           "linear_key_head_dim", "linear_value_head_dim")},
            "shared_expert_intermediate_size": int(config.get("shared_expert_intermediate_size") or 0)}


def _hf_gemma4(config: dict[str, Any]) -> dict[str, Any]:
    """Gemma 4's fields ({} for other models): the full-attention layers' head size and KV heads (top-level keys,
    or transformers 5's per_layer_config of a full layer), KV sharing, per-layer inputs, the MLP beside a mixture
    on every layer (enable_moe_block; its top-k weights always renormalized)."""
    if config.get("attention_bias"):
        raise ValueError("gemma4 models with attention_bias are not supported")
    types = config.get("layer_types") or []
    full = next((c for i, c in (config.get("per_layer_config") or {}).items()
                 if int(i) < len(types) and types[int(i)] == "full_attention"), {})
    k_eq_v = bool(config.get("attention_k_eq_v", False))
    if full:
        head_dim, kv_heads = full.get("head_dim") or config["head_dim"], full.get("num_key_value_heads") or 0
    else:  # transformers' defaults: 512, and the global KV heads only where values are keys
        head_dim = config.get("global_head_dim") or 512
        kv_heads = (config.get("num_global_key_value_heads") or 0) if k_eq_v else 0
    out = {"global_head_dim": int(head_dim), "num_global_key_value_heads": int(kv_heads), "attention_k_eq_v": k_eq_v,
           "num_kv_shared_layers": int(config.get("num_kv_shared_layers") or 0),
           "hidden_size_per_layer_input": int(config.get("hidden_size_per_layer_input") or 0),
           "vocab_size_per_layer_input": int(config.get("vocab_size_per_layer_input") or config["vocab_size"])}
    if config.get("enable_moe_block"):
        out.update(norm_topk_prob=True, moe_layers=tuple(range(int(config["num_hidden_layers"]))))
    return out


def _float_or_none(value: Any) -> float | None:
    return None if value is None else float(value)


def _hf_layer_windows(config: dict[str, Any], spec: ModelSpec) -> tuple[int, ...]:
    """Each layer's sliding window from a config.json (() when none slides); refused where the family
    has no sliding-window support in vlite."""
    if spec.sliding_global_every is None:
        if _has_sliding_window(config):
            raise ValueError(f"{spec.name} models with sliding-window attention are not supported yet")
        return ()
    window = config.get("sliding_window")
    if not window:
        return ()
    n_layers = int(config["num_hidden_layers"])
    layer_types = config.get("layer_types")
    if layer_types:
        if len(layer_types) != n_layers or set(layer_types) - {"sliding_attention", "full_attention"}:
            raise ValueError(f"layer_types {layer_types} is not one of sliding_attention/full_attention per layer")
        sliding = [t == "sliding_attention" for t in layer_types]
    else:  # Gemma 3's older configs: sliding_window_pattern; Mistral: every layer
        every = int(config.get("sliding_window_pattern") or config.get("_sliding_window_pattern")
                    or spec.sliding_global_every)
        sliding = [every == 0 or (i + 1) % every != 0 for i in range(n_layers)]
    return tuple(int(window) if s else 0 for s in sliding)


def _hf_nope_layers(config: dict[str, Any]) -> tuple[int, ...]:
    """The layers without rotary (SmolLM3). Its `no_rope_layers` flags each layer 1 = rotary, 0 = none;
    without it, every `no_rope_layer_interval`-th layer has none (transformers' SmolLM3Config)."""
    n_layers = int(config["num_hidden_layers"])
    flags = config.get("no_rope_layers")
    if flags is None:
        interval = config.get("no_rope_layer_interval")
        if not interval:
            return ()
        flags = [int((i + 1) % int(interval) != 0) for i in range(n_layers)]
    if len(flags) < n_layers:
        raise ValueError(f"no_rope_layers {flags} must flag each of the {n_layers} layers")
    return tuple(i for i in range(n_layers) if not flags[i])


def _has_sliding_window(config: dict[str, Any]) -> bool:
    """Whether any layer attends through a sliding window, in each convention configs use."""
    layer_types = config.get("layer_types")
    if layer_types:
        return "sliding_attention" in layer_types
    if "use_sliding_window" in config:  # Qwen2/Qwen3: the window applies from max_window_layers on
        n_layers = int(config.get("num_hidden_layers", 0))
        first = config.get("max_window_layers")
        return bool(config["use_sliding_window"] and config.get("sliding_window")
                    and (first is None or int(first) < n_layers))
    return config.get("sliding_window") is not None  # Mistral: every layer


def _hf_rope(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None, float | None]:
    """Return (rope_theta, rope_scaling-or-None, local rope_theta-or-None) from either HF config convention.

    Gemma 3 gives its sliding layers their own base: `rope_local_base_freq` (transformers 4), or
    `rope_parameters` per layer type (transformers 5: {"full_attention": {...}, "sliding_attention": {...}}).
    """
    params = config.get("rope_parameters")
    scaling = config.get("rope_scaling")
    theta = config.get("rope_theta")
    local_theta = config.get("rope_local_base_freq")
    if isinstance(params, dict) and "full_attention" in params:
        local = params.get("sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"rope scaling of sliding layers ({local}) is not supported")
        if local.get("rope_theta") is not None:
            local_theta = local["rope_theta"]
        params = params["full_attention"]
    if isinstance(params, dict):
        if theta is None:
            theta = params.get("rope_theta")
        if scaling is None:
            scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if theta is None:
        theta = 10000.0
    if scaling:
        scaling = dict(scaling)
        if "rope_type" not in scaling and "type" in scaling:
            scaling["rope_type"] = scaling["type"]
        scaling.pop("type", None)
        scaling.pop("rope_theta", None)
        if scaling.get("rope_type") != "proportional":  # Gemma 4's keeps it: which share of each half rotates
            scaling.pop("partial_rotary_factor", None)  # not a scaling: ModelArchConfig.partial_rotary_factor
        if scaling.get("rope_type", "default") == "default":
            scaling = None
    return float(theta), scaling or None, _float_or_none(local_theta)
