"""The architecture record every loader produces and every layer reads (GGUF and Hugging Face folders).

The engine builds its model from this one frozen record, so both sources must agree on field
meanings: they follow Hugging Face's configs. Which architectures exist, and the features each one
fixes, is vlite/models/registry.py's business; vlite/model_loader/hf_config.py and gguf_config.py turn
a config.json or a GGUF header into the record. This module imports nothing of vlite's, and no torch:
the layers and the API process read it.

What a family's layers are (norm placement, q/k norms, rotary, soft-capping, mixtures) is its model
file's code (vlite/models/<arch>.py); the flags below that name one family's structure (qk_norm,
sandwich_norms, post_norms, scale_embeddings, ...) are what the loaders need (expected_weight_names, the
GGUF names and conventions, tensor-parallel checks), and the values (caps, scales, bases) the model
files read.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

__all__ = ["ModelArchConfig", "LlamaArchConfig", "expected_weight_names", "ignored_weight_names"]

# the gate activations vlite.layers.mlp computes; "swiglu_oai": gpt-oss's clamped SwiGLU (swiglu_alpha, swiglu_limit)
_ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "swiglu_oai")
_ENCODER_ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh")  # vlite.layers.encoder.GELU_APPROXIMATIONS


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
    mlp_bias: bool = False  # bias on gate, up and down projections (mixtures: every expert's, and the router's)
    qk_norm: bool = False  # RMSNorm over each head of q and k before rotary (Qwen3, Gemma 3)
    qk_norm_full: bool = False  # with qk_norm: the norms span all heads of q and of k at once (OLMo 2)
    hidden_act: str = "silu"  # the MLP's gate activation: "silu", "gelu_pytorch_tanh" (Gemma), "swiglu_oai" (gpt-oss)
    # hidden_act "swiglu_oai": gate = min(gate, limit), up = clamp(up, -limit, limit),
    # act = (up + 1) * gate * sigmoid(alpha * gate) (transformers' GptOssExperts; llama.cpp's swiglu_oai)
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # One learned logit per query head (`self_attn.sinks`) that joins each softmax's denominator and adds no
    # value: p_j = exp(s_j) / (sum_k exp(s_k) + exp(sink)) (gpt-oss's attention sinks).
    attention_sinks: bool = False
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
    # The routing weights a softmax over the k chosen logits (gpt-oss), not the top k of a softmax over all
    # experts (the same values as renormalizing them, other rounding).
    router_topk_softmax: bool = False
    moe_layers: tuple[int, ...] = ()
    # The checkpoint's names of a mixture layer: `{prefix}.gate` (router), `{prefix}.experts.{e}.{gate,up,down}`.
    moe_prefix: str = "mlp"
    expert_names: tuple[str, ...] = ("gate_proj", "up_proj", "down_proj")
    # GGUF type of the linear layers' weights in the source file ("Q4_1", ...; "mixed"), None for
    # dense sources. The engine may keep such weights packed (vlite.layers.quantization).
    source_quantization: str | None = None
    # Encoders (BERT, RoBERTa, XLM-R; vlite.layers.encoder): bidirectional attention over each whole sequence,
    # no KV cache; LayerNorm after attention and after the MLP, its epsilon in rms_norm_eps.
    is_causal: bool = True
    type_vocab_size: int = 0  # rows of the token-type (segment) embedding; 0: none
    position_offset: int = 0  # added to each position before the position embedding (RoBERTa: padding_idx + 1)
    # A sequence-classification head: "" none; on an encoder's first token (cross-encoders) "bert" (pooler
    # dense + tanh, then classifier), "roberta" (classifier.dense + tanh, then classifier.out_proj); on a
    # decoder's last token "score" (one linear layer, no bias); num_labels outputs.
    classifier: str = ""
    num_labels: int = 0
    # Linear-attention hybrids (Qwen3.5, Qwen3-Next): the layers whose token mixer is a Gated DeltaNet
    # (vlite.layers.gated_deltanet) instead of attention. Such a layer keeps no KV cache but a fixed-size
    # recurrent state per request: a causal depthwise conv1d's last `linear_conv_kernel_dim - 1` inputs and a
    # [linear_num_value_heads, linear_key_head_dim, linear_value_head_dim] delta-rule state.
    linear_layers: tuple[int, ...] = ()
    linear_conv_kernel_dim: int = 0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    # Qwen3-Next's checkpoint fuses q, k, v, z (and b, a) per key-head group: in_proj_qkvz, in_proj_ba.
    linear_grouped_projections: bool = False
    # The attention's q_proj also yields a per-head gate: output = attention * sigmoid(gate) (Qwen3.5, Qwen3-Next).
    attn_output_gate: bool = False
    # Mixture layers with one always-on shared expert of this width, scaled by sigmoid(x @ shared_expert_gate)
    # (Qwen3.5-MoE, Qwen3-Next); 0: none.
    shared_expert_intermediate_size: int = 0
    # Gemma 4 (vlite/models/gemma4.py): full-attention layers with their own head size and KV heads (0: head_dim,
    # num_key_value_heads), their values the keys' projection (attention_k_eq_v); the last num_kv_shared_layers
    # layers project no K/V and read those of the last earlier layer of their kind (`kv_source`); per-layer input
    # embeddings of hidden_size_per_layer_input per layer (0: none) over vocab_size_per_layer_input tokens.
    global_head_dim: int = 0
    num_global_key_value_heads: int = 0
    attention_k_eq_v: bool = False
    num_kv_shared_layers: int = 0
    hidden_size_per_layer_input: int = 0
    vocab_size_per_layer_input: int = 0

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        activations = _ACTIVATIONS if self.is_causal else _ENCODER_ACTIVATIONS
        if self.hidden_act not in activations:
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r}; supported: {', '.join(activations)}")
        object.__setattr__(self, "layer_windows", tuple(int(w) for w in self.layer_windows))  # JSON gives a list
        object.__setattr__(self, "nope_layers", tuple(int(i) for i in self.nope_layers))
        object.__setattr__(self, "moe_layers", tuple(int(i) for i in self.moe_layers))
        object.__setattr__(self, "linear_layers", tuple(int(i) for i in self.linear_layers))
        if self.linear_layers:
            if not all(0 <= i < self.num_hidden_layers for i in self.linear_layers):
                raise ValueError(f"linear_layers {self.linear_layers} must be layer indices below "
                                 f"num_hidden_layers ({self.num_hidden_layers})")
            dims = {k: getattr(self, k) for k in ("linear_conv_kernel_dim", "linear_num_key_heads",
                                                  "linear_num_value_heads", "linear_key_head_dim",
                                                  "linear_value_head_dim")}
            if min(dims.values()) < 1 or self.linear_conv_kernel_dim < 2:
                raise ValueError(f"linear-attention layers need positive sizes, got {dims} (conv kernel >= 2)")
            if self.linear_num_value_heads % self.linear_num_key_heads:
                raise ValueError(f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                                 f"linear_num_key_heads ({self.linear_num_key_heads})")
        object.__setattr__(self, "expert_names", tuple(self.expert_names))
        if self.moe_layers and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be in 1..num_experts "
                             f"({self.num_experts})")
        if self.layer_windows and (len(self.layer_windows) != self.num_hidden_layers
                                   or min(self.layer_windows) < 0):
            raise ValueError(f"layer_windows {self.layer_windows} must give each of the "
                             f"{self.num_hidden_layers} layers a window >= 0")
        if self.num_kv_shared_layers:
            first = self.num_hidden_layers - self.num_kv_shared_layers
            kinds = {self.layer_window(i) for i in range(first)}
            if first < 1 or any(self.layer_window(i) not in kinds for i in range(first, self.num_hidden_layers)):
                raise ValueError(f"num_kv_shared_layers ({self.num_kv_shared_layers}): each of the last layers must "
                                 f"find an earlier layer of its kind (sliding or full) that projects K/V, among the "
                                 f"first {first} of {self.num_hidden_layers}")
        heads = self.num_global_key_value_heads
        if heads and self.num_attention_heads % heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_global_key_value_heads ({heads})")

    @property
    def rotary_dim(self) -> int:
        """How many leading dims of each head rotary rotates (transformers rounds down, as here)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def longest_context(self) -> int:
        """The longest max_model_len the model serves: max_position_embeddings, or for LongRoPE the context
        of its long factors (the checkpoint's max_position_embeddings; the default stays the original one)."""
        longest = int((self.rope_scaling or {}).get("long_max_position_embeddings", self.max_position_embeddings))
        return longest - self.position_offset  # RoBERTa's first position_offset rows are never used

    def with_max_model_len(self, max_model_len: int) -> ModelArchConfig:
        """The config an engine of `max_model_len` runs: itself, except that a LongRoPE model asked for more
        than its original context rotates every token with its long factors (`use_long_factor`), over
        max_model_len positions (see `vlite.layers.rope_scaling.longrope_scaling`)."""
        if max_model_len > self.longest_context:
            raise ValueError(f"max_model_len ({max_model_len}) exceeds the model's limit ({self.longest_context})")
        scaling = self.rope_scaling or {}
        if scaling.get("rope_type") != "longrope" or max_model_len <= self.max_position_embeddings:
            return self
        return replace(self, rope_scaling={**scaling, "use_long_factor": True}, max_position_embeddings=max_model_len)

    def layer_window(self, layer: int) -> int:
        """The sliding window of `layer` (0: it attends to every key before the query)."""
        return self.layer_windows[layer] if self.layer_windows else 0

    def layer_head_dim(self, layer: int) -> int:
        """The head size of `layer`: global_head_dim on a full-attention layer where the model has one."""
        return self.global_head_dim if self.global_head_dim and not self.layer_window(layer) else self.head_dim

    def layer_kv_heads(self, layer: int) -> int:
        """The KV heads of `layer`: num_global_key_value_heads on a full-attention layer where the model has them."""
        full = self.num_global_key_value_heads and not self.layer_window(layer)
        return self.num_global_key_value_heads if full else self.num_key_value_heads

    def kv_source(self, layer: int) -> int:
        """The layer whose K/V `layer` attends over: itself, or for the last num_kv_shared_layers layers (Gemma 4)
        the last layer before them of the same kind (window), as transformers' kv_sharing_modes picks it."""
        first = self.num_hidden_layers - self.num_kv_shared_layers
        if layer < first:
            return layer
        window = self.layer_window(layer)
        return next(i for i in range(first - 1, -1, -1) if self.layer_window(i) == window)

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The attention layers that write a KV cache of their own (not the KV-shared ones)."""
        return tuple(i for i in self.attention_layers if self.kv_source(i) == i)

    @property
    def attention_windows(self) -> tuple[int, ...]:
        """The distinct windows of the model's layers, ascending (0 first where some layer is global)."""
        return tuple(sorted({self.layer_window(i) for i in range(self.num_hidden_layers)}))

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers that attend over a KV cache (all but the linear-attention ones)."""
        linear = set(self.linear_layers)
        return tuple(i for i in range(self.num_hidden_layers) if i not in linear)

    @property
    def linear_conv_dim(self) -> int:
        """Channels of a linear-attention layer's conv1d: its q, k (key heads) and v (value heads) together."""
        return (2 * self.linear_num_key_heads * self.linear_key_head_dim
                + self.linear_num_value_heads * self.linear_value_head_dim)

    @property
    def kv_sliding_window(self) -> int | None:
        """Where every layer slides: the largest window, behind which KV blocks are never read again (the
        KV cache manager frees them). None where some layer attends globally and reads every block."""
        windows = tuple(sorted({self.layer_window(i) for i in self.attention_layers}))
        return windows[-1] if windows and windows[0] > 0 else None


