"""An encoder's config.json (BERT, RoBERTa, XLM-RoBERTa; their sequence-classification variants) as a
`ModelArchConfig`, and its checkpoint's tensor names as the record's (`checkpoint_name`).

Encoders attend bidirectionally over each whole sequence and keep no KV cache (`is_causal` False); the
fields that only decoders read get neutral values (no rope, no EOS). No torch: the API process parses
configs too.
"""

from __future__ import annotations

import re
from typing import Any, Optional

from vlite.model_arch import ModelArchConfig
from vlite.models.registry import ModelSpec

__all__ = ["arch_from_encoder_config", "checkpoint_name"]

# Buffers (recomputed), and heads vlite does not run (masked-LM heads, BertModel's unused pooler).
_SKIPPED = re.compile(r"^(embeddings\.(position_ids|token_type_ids)|cls\..*|lm_head\..*)$")
_PREFIXES = ("bert.", "roberta.")


def arch_from_encoder_config(config: dict[str, Any], spec: ModelSpec) -> ModelArchConfig:
    """The record of an encoder's parsed config.json; `spec` is its registry entry (is_causal False)."""
    position_type = config.get("position_embedding_type", "absolute")
    if position_type != "absolute":
        raise ValueError(f"{spec.name} models with position_embedding_type {position_type!r} are not supported")
    if config.get("is_decoder") or config.get("add_cross_attention"):
        raise ValueError(f"{spec.name} configs with is_decoder / add_cross_attention are not supported")
    features = dict(spec.features)
    offset = 0
    if features.pop("roberta_positions", False):  # transformers: padding_idx + 1 + index, for unpadded input
        offset = int(config.get("pad_token_id", 1)) + 1
    hidden, n_heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    labels = num_labels(config) if features.get("classifier") else 0
    return ModelArchConfig(
        architecture=spec.name,
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(config["intermediate_size"]),
        num_hidden_layers=int(config["num_hidden_layers"]),
        num_attention_heads=n_heads,
        num_key_value_heads=n_heads,
        head_dim=hidden // n_heads,
        rms_norm_eps=float(config.get("layer_norm_eps", 1e-12)),
        rope_theta=0.0,
        rope_scaling=None,
        max_position_embeddings=int(config.get("max_position_embeddings", 512)),
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_ids=(),
        hidden_act=config.get("hidden_act", "gelu"),
        type_vocab_size=int(config.get("type_vocab_size", 0)),
        position_offset=offset,
        num_labels=labels,
        **features,
    )


def num_labels(config: dict[str, Any]) -> int:
    """transformers' PretrainedConfig.num_labels: the key, else the size of id2label, else 2."""
    if config.get("num_labels") is not None:
        return int(config["num_labels"])
    return len(config["id2label"]) if config.get("id2label") else 2


def checkpoint_name(name: str, config: ModelArchConfig) -> Optional[str]:
    """A checkpoint tensor's name in the record's terms (`expected_weight_names`), or None for a tensor the
    model does not use: the `bert.` / `roberta.` prefix of task models dropped, old LayerNorm gamma/beta
    names renamed, buffers, masked-LM heads and a base model's pooler skipped."""
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix):]
            break
    if name.endswith(".gamma") or name.endswith(".beta"):
        name = name.rsplit(".", 1)[0] + (".weight" if name.endswith(".gamma") else ".bias")
    if _SKIPPED.match(name) or (name.startswith("pooler.") and config.classifier != "bert"):
        return None
    return name
