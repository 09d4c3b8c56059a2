"""Gemma 4 (text): per-layer inputs, KV-shared layers (no K/V of their own, no KV pages), full layers with their own
head size, KV heads and proportional rope (values = keys), plain-weight norms, layer scalars, the mixture beside
the dense MLP; float32 greedy output token-identical to transformers on prompts of mixed lengths, longer than the
window, prefilled in chunks of 32 beside other requests' decodes."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.models import tiny
from vlite.core.kv_cache_interface import KVCacheConfig, kv_cache_groups
from vlite.model_loader import load_model_weights, resolve_model

WINDOW = 24  # the prompts run to 290 tokens
S, F = "sliding_attention", "full_attention"
# 8 layers, the last 3 KV-shared: layer 5 (full) reads layer 2's K/V, 6 (sliding) layer 4's, 7 (full) layer 2's
LAYER_TYPES = [S, S, F, S, S, F, S, F]


def _gemma4(seed: int, **overrides: Any) -> Any:
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    kwargs = dict(num_hidden_layers=8, layer_types=LAYER_TYPES, head_dim=16, global_head_dim=32,
                  sliding_window=WINDOW, num_kv_shared_layers=3, hidden_size_per_layer_input=8,
                  vocab_size_per_layer_input=tiny.VOCAB_SIZE, final_logit_softcapping=30.0, pad_token_id=None,
                  rope_parameters={F: {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                       "rope_theta": 1e6}, S: {"rope_type": "default", "rope_theta": 1e4}})
    kwargs.update(overrides)
    model = tiny.build(Gemma4TextConfig, Gemma4ForCausalLM, seed=seed, **kwargs)
    gen = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():  # what transformers starts at 1 (a model ignoring them would pass): random, f16-exact
        for name, t in [*model.named_buffers(), *model.named_parameters()]:
            if name.endswith(("layer_scalar", "router.scale", "per_expert_scale")):
                t.copy_((torch.rand(t.shape, generator=gen) + 0.5).half().float())
    return model


@pytest.fixture(scope="module")
def hf_model() -> Any:
    """Dense, E2B's features: per-layer inputs, KV sharing, double-wide MLPs on the shared layers, full layers
    with one KV head of 32 whose values are the keys."""
    return _gemma4(11, use_double_wide_mlp=True, attention_k_eq_v=True, num_global_key_value_heads=1)


def test_config_and_kv_groups(folder: Path) -> None:
    cfg, weights = load_model_weights(resolve_model(str(folder)), torch.float32)
    assert cfg.architecture == "gemma4" and not cfg.norm_unit_offset and cfg.qk_norm
    assert cfg.layer_windows == tuple(WINDOW if t == S else 0 for t in LAYER_TYPES)
    assert (cfg.global_head_dim, cfg.num_global_key_value_heads, cfg.attention_k_eq_v) == (32, 1, True)
    assert [cfg.kv_source(i) for i in range(8)] == [0, 1, 2, 3, 4, 2, 4, 2] and cfg.kv_layers == (0, 1, 2, 3, 4)
    assert cfg.rope_scaling == {"rope_type": "proportional", "partial_rotary_factor": 0.25}
    assert weights["model.layers.6.mlp.gate_proj.weight"].shape == (256, 64)  # double-wide on a shared layer
    assert "model.layers.6.self_attn.k_proj.weight" not in weights
    # the shared layers hold no pages; full layers' pages (1 head of 32) are their own buffers
    groups = kv_cache_groups(cfg, 4, 4)
    assert [(g.layer_indices, g.kv_cache_spec.head_size) for g in groups] == [((2,), 32), ((0,), 16), ((1,), 16),
                                                                               ((3,), 16), ((4,), 16)]
    assert KVCacheConfig(1, groups).block_bytes == 2 * 4 * 4 * (1 * 32 + 2 * 16)
    assert [g.layer_indices for g in kv_cache_groups(cfg, 4, 4, split_windows=False)] == [(0, 1, 3, 4), (2,)]


def test_kv_sharing_without_a_source_is_refused(folder: Path) -> None:
    """Every KV-shared layer needs an earlier layer of its kind that projects K/V: refused naming the field."""
    from dataclasses import replace

    cfg, _ = load_model_weights(resolve_model(str(folder)), torch.float32)
    with pytest.raises(ValueError, match="num_kv_shared_layers"):
        replace(cfg, num_kv_shared_layers=6)  # layers 2..7 shared: no full layer before them


def test_checkpoint_with_shared_layers_kv_weights(folder: Path, tmp_path: Path) -> None:
    """A checkpoint that keeps k/v weights for the KV-shared layers (transformers ignores them at load) loads alike."""
    from safetensors.torch import save_file

    copy = tmp_path / "hf"
    shutil.copytree(folder, copy)
    save_file({"model.layers.6.self_attn.k_proj.weight": torch.zeros(32, 64),
               "model.layers.6.self_attn.v_norm.weight": torch.ones(16)}, str(copy / "extra.safetensors"))
    _, weights = load_model_weights(resolve_model(str(copy)), torch.float32)
    assert "model.layers.6.self_attn.k_proj.weight" not in weights


def test_hf_folder_matches_transformers(folder: Path, prompt_ids: list[list[int]], refs: list[Any]) -> None:
    llm, completions = tiny.run_vlite(folder, prompt_ids)
    assert tiny.model_class_name(llm) == "Gemma4ForCausalLM"
    runner = llm.llm_engine.engine_core.model_runner
    assert runner.kv_caches[5] is runner.kv_caches[2] and runner.kv_caches[6] is runner.kv_caches[4]
    print(tiny.assert_parity(completions, refs))


MOE_PROMPTS = 4  # lengths 1, 4, 19 and 63: past the window, the longest in two chunks


@pytest.fixture(scope="module")
def moe(tokenizer: Any, model_dir: Path, prompt_ids: list[list[int]]) -> tuple[Any, Path, list[Any]]:
    """26B-A4B's features: the mixture beside every dense MLP, full layers with their own head size and v_proj, no
    per-layer inputs; KV sharing kept. The model, its folder, transformers' references on the first prompts."""
    model = _gemma4(12, enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=16,
                    hidden_size_per_layer_input=0)
    refs = tiny.references(model, prompt_ids[:MOE_PROMPTS])
    return model, tiny.save_hf(model, tokenizer, model_dir / "moe"), refs