# The name most of the code base knew it by, from when Llama was the only family.
LlamaArchConfig = ModelArchConfig


def expected_weight_names(config: ModelArchConfig) -> set[str]:
    """Every tensor the model of ``config`` needs, Hugging Face naming (what both loaders produce)."""
    if not config.is_causal:
        return _encoder_weight_names(config)
    if config.architecture == "gemma4":
        return _gemma4_weight_names(config)
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if config.classifier == "score":  # XForSequenceClassification: a score head in place of the LM head
        names.add("score.weight")
    elif not config.tie_word_embeddings:
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
        if i in config.linear_layers:  # a Gated DeltaNet instead of attention
            names |= _linear_attention_names(config, f"{p}linear_attn.")
            attn_projs = ()
        if config.attention_sinks and attn_projs:
            names.add(f"{p}self_attn.sinks")
        for proj in attn_projs:
            names.add(f"{p}self_attn.{proj}.weight")
            if config.attention_out_bias if proj == "o_proj" else config.attention_bias:
                names.add(f"{p}self_attn.{proj}.bias")
        if config.qk_norm and attn_projs:
            names |= {f"{p}self_attn.q_norm.weight", f"{p}self_attn.k_norm.weight"}
        if i in config.moe_layers:  # the router and every expert's gated MLP instead of one dense MLP
            m = f"{p}{config.moe_prefix}."
            names.add(m + "gate.weight")
            if config.mlp_bias:  # the router's bias and every expert's (gpt-oss)
                names.add(m + "gate.bias")
                names |= {f"{m}experts.{e}.{n}.bias" for e in range(config.num_experts) for n in config.expert_names}
            if config.shared_expert_intermediate_size:
                names |= {f"{m}shared_expert.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")}
                names.add(f"{m}shared_expert_gate.weight")
            names |= {f"{m}experts.{e}.{n}.weight" for e in range(config.num_experts) for n in config.expert_names}
            continue
        for proj in ("gate_up_proj", "down_proj") if config.fused_checkpoint else ("gate_proj", "up_proj", "down_proj"):
            names.add(f"{p}mlp.{proj}.weight")
            if config.mlp_bias:
                names.add(f"{p}mlp.{proj}.bias")
    return names


