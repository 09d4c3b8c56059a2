"""Which model class runs which checkpoint: architecture name -> vlite model.

A Hugging Face folder names its architecture in ``config.json`` (``architectures[0]``), a GGUF
file in ``general.architecture``; both resolve here to one `ModelSpec`. The spec also holds the
facts about an architecture that its config file leaves implicit (Qwen2's q/k/v biases are not in
its config.json; Qwen3 always has q/k norms), so both loaders derive the same `ModelArchConfig`.

This module imports no torch: the API server process parses configs too and must stay light.
Model classes are imported on first use (``model_class``).

Adding a dense model: a file in vlite/models/, one entry in `_SPECS`, one parity test in
tests/models/.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ModelSpec:
    """One architecture vlite runs, under every name it goes by."""

    name: str  # vlite's name for the family (ModelArchConfig.architecture); its GGUF name where it has one
    hf_architectures: tuple[str, ...]  # config.json `architectures[0]` values
    model: str  # "module:Class", imported on first use
    gguf: bool = True  # GGUF files with general.architecture == name are read
    # llama.cpp's converter reorders Llama's Q/K rows for ggml's interleaved ("normal") rotary; NEOX-rotary
    # models (Qwen) are stored in Hugging Face order.
    gguf_qk_permuted: bool = False
    # ModelArchConfig fields the architecture fixes whatever its config.json says (or leaves out).
    features: dict[str, Any] = field(default_factory=dict)
    # ModelArchConfig fields for what a source may leave unsaid (transformers' defaults; GGUF files store
    # no local rope base).
    defaults: dict[str, Any] = field(default_factory=dict)
    # Sliding-window attention: None = not supported (a config asking for it is refused); 0 = every
    # layer slides (Mistral); n > 0 = every n-th layer attends globally and the others slide, where the
    # config lists no `layer_types` (Gemma 2: 2, Gemma 3: 6, also llama.cpp's fixed pattern for GGUF).
    sliding_global_every: int | None = None
    # GGUF per-layer tensor names that differ from the common ones (gguf_loader._LAYER_NAMES).
    gguf_layer_names: dict[str, str] = field(default_factory=dict)
    # GGUF: texts of the tokens that end a turn though the file names no id for them (Gemma's <end_of_turn>,
    # an EOS id in generation_config.json that llama.cpp finds by its text); every one stops generation.
    gguf_end_of_turn: tuple[str, ...] = ()
    # GGUF: llama.cpp's fixed NoPE pattern (files store none): every n-th layer applies no rotary (SmolLM3: 4).
    gguf_nope_every: int = 0
    # GGUF: the file's general.architecture where llama.cpp names the family differently ("qwen3moe").
    gguf_name: str = ""
    # GGUF: Gated DeltaNet layers among the attention layers, their tensors and metadata as llama.cpp writes them
    # (vlite/model_loader/gguf_hybrid.py); "tiled": their value heads in ggml's broadcast order (Qwen3.5), "hf":
    # in the checkpoint's order (Qwen3-Next).
    gguf_linear_attention: str = ""
    # Hugging Face checkpoints: "module:function" turning the stored (name, tensor) pairs into the names and
    # layout vlite's loaders share (gpt-oss: experts stacked in 3-D tensors, possibly MXFP4 blocks); "" none.
    hf_tensor_transform: str = ""
    # Hugging Face checkpoints: stored-name prefixes renamed (a multimodal checkpoint's text model,
    # "model.language_model." -> "model.") and prefixes of tensors the text model does not use (its vision
    # tower, multi-token-prediction layers), skipped.
    hf_renames: tuple[tuple[str, str], ...] = ()
    hf_skipped: tuple[str, ...] = ()


# Gemma 2/3: four norms a layer, and GGUF names them differently from Llama ("ffn_norm" is Gemma's
# pre-feedforward norm, not Llama's post-attention one).
_GEMMA_GGUF_NAMES = {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
                     "post_ffw_norm": "post_feedforward_layernorm"}
# Gemma 4's beside them: the mixture's norms and router, the per-layer input's gate, projection and norm.
_GEMMA4_GGUF_NAMES = {**_GEMMA_GGUF_NAMES, "pre_ffw_norm_2": "pre_feedforward_layernorm_2",
                      "post_ffw_norm_1": "post_feedforward_layernorm_1",
                      "post_ffw_norm_2": "post_feedforward_layernorm_2",
                      "inp_gate": "per_layer_input_gate", "proj": "per_layer_projection",
                      "post_norm": "post_per_layer_input_norm", "ffn_gate_inp": "router.proj"}
_GEMMA = {"hidden_act": "gelu_pytorch_tanh", "norm_unit_offset": True, "sandwich_norms": True,
          "scale_embeddings": True}

# Qwen3.5 / Qwen3-Next: Gated DeltaNet layers (three of four) between gated full-attention layers, every
# RMSNorm but the DeltaNet's gated one scaling by (1 + weight), per-head q/k norms, a quarter of each head rotated.
_QWEN3_5 = {"qk_norm": True, "norm_unit_offset": True, "attn_output_gate": True, "mlp_bias": False}
_QWEN3_5_TEXT = dict(hf_renames=(("model.language_model.", "model."),), hf_skipped=("model.visual.", "mtp."))
# Their GGUF names beside the common ones: the pre-MLP norm, the shared expert (the DeltaNet's: gguf_hybrid.py).
_QWEN3_5_GGUF_NAMES = {"post_attention_norm": "post_attention_layernorm",
                       "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
                       "ffn_down_shexp": "mlp.shared_expert.down_proj", "ffn_gate_inp_shexp": "mlp.shared_expert_gate"}

_ENCODER = {"is_causal": False}
_ROBERTA = {**_ENCODER, "roberta_positions": True}  # position ids from padding_idx + 1 (encoder_config)

_SPECS = (
    ModelSpec("llama", ("LlamaForCausalLM",), "vlite.models.llama:LlamaForCausalLM", gguf_qk_permuted=True),
    # Mistral is Llama with a sliding window on every layer (or none); llama.cpp writes its GGUF files as "llama".
    ModelSpec("mistral", ("MistralForCausalLM",), "vlite.models.llama:LlamaForCausalLM", gguf=False,
              sliding_global_every=0),
    ModelSpec("qwen2", ("Qwen2ForCausalLM",), "vlite.models.qwen2:Qwen2ForCausalLM",
              features={"attention_bias": True, "attention_out_bias": False, "mlp_bias": False}),
    ModelSpec("qwen3", ("Qwen3ForCausalLM",), "vlite.models.qwen3:Qwen3ForCausalLM",
              features={"qk_norm": True, "mlp_bias": False}),
    # Phi-3 / Phi-4-mini: fused qkv_proj and gate_up_proj in the checkpoint; Phi-3-mini-4k slides every layer.
    # GGUF keeps them fused too (attn_qkv; ffn_up holds gate and up), LongRoPE factors as rope_factors_* tensors.
    ModelSpec("phi3", ("Phi3ForCausalLM",), "vlite.models.phi3:Phi3ForCausalLM",
              features={"fused_checkpoint": True}, sliding_global_every=0,
              gguf_layer_names={"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}),
    # OLMo 2: norms after attention and MLP only; q/k norms over the whole projections.
    ModelSpec("olmo2", ("Olmo2ForCausalLM",), "vlite.models.olmo2:Olmo2ForCausalLM",
              features={"qk_norm": True, "qk_norm_full": True, "post_norms": True},
              gguf_layer_names={"post_attention_norm": "post_attention_layernorm",
                                "post_ffw_norm": "post_feedforward_layernorm"}),
    # SmolLM3: Llama's layers, some without rotary (config.json's no_rope_layers).
    # llama.cpp writes it as Llama (Q/K rows in interleaved-rotary order), the NoPE layers fixed: every fourth.
    ModelSpec("smollm3", ("SmolLM3ForCausalLM",), "vlite.models.smollm3:SmolLM3ForCausalLM", gguf_qk_permuted=True,
              gguf_nope_every=4),
    # Mixtures of experts (vlite.layers.moe): Qwen3's layers, OLMo 2's whole-projection q/k norms before
    # (not after) the blocks, Llama's layers with Mixtral's checkpoint names (always renormalized top-k).
    # GGUF (llama.cpp's "qwen3moe"; Mixtral's files are "llama" with expert tensors): each layer's experts
    # stacked in 3-D ffn_{gate,up,down}_exps tensors, the router as ffn_gate_inp; llama.cpp renormalizes
    # Qwen3-MoE's top-k weights (every released Qwen3-MoE config has norm_topk_prob true).
    ModelSpec("qwen3_moe", ("Qwen3MoeForCausalLM",), "vlite.models.qwen3_moe:Qwen3MoeForCausalLM",
              features={"qk_norm": True, "mlp_bias": False}, defaults={"norm_topk_prob": True}, gguf_name="qwen3moe"),
    # Qwen3.5 (dense, and the MoE with a gated shared expert), the text model of their image-text checkpoints
    # too; Qwen3-Next fuses the DeltaNet's input projections per key-head group (vlite/models/qwen3_next.py).
    # GGUF (llama.cpp's qwen35 / qwen35moe / qwen3next): vlite/model_loader/gguf_hybrid.py.
    ModelSpec("qwen35", ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"), "vlite.models.qwen3_5:Qwen3_5ForCausalLM",
              features=_QWEN3_5, gguf_layer_names=_QWEN3_5_GGUF_NAMES, gguf_linear_attention="tiled", **_QWEN3_5_TEXT),
    ModelSpec("qwen35moe", ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"),
              "vlite.models.qwen3_5:Qwen3_5ForCausalLM", features={**_QWEN3_5, "norm_topk_prob": True},
              gguf_layer_names=_QWEN3_5_GGUF_NAMES, gguf_linear_attention="tiled", **_QWEN3_5_TEXT),
    ModelSpec("qwen3next", ("Qwen3NextForCausalLM",), "vlite.models.qwen3_next:Qwen3NextForCausalLM",
              features={**_QWEN3_5, "linear_grouped_projections": True}, defaults={"norm_topk_prob": True},
              hf_skipped=("mtp.",), gguf_layer_names=_QWEN3_5_GGUF_NAMES, gguf_linear_attention="hf"),
    ModelSpec("olmoe", ("OlmoeForCausalLM",), "vlite.models.olmoe:OlmoeForCausalLM", gguf=False,
              features={"qk_norm": True, "qk_norm_full": True, "mlp_bias": False}),
    ModelSpec("mixtral", ("MixtralForCausalLM",), "vlite.models.mixtral:MixtralForCausalLM", gguf=False,
              gguf_qk_permuted=True,
              features={"norm_topk_prob": True, "moe_prefix": "block_sparse_moe", "expert_names": ("w1", "w3", "w2"),
                        "mlp_bias": False}, sliding_global_every=0),
    # gpt-oss: Llama's pre-norm layer, q/k/v/o biases, per-head attention sinks, sliding (128) and full layers
    # alternating, YaRN rope; every MLP a mixture (router bias, softmax over the chosen k, experts with biases and
    # a clamped SwiGLU). Its checkpoints stack the experts (vlite/model_loader/gpt_oss_weights.py); GGUF files
    # (llama.cpp's "gpt-oss") hold them as ffn_{gate,up,down}_exps with biases, the sinks as attn_sinks.
    ModelSpec("gpt-oss", ("GptOssForCausalLM",), "vlite.models.gpt_oss:GptOssForCausalLM",
              features={"attention_sinks": True, "router_topk_softmax": True, "hidden_act": "swiglu_oai",
                        "mlp_bias": True, "attention_bias": True, "attention_out_bias": True},
              sliding_global_every=2,
              gguf_layer_names={"post_attention_norm": "post_attention_layernorm", "attn_sinks": "self_attn.sinks"},
              hf_tensor_transform="vlite.model_loader.gpt_oss_weights:hf_tensors"),
    ModelSpec("gemma2", ("Gemma2ForCausalLM",), "vlite.models.gemma2:Gemma2ForCausalLM",
              features=_GEMMA, defaults={"query_pre_attn_scalar": 256.0}, sliding_global_every=2,
              gguf_layer_names=_GEMMA_GGUF_NAMES, gguf_end_of_turn=("<end_of_turn>",)),
    # Gemma 3 text-only checkpoints (model_type gemma3_text); GGUF files of any Gemma 3 hold the text
    # model only. transformers' Gemma 3 applies no attention-logit soft-capping whatever the config says.
    # Encoders (vlite.layers.encoder; configs read by vlite.model_loader.encoder_config): embedding models,
    # and cross-encoders with a sequence-classification head on the first token.
    ModelSpec("bert", ("BertModel",), "vlite.models.bert:BertModel", gguf=False, features=_ENCODER),
    ModelSpec("bert_cls", ("BertForSequenceClassification",), "vlite.models.bert:BertForSequenceClassification",
              gguf=False, features={**_ENCODER, "classifier": "bert"}),
    ModelSpec("roberta", ("RobertaModel", "XLMRobertaModel"), "vlite.models.roberta:RobertaModel", gguf=False,
              features=_ROBERTA),
    ModelSpec("roberta_cls", ("RobertaForSequenceClassification", "XLMRobertaForSequenceClassification"),
              "vlite.models.roberta:RobertaForSequenceClassification", gguf=False,
              features={**_ROBERTA, "classifier": "roberta"}),
    ModelSpec("gemma3", ("Gemma3ForCausalLM",), "vlite.models.gemma3:Gemma3ForCausalLM",
              features={**_GEMMA, "qk_norm": True, "attn_logit_softcapping": None},
              defaults={"rope_local_theta": 10000.0, "query_pre_attn_scalar": 256.0}, sliding_global_every=6,
              gguf_layer_names=_GEMMA_GGUF_NAMES, gguf_end_of_turn=("<end_of_turn>",)),
    # Gemma 4 (text; the text model of its image-audio-text checkpoints): Gemma 3's layer with plain-weight norms,
    # per-layer inputs, KV-shared layers, its own head sizes on full layers, an optional mixture beside the MLP.
    ModelSpec("gemma4", ("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"),
              "vlite.models.gemma4:Gemma4ForCausalLM",
              features={**_GEMMA, "norm_unit_offset": False, "qk_norm": True, "attn_logit_softcapping": None},
              defaults={"rope_local_theta": 10000.0}, sliding_global_every=6, gguf_layer_names=_GEMMA4_GGUF_NAMES,
              hf_renames=(("model.language_model.", "model."),),
              hf_skipped=("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")),
)
_ALIASES = {"gemma3_text": "gemma3", "xlm-roberta": "roberta", "qwen3_5": "qwen35", "qwen3_5_text": "qwen35",
            "qwen3_5_moe": "qwen35moe", "qwen3_5_moe_text": "qwen35moe", "qwen3_next": "qwen3next",
            "gpt_oss": "gpt-oss", "gemma4_text": "gemma4"}  # config.json model_type -> family

_BY_NAME = {s.name: s for s in _SPECS}
_BY_HF = {a: s for s in _SPECS for a in s.hf_architectures}
_BY_GGUF = {s.gguf_name or s.name: s for s in _SPECS if s.gguf}

SUPPORTED_HF_ARCHITECTURES = tuple(_BY_HF)
SUPPORTED_GGUF_ARCHITECTURES = tuple(_BY_GGUF)


def _supported(table: dict[str, ModelSpec], architecture: str, kind: str) -> ModelSpec:
    spec = table.get(architecture)
    if spec is None:
        raise ValueError(f"unsupported {kind}{architecture!r}; vlite supports: {', '.join(table)}")
    return spec


def spec_for_hf(architecture: str) -> ModelSpec:
    """The spec of a config.json architecture; a ValueError naming it and the supported ones. A decoder's
    `XForSequenceClassification` (its layers, a `score` head on the last token) is its `XForCausalLM`'s."""
    base = architecture.removesuffix("ForSequenceClassification") + "ForCausalLM"
    if base != architecture + "ForCausalLM" and base in _BY_HF:
        return _BY_HF[base]
    return _supported(_BY_HF, architecture, "architecture ")


