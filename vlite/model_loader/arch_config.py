"""Architecture description shared by every loader (GGUF and Hugging Face folders).

The engine builds its model from this one frozen record, so both sources must agree on field
meanings: they follow Hugging Face's configs. Which architectures exist, and the features each one
fixes, is vlite/models/registry.py's business; this module turns a config.json or a GGUF header
into the record.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from vlite.models.registry import (SUPPORTED_GGUF_ARCHITECTURES, SUPPORTED_HF_ARCHITECTURES, ModelSpec, spec_for,
                                   spec_for_gguf, spec_for_hf)

__all__ = ["ModelArchConfig", "LlamaArchConfig", "SUPPORTED_HF_ARCHITECTURES", "SUPPORTED_GGUF_ARCHITECTURES",
           "expected_weight_names"]

# llama3 rope parameters used when a GGUF file only stores the precomputed factors
# and no original context length; any value gives the same frequencies once the
# low/high factors are fitted to it.
_DEFAULT_LLAMA3_ORIGINAL_CONTEXT = 8192


@dataclass(frozen=True)
class ModelArchConfig:
    """Shape, numerics and optional features of a decoder-only model, in Hugging Face terms."""

    architecture: str  # vlite's family name (registry.ModelSpec.name): "llama", "mistral", "qwen2", "gemma3", ...
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    attention_bias: bool = False  # bias on the q, k and v projections
    attention_out_bias: bool = False  # bias on o_proj (Llama's attention_bias sets both; Qwen2 has q/k/v only)
    mlp_bias: bool = False  # bias on gate, up and down projections
    qk_norm: bool = False  # RMSNorm over each head of q and k before rotary (Qwen3, Gemma 3)
    qk_norm_full: bool = False  # with qk_norm: the norms span all heads of q and of k at once (OLMo 2)
    hidden_act: str = "silu"  # the MLP's gate activation: "silu" or "gelu_pytorch_tanh" (Gemma)
    norm_unit_offset: bool = False  # RMSNorm scales by (1 + weight) (Gemma; the checkpoint stores weight)
    sandwich_norms: bool = False  # norms after attention and after the MLP too: 4 a layer (Gemma 2/3)
    post_norms: bool = False  # norms only after attention and after the MLP, none before (OLMo 2)
    scale_embeddings: bool = False  # embeddings times sqrt(hidden_size), in the model's dtype (Gemma)
    # Per layer, the keys a query sees: 0 = every one before it, w > 0 = its last w (sliding window).
    # Empty: every layer global.
    layer_windows: tuple[int, ...] = ()
    nope_layers: tuple[int, ...] = ()  # layers that apply no rotary at all (SmolLM3's NoPE layers)
    rope_local_theta: float | None = None  # rope base of sliding layers, unscaled (Gemma 3); None: rope_theta
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (Gemma); None: head_dim
    attn_logit_softcapping: float | None = None  # attention scores = cap * tanh(scores / cap) (Gemma 2)
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap) (Gemma 2, some Gemma 3)
    # Share of each head's dims that rotary rotates (the leading ones; Phi-4-mini: 0.75); the rest pass as is.
    partial_rotary_factor: float = 1.0
    # The checkpoint stores q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj` (Phi-3).
    fused_checkpoint: bool = False
    # Mixture of experts (Qwen3-MoE, OLMoE, Mixtral): on each of `moe_layers` a router sends every token to
    # num_experts_per_tok of num_experts gated MLPs of width moe_intermediate_size; the other layers keep a
    # dense MLP of intermediate_size. num_experts 0: a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # the top-k routing weights renormalized to sum to 1 (Mixtral: always)
    moe_layers: tuple[int, ...] = ()
    # The checkpoint's names of a mixture layer: `{prefix}.gate` (router), `{prefix}.experts.{e}.{gate,up,down}`.
    moe_prefix: str = "mlp"
    expert_names: tuple[str, ...] = ("gate_proj", "up_proj", "down_proj")
    # GGUF type of the linear layers' weights in the source file ("Q4_1", ...; "mixed"), None for
    # dense sources. The engine may keep such weights packed (vlite.layers.quantization).
    source_quantization: str | None = None

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r}; supported: {', '.join(_ACTIVATIONS)}")
        object.__setattr__(self, "layer_windows", tuple(int(w) for w in self.layer_windows))  # JSON gives a list
        object.__setattr__(self, "nope_layers", tuple(int(i) for i in self.nope_layers))
        object.__setattr__(self, "moe_layers", tuple(int(i) for i in self.moe_layers))
        object.__setattr__(self, "expert_names", tuple(self.expert_names))
        if self.moe_layers and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be in 1..num_experts "
                             f"({self.num_experts})")
        if self.layer_windows and (len(self.layer_windows) != self.num_hidden_layers
                                   or min(self.layer_windows) < 0):
            raise ValueError(f"layer_windows {self.layer_windows} must give each of the "
                             f"{self.num_hidden_layers} layers a window >= 0")

    @property
    def spec(self) -> ModelSpec:
        return spec_for(self.architecture)

    @property
    def rotary_dim(self) -> int:
        """How many leading dims of each head rotary rotates (transformers rounds down, as here)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def longest_context(self) -> int:
        """The longest max_model_len the model serves: max_position_embeddings, or for LongRoPE the context
        of its long factors (the checkpoint's max_position_embeddings; the default stays the original one)."""
        return int((self.rope_scaling or {}).get("long_max_position_embeddings", self.max_position_embeddings))

    def with_max_model_len(self, max_model_len: int) -> ModelArchConfig:
        """The config an engine of `max_model_len` runs: itself, except that a LongRoPE model asked for more
        than its original context rotates every token with its long factors (`use_long_factor`), over
        max_model_len positions (see `_longrope`)."""
        if max_model_len > self.longest_context:
            raise ValueError(f"max_model_len ({max_model_len}) exceeds the model's limit ({self.longest_context})")
        scaling = self.rope_scaling or {}
        if scaling.get("rope_type") != "longrope" or max_model_len <= self.max_position_embeddings:
            return self
        return replace(self, rope_scaling={**scaling, "use_long_factor": True}, max_position_embeddings=max_model_len)

    def layer_window(self, layer: int) -> int:
        """The sliding window of `layer` (0: it attends to every key before the query)."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def attention_windows(self) -> tuple[int, ...]:
        """The distinct windows of the model's layers, ascending (0 first where some layer is global)."""
        return tuple(sorted({self.layer_window(i) for i in range(self.num_hidden_layers)}))

    @property
    def kv_sliding_window(self) -> int | None:
        """Where every layer slides: the largest window, behind which KV blocks are never read again (the
        KV cache manager frees them). None where some layer attends globally and reads every block."""
        windows = self.attention_windows
        return windows[-1] if windows and windows[0] > 0 else None

    # ------------------------------------------------------------------ HF
    @classmethod
    def from_hf_config(
        cls, config: dict[str, Any], generation_config: dict[str, Any] | None = None
    ) -> ModelArchConfig:
        """Build from a parsed ``config.json`` (and optionally ``generation_config.json``).

        Handles both the classic ``rope_theta``/``rope_scaling`` keys and the newer
        ``rope_parameters`` dict written by transformers 5.
        """
        spec = _hf_spec(config)
        if config.get("use_bidirectional_attention"):
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
        if rope_type not in _ROPE_TYPES:  # refused with the config, not later when the model is built
            raise ValueError(f"rope scaling {rope_type!r} is not supported yet; vlite supports: "
                             f"{', '.join(_ROPE_TYPES)}")
        max_positions = int(config.get("max_position_embeddings", 2048))
        if rope_type == "longrope":
            rope_scaling, max_positions = _longrope(config, rope_scaling, max_positions)

        eos: list[int] = []
        _extend_ids(eos, config.get("eos_token_id"))
        if generation_config:
            _extend_ids(eos, generation_config.get("eos_token_id"))
        bos = config.get("bos_token_id")
        if bos is None and generation_config:
            bos = generation_config.get("bos_token_id")

        bias = bool(config.get("attention_bias", False))  # Llama/Qwen3: q, k, v and o alike
        optional = {"rope_local_theta": rope_local_theta,
                    **{k: _float_or_none(config.get(k)) for k in (
                        "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping")},
                    # transformers 5 writes it into rope_parameters, 4 at the top level
                    "partial_rotary_factor": _float_or_none(config.get("partial_rotary_factor") or (
                        config.get("rope_parameters") or {}).get("partial_rotary_factor"))}
        features = {**spec.defaults, **{k: v for k, v in optional.items() if v is not None},
                    "attention_bias": bias, "attention_out_bias": bias,
                    "mlp_bias": bool(config.get("mlp_bias", False)),
                    # Gemma names its activation hidden_activation (older configs carry both keys)
                    "hidden_act": config.get("hidden_activation") or config.get("hidden_act") or "silu",
                    **_hf_moe(config), **spec.features}
        return cls(
            architecture=spec.name,
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
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

    # ---------------------------------------------------------------- GGUF
    @classmethod
    def from_gguf_metadata(cls, reader: Any) -> ModelArchConfig:
        """Build from a GGUF header (`gguf_reader.GGUFReader`: metadata plus the optional ``rope_freqs`` tensor)."""
        arch = _field(reader, "general.architecture")
        spec = spec_for_gguf(arch)

        def key(name: str, default: Any = None) -> Any:
            return _field(reader, f"{arch}.{name}", default)

        if key("expert_count") and arch == "llama":  # llama.cpp writes Mixtral as "llama" with expert tensors
            spec = spec_for("mixtral")
        hidden = int(key("embedding_length"))
        n_heads = int(key("attention.head_count"))
        n_kv = int(key("attention.head_count_kv", n_heads))
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
        elif "rope_factors_short.weight" in tensor_names:  # Phi-3 LongRoPE: both factor lists as tensors
            from gguf.quants import dequantize

            factors = {f"{k}_factor": [float(f) for f in dequantize(t.data, t.tensor_type).reshape(-1)]
                       for k in ("short", "long") for t in [tensor_names[f"rope_factors_{k}.weight"]]}
            attention = key("rope.scaling.attn_factor")
            rope_scaling, max_pos = _longrope(
                {"original_max_position_embeddings": key("rope.scaling.original_context_length")},
                {"rope_type": "longrope", **factors,
                 **({} if attention is None else {"attention_factor": float(attention)})}, max_pos)
        elif "rope_freqs.weight" in tensor_names:
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
            _extend_ids(eos, _field(reader, f"tokenizer.ggml.{k}"))
        if spec.gguf_end_of_turn and _field(reader, "tokenizer.ggml.eot_token_id") is None:
            _extend_ids(eos, _gguf_token_ids(reader, spec.gguf_end_of_turn))
        bos = _field(reader, "tokenizer.ggml.bos_token_id")

        n_layers = int(key("block_count"))
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
        features.update(_gguf_moe(spec, key, tensor_names, n_layers))
        return cls(
            architecture=spec.name,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(key("feed_forward_length") or key("expert_feed_forward_length")),
            num_hidden_layers=n_layers,
            num_attention_heads=n_heads,
            num_key_value_heads=n_kv,
            head_dim=head_dim,
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings="output.weight" not in tensor_names,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=tuple(eos),
            layer_windows=layer_windows,
            nope_layers=tuple(i for i in range(n_layers) if nope_every and (i + 1) % nope_every == 0),
            **features,
        )


# The name most of the code base knew it by, from when Llama was the only family.
LlamaArchConfig = ModelArchConfig


def expected_weight_names(config: ModelArchConfig) -> set[str]:
    """Every tensor the model of ``config`` needs, Hugging Face naming (what both loaders produce)."""
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not config.tie_word_embeddings:
        names.add("lm_head.weight")
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        names.add(p + "post_attention_layernorm.weight")
        if config.post_norms:
            names.add(p + "post_feedforward_layernorm.weight")
        else:
            names.add(p + "input_layernorm.weight")
        if config.sandwich_norms:
            names |= {p + "pre_feedforward_layernorm.weight", p + "post_feedforward_layernorm.weight"}
        attn_projs = ("qkv_proj", "o_proj") if config.fused_checkpoint else ("q_proj", "k_proj", "v_proj", "o_proj")
        for proj in attn_projs:
            names.add(f"{p}self_attn.{proj}.weight")
            if config.attention_out_bias if proj == "o_proj" else config.attention_bias:
                names.add(f"{p}self_attn.{proj}.bias")
        if config.qk_norm:
            names |= {f"{p}self_attn.q_norm.weight", f"{p}self_attn.k_norm.weight"}
        if i in config.moe_layers:  # the router and every expert's gated MLP instead of one dense MLP
            m = f"{p}{config.moe_prefix}."
            names.add(m + "gate.weight")
            names |= {f"{m}experts.{e}.{n}.weight" for e in range(config.num_experts) for n in config.expert_names}
            continue
        for proj in ("gate_up_proj", "down_proj") if config.fused_checkpoint else ("gate_proj", "up_proj", "down_proj"):
            names.add(f"{p}mlp.{proj}.weight")
            if config.mlp_bias:
                names.add(f"{p}mlp.{proj}.bias")
    return names


# ---------------------------------------------------------------------- helpers
# llama.cpp scales Gemma's queries by head_dim ** -0.5 (GGUF stores no query_pre_attn_scalar), but by
# (hidden / heads) ** -0.5 for the one checkpoint of each family whose query_pre_attn_scalar is that,
# recognised by its layer count: Gemma 2 27B (46 layers), Gemma 3 27B (62).
_GGUF_GEMMA_HIDDEN_QUERY_SCALE = {"gemma2": 46, "gemma3": 62}
# What llama.cpp assumes where a family's GGUF file leaves a key out (Gemma 2 files converted before the
# converter wrote them: the window of 4096 and the soft-caps 50 and 30 of every Gemma 2 checkpoint).
_GGUF_UNSAID: dict[str, dict[str, Any]] = {
    "gemma2": {"sliding_window": 4096, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}}


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


_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
_ROPE_TYPES = ("default", "linear", "llama3", "longrope")  # what vlite.layers.rotary_embedding computes


def _longrope(config: dict[str, Any], scaling: dict[str, Any], max_positions: int
              ) -> tuple[dict[str, Any], int]:
    """LongRoPE (Phi-3 128k, Phi-4-mini): the scaling, with the checkpoint's full context as
    `long_max_position_embeddings`, and the default context: original_max_position_embeddings.

    Which factors rotate is fixed per engine, by its max_model_len (`ModelArchConfig.with_max_model_len`):
    within the original context (the default) the short factors; asked for more (max_model_len up
    to max_position_embeddings), the long factors for every token of every request, short prompts too.
    That is vLLM's rule (Phi3LongRoPEScaledRotaryEmbedding: use_long_rope = max_model_len >
    original_max_position_embeddings, "to prevent KV cache invalidation when sequences cross this
    threshold"), though vLLM's default max_model_len is the full context. transformers instead switches
    per forward call (dynamic_rope_update: the long factors when the call's largest position reaches the
    original context): a prompt longer than it, prefilled in one call, and all it generates use the long
    factors, the same as here; but a sequence that grows past the original context keeps the keys it
    cached with the short factors and rotates the new ones with the long, and a shorter prompt gets the
    short factors. A per-call switch would make a request's rotation depend on the batch it shares a
    step with and the cached keys disagree with the new ones, so vlite chooses once, by max_model_len.

    The attention factor (cos and sin scaled by it) comes from the full context, as transformers derives
    it, for both factor sets."""
    orig = scaling.get("original_max_position_embeddings") or config.get("original_max_position_embeddings")
    if not orig:
        raise ValueError("longrope rope scaling needs original_max_position_embeddings")
    orig = int(orig)
    factor = float(scaling.get("factor") or max_positions / orig)
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    scaling = {**scaling, "original_max_position_embeddings": orig, "attention_factor": float(attention),
               "long_max_position_embeddings": max(max_positions, orig)}
    return scaling, min(max_positions, orig)


def _hf_moe(config: dict[str, Any]) -> dict[str, Any]:
    """The mixture-of-experts fields of a config.json ({} for a dense model). Qwen3-MoE keeps a dense MLP
    on its `mlp_only_layers` and on layers i with (i + 1) % decoder_sparse_step != 0, as transformers does;
    Mixtral and OLMoE name no such keys (every layer a mixture) and size experts by intermediate_size."""
    n_experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    if not n_experts:
        return {}
    n_layers, step = int(config["num_hidden_layers"]), int(config.get("decoder_sparse_step") or 1)
    dense = set(config.get("mlp_only_layers") or ())
    return {"num_experts": n_experts, "num_experts_per_tok": int(config["num_experts_per_tok"]),
            "moe_intermediate_size": int(config.get("moe_intermediate_size") or config["intermediate_size"]),
            "norm_topk_prob": bool(config.get("norm_topk_prob", False)),
            "moe_layers": tuple(i for i in range(n_layers) if i not in dense and (i + 1) % step == 0)}


def _gguf_moe(spec: ModelSpec, key: Any, tensor_names: dict[str, Any], n_layers: int) -> dict[str, Any]:
    """The mixture-of-experts fields of a GGUF file ({} for a dense model). The mixture layers are those
    with a router tensor (ffn_gate_inp): files of models with dense layers among them (Qwen3-MoE's
    mlp_only_layers) hold plain ffn_* tensors there. Families vlite runs only densely, and shared experts,
    are refused by name."""
    n_experts = int(key("expert_count") or 0)
    if not n_experts:
        return {}
    if spec.name not in ("qwen3_moe", "mixtral"):
        raise ValueError(f"{spec.gguf_name or spec.name} GGUF files with experts (mixtures of experts) are not "
                         f"supported; GGUF mixtures vlite reads: qwen3moe, llama (Mixtral)")
    if key("expert_shared_count"):
        raise ValueError(f"GGUF file with shared experts (expert_shared_count={key('expert_shared_count')}): "
                         f"not supported")
    norm = key("expert_weights_norm")
    return {"num_experts": n_experts, "num_experts_per_tok": int(key("expert_used_count")),
            "moe_intermediate_size": int(key("expert_feed_forward_length") or key("feed_forward_length")),
            "norm_topk_prob": bool(spec.features.get("norm_topk_prob", spec.defaults.get("norm_topk_prob", False))
                                   if norm is None else norm),
            "moe_layers": tuple(i for i in range(n_layers) if f"blk.{i}.ffn_gate_inp.weight" in tensor_names)}


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


def _extend_ids(out: list[int], value: Any) -> None:
    """Append an int or list of ints to ``out``, keeping order and skipping duplicates."""
    if value is None:
        return
    values = value if isinstance(value, (list, tuple)) else [value]
    for v in values:
        if v is not None and int(v) not in out:
            out.append(int(v))


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
        scaling.pop("partial_rotary_factor", None)  # not a scaling: ModelArchConfig.partial_rotary_factor
        if scaling.get("rope_type", "default") == "default":
            scaling = None
    return float(theta), scaling or None, _float_or_none(local_theta)


def llama3_factors(theta: float, head_dim: int, scaling: dict[str, Any]) -> np.ndarray:
    """Per-frequency divisors that llama3 rope scaling applies (llama.cpp's ``rope_freqs``)."""
    factor = float(scaling["factor"])
    low = float(scaling["low_freq_factor"])
    high = float(scaling["high_freq_factor"])
    orig = float(scaling["original_max_position_embeddings"])
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    smooth = (orig / wavelen - low) / (high - low)
    out = 1.0 / ((1 - smooth) / factor + smooth)
    out = np.where(wavelen < orig / high, 1.0, out)
    out = np.where(wavelen > orig / low, factor, out)
    return out


def llama3_rope_from_factors(
    factors: np.ndarray, theta: float, head_dim: int, original_context: int
) -> dict[str, Any] | None:
    """Recover an HF ``llama3`` rope_scaling dict from llama.cpp's stored divisors.

    Only the ratios low/high to the original context are identifiable, so the
    original context is fixed and the two factors are fitted to the transition
    band; the result is checked to reproduce the stored divisors.
    """
    factors = np.asarray(factors, dtype=np.float64)
    factor = float(factors.max())
    if factor <= 1.0 + 1e-6:
        return None
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if len(inv_freq) != len(factors):
        raise ValueError(f"rope_freqs has {len(factors)} entries, expected {len(inv_freq)}")
    x = original_context * inv_freq / (2 * math.pi)  # = orig / wavelen, decreasing
    is_one = np.abs(factors - 1.0) < 1e-4
    is_max = np.abs(factors - factor) < 1e-4 * factor
    mid = ~(is_one | is_max)
    if mid.sum() >= 2:
        # smooth = (x - low) / (high - low) is linear in x: fit it.
        smooth = (1.0 / factors[mid] - 1.0 / factor) / (1.0 - 1.0 / factor)
        slope, intercept = np.polyfit(x[mid], smooth, 1)
        low = -intercept / slope
        high = low + 1.0 / slope
    else:
        # No usable transition band: put the thresholds between the neighbours.
        hi_x = x[is_one].min() if is_one.any() else x.max() * 2
        lo_x = x[is_max].max() if is_max.any() else x.min() / 2
        high = float(np.sqrt(hi_x * max(x[~is_one].max() if (~is_one).any() else hi_x / 2, 1e-30)))
        low = float(np.sqrt(lo_x * max(x[~is_max].min() if (~is_max).any() else lo_x * 2, 1e-30)))
    scaling = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": float(low),
        "high_freq_factor": float(high),
        "original_max_position_embeddings": int(original_context),
    }
    if not np.allclose(llama3_factors(theta, head_dim, scaling), factors, rtol=1e-3, atol=1e-3):
        raise ValueError("could not express the GGUF rope_freqs tensor as llama3 rope scaling")
    return scaling