def ignored_weight_names(config: ModelArchConfig) -> set[str]:
    """Tensors a checkpoint may hold that the model does not use (skipped at load, as transformers skips them): the
    k/v projections and norms of Gemma 4's KV-shared layers."""
    return {f"model.layers.{i}.self_attn.{n}.weight" for i in config.attention_layers if config.kv_source(i) != i
            for n in ("k_proj", "v_proj", "k_norm", "v_norm")}


def _gemma4_weight_names(config: ModelArchConfig) -> set[str]:
    """Gemma 4's tensors (transformers' Gemma4ForCausalLM names): per layer four norms, a scalar, q (and k, v where
    the layer projects its own K/V; k alone where values are keys), the dense MLP beside the optional mixture
    (router, experts stacked [E, ...] as transformers stores them, three more norms) and the per-layer input's
    gate, projection and norm."""
    names = {"model.embed_tokens.weight", "model.norm.weight"} | (set() if config.tie_word_embeddings
                                                                  else {"lm_head.weight"})
    if config.hidden_size_per_layer_input:
        names |= {f"model.{n}.weight" for n in ("embed_tokens_per_layer", "per_layer_model_projection",
                                                 "per_layer_projection_norm")}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        names |= {f"{p}{n}.weight" for n in ("input_layernorm", "post_attention_layernorm",
                                              "pre_feedforward_layernorm", "post_feedforward_layernorm",
                                              "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
                                              "self_attn.q_proj", "self_attn.q_norm", "self_attn.o_proj")}
        names.add(p + "layer_scalar")
        if config.kv_source(i) == i:
            names |= {f"{p}self_attn.k_proj.weight", f"{p}self_attn.k_norm.weight"}
            if not (config.attention_k_eq_v and not config.layer_window(i)):
                names.add(f"{p}self_attn.v_proj.weight")
        if config.hidden_size_per_layer_input:
            names |= {f"{p}{n}.weight" for n in ("per_layer_input_gate", "per_layer_projection",
                                                  "post_per_layer_input_norm")}
        if i in config.moe_layers:
            names |= {f"{p}router.proj.weight", f"{p}router.scale", f"{p}router.per_expert_scale",
                      f"{p}experts.gate_up_proj", f"{p}experts.down_proj"}
            names |= {f"{p}{n}.weight" for n in ("post_feedforward_layernorm_1", "post_feedforward_layernorm_2",
                                                  "pre_feedforward_layernorm_2")}
    return names