def test_moe_matches_transformers(moe: tuple[Any, Path, list[Any]], prompt_ids: list[list[int]]) -> None:
    _, folder, refs = moe
    llm, completions = tiny.run_vlite(folder, prompt_ids[:MOE_PROMPTS])
    assert llm.llm_engine.engine_core.model_runner.arch.moe_layers == tuple(range(8))
    print(tiny.assert_parity(completions, refs))


@pytest.mark.skipif(tiny.llama_cpp_dir() is None, reason="llama.cpp's converter (../shared/anchors/llamacpp.sh)")
def test_moe_gguf_matches_transformers(moe: tuple[Any, Path, list[Any]], model_dir: Path,
                                       prompt_ids: list[list[int]]) -> None:
    """The mixture as llama.cpp writes it: experts stacked (ffn_gate_up_exps), the router's scales as .scale tensors."""
    model, folder, refs = moe
    path = tiny.llama_cpp_convert(folder, model_dir / "moe-f16.gguf", "f16")
    cfg, weights = load_model_weights(resolve_model(str(path)), torch.float32)
    assert cfg.moe_layers == tuple(range(8)) and (cfg.num_experts, cfg.num_experts_per_tok) == (4, 2)
    state = model.state_dict()
    for name in ("model.layers.1.router.scale", "model.layers.1.router.per_expert_scale"):
        torch.testing.assert_close(weights[name], state[name], rtol=0, atol=0)
    torch.testing.assert_close(weights["model.layers.1.experts.gate_up_proj"].reshape(4, 32, 64),
                               state["model.layers.1.experts.gate_up_proj"], rtol=0, atol=0)
    llm, completions = tiny.run_vlite(path, prompt_ids[:MOE_PROMPTS])
    print(tiny.assert_parity(completions, refs))


@pytest.mark.skipif(tiny.llama_cpp_dir() is None, reason="llama.cpp's converter (../shared/anchors/llamacpp.sh)")
def test_gguf_matches_transformers(hf_model: Any, folder: Path, model_dir: Path, prompt_ids: list[list[int]],
                                   refs: list[Any]) -> None:
    """The folder as llama.cpp's converter writes it (per-layer KV heads and MLP widths, key_length_swa, the
    proportional rope as rope_freqs, stacked per-layer inputs): the same config and weights, the same tokens."""
    path = tiny.llama_cpp_convert(folder, model_dir / "gemma4-f16.gguf", "f16")
    cfg, weights = load_model_weights(resolve_model(str(path)), torch.float32)
    hf_cfg, _ = load_model_weights(resolve_model(str(folder)), torch.float32)
    fields = ("head_dim", "num_key_value_heads", "intermediate_size", "global_head_dim", "num_global_key_value_heads",
              "attention_k_eq_v", "num_kv_shared_layers", "hidden_size_per_layer_input", "vocab_size_per_layer_input",
              "layer_windows", "rope_theta", "rope_scaling", "rope_local_theta", "partial_rotary_factor",
              "final_logit_softcapping", "norm_unit_offset", "qk_norm", "moe_layers")
    assert [getattr(cfg, f) for f in fields] == [getattr(hf_cfg, f) for f in fields]
    state = hf_model.state_dict()
    for name in ("model.layers.5.post_per_layer_input_norm.weight", "model.layers.3.layer_scalar",
                 "model.embed_tokens_per_layer.weight", "model.layers.2.self_attn.k_norm.weight"):
        torch.testing.assert_close(weights[name], state[name], rtol=0, atol=0)
    llm, completions = tiny.run_vlite(path, prompt_ids)
    print(tiny.assert_parity(completions, refs))