def is_decoder_classifier(architecture: str) -> bool:
    """A decoder with a sequence-classification head (`score`) instead of its LM head."""
    return (architecture.endswith("ForSequenceClassification")
            and architecture.removesuffix("ForSequenceClassification") + "ForCausalLM" in _BY_HF)


def spec_for_gguf(architecture: str) -> ModelSpec:
    """The spec of a GGUF `general.architecture`; a ValueError naming it and the supported ones."""
    return _supported(_BY_GGUF, architecture, "GGUF architecture ")


def spec_for(name: str) -> ModelSpec:
    """The spec of a loaded config's `architecture` (vlite's family name, or a model_type alias of it)."""
    spec = _BY_NAME.get(_ALIASES.get(name, name))
    if spec is None:
        raise ValueError(f"unknown model family {name!r}; vlite has: {', '.join(_BY_NAME)}")
    return spec


def model_class(name: str) -> type:
    """The nn.Module class that runs the family `name` (imports its module, hence torch)."""
    module, _, cls = spec_for(name).model.partition(":")
    return getattr(importlib.import_module(module), cls)


def build_model(arch: Any, weights: dict[str, Any], plan: Any, dtype: Any) -> Any:
    """The model for a loaded `ModelArchConfig` and its weights: what the model runner calls."""
    return model_class(arch.architecture)(arch, weights, plan, dtype)