def _linear_attention_names(config: ModelArchConfig, p: str) -> set[str]:
    """A Gated DeltaNet layer's tensors (Qwen3.5's names; Qwen3-Next fuses the input projections per group)."""
    projections = ("in_proj_qkvz", "in_proj_ba") if config.linear_grouped_projections else (
        "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
    return ({f"{p}{n}.weight" for n in (*projections, "conv1d", "norm", "out_proj")}
            | {f"{p}A_log", f"{p}dt_bias"})


def _encoder_weight_names(config: ModelArchConfig) -> set[str]:
    """An encoder's tensors, as BertModel / RobertaModel name them without their `bert.` / `roberta.` prefix
    (vlite.model_loader.encoder_config.checkpoint_name strips it)."""
    names = {f"embeddings.{e}.weight" for e in ("word_embeddings", "position_embeddings")}
    names |= {"embeddings.LayerNorm.weight", "embeddings.LayerNorm.bias"}
    if config.type_vocab_size:
        names.add("embeddings.token_type_embeddings.weight")
    for i in range(config.num_hidden_layers):
        p = f"encoder.layer.{i}."
        for m in ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense",
                  "attention.output.LayerNorm", "intermediate.dense", "output.dense", "output.LayerNorm"):
            names |= {f"{p}{m}.weight", f"{p}{m}.bias"}
    heads = {"": (), "bert": ("pooler.dense", "classifier"), "roberta": ("classifier.dense", "classifier.out_proj")}
    return names | {f"{m}.{w}" for m in heads[config.classifier] for w in ("weight", "bias")}
