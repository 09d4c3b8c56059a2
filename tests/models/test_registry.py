"""The model registry: every architecture name resolves to its model class; anything else fails with
an error naming it and the supported list, from a Hugging Face folder and from a GGUF file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from vlite.model_loader.hf_config import arch_from_hf_config
from vlite.models import registry

_BASE = {"vocab_size": 32, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
         "num_attention_heads": 2}


@pytest.mark.parametrize("hf_name,family,cls", [
    ("LlamaForCausalLM", "llama", "LlamaForCausalLM"),
    ("MistralForCausalLM", "mistral", "LlamaForCausalLM"),
    ("Qwen2ForCausalLM", "qwen2", "Qwen2ForCausalLM"),
    ("Qwen3ForCausalLM", "qwen3", "Qwen3ForCausalLM"),
    ("Gemma2ForCausalLM", "gemma2", "Gemma2ForCausalLM"),
    ("Gemma3ForCausalLM", "gemma3", "Gemma3ForCausalLM"),
    ("Gemma4ForCausalLM", "gemma4", "Gemma4ForCausalLM"),
    ("Qwen3MoeForCausalLM", "qwen3_moe", "Qwen3MoeForCausalLM"),
    ("OlmoeForCausalLM", "olmoe", "OlmoeForCausalLM"),
    ("MixtralForCausalLM", "mixtral", "MixtralForCausalLM"),
    ("GptOssForCausalLM", "gpt-oss", "GptOssForCausalLM")])
def test_architectures_resolve(hf_name: str, family: str, cls: str) -> None:
    cfg = arch_from_hf_config({**_BASE, "architectures": [hf_name]})
    assert cfg.architecture == family and registry.spec_for(cfg.architecture) is registry.spec_for_hf(hf_name)
    assert registry.model_class(family).__name__ == cls
    assert hf_name in registry.SUPPORTED_HF_ARCHITECTURES


def test_architecture_features() -> None:
    """What a config.json leaves implicit comes from the registry: Qwen2's q/k/v biases, Qwen3's q/k norms."""
    qwen2 = arch_from_hf_config({**_BASE, "architectures": ["Qwen2ForCausalLM"]})
    assert (qwen2.attention_bias, qwen2.attention_out_bias, qwen2.qk_norm) == (True, False, False)
    qwen3 = arch_from_hf_config({**_BASE, "architectures": ["Qwen3ForCausalLM"], "head_dim": 12,
                                 "attention_bias": True})
    assert (qwen3.attention_bias, qwen3.attention_out_bias, qwen3.qk_norm, qwen3.head_dim) == (True, True, True, 12)
    llama = arch_from_hf_config({**_BASE, "architectures": ["LlamaForCausalLM"], "attention_bias": True})
    assert (llama.attention_bias, llama.attention_out_bias, llama.qk_norm, llama.head_dim) == (True, True, False, 8)
    # no `architectures`: the model_type names the family
    assert arch_from_hf_config({**_BASE, "model_type": "qwen3"}).architecture == "qwen3"
    assert arch_from_hf_config({**_BASE, "model_type": "gemma3_text"}).architecture == "gemma3"


def _assert_lists_supported(message: str, supported: tuple[str, ...]) -> None:
    assert all(name in message for name in supported), message


@pytest.mark.parametrize("config", [{"architectures": ["Qwen2MoeForCausalLM"]}, {"architectures": ["GPT2LMHeadModel"]},
                                    {"model_type": "gpt_neox"}])
def test_unsupported_hf_architecture_is_named(tmp_path: Path, config: dict) -> None:
    from vlite import LLM

    (tmp_path / "config.json").write_text(json.dumps({**_BASE, **config}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError) as e:
        LLM(model=str(tmp_path))
    name = config.get("architectures", [config.get("model_type")])[0]
    assert f"unsupported {'architecture' if 'architectures' in config else 'model_type'} {name!r}" in str(e.value)
    _assert_lists_supported(str(e.value), registry.SUPPORTED_HF_ARCHITECTURES)


def _gguf_file(path: Path, arch: str, tensors: tuple[str, ...] = ("token_embd.weight",)) -> Path:
    """A GGUF file of a tiny 1-layer model's header and the named (zero) tensors."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    for add, value in ((w.add_embedding_length, 16), (w.add_head_count, 2), (w.add_block_count, 1),
                       (w.add_feed_forward_length, 32)):
        add(value)
    for name in tensors:
        w.add_tensor(name, np.zeros((32, 16) if name == "token_embd.weight" else (16,), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# olmoe: a family vlite runs from Hugging Face folders only; starcoder2: one it does not run at all
@pytest.mark.parametrize("arch", ["olmoe", "starcoder2"])
def test_unsupported_gguf_architecture_is_named(tmp_path: Path, arch: str) -> None:
    import torch

    from vlite.model_loader import load_model_weights, resolve_model

    path = _gguf_file(tmp_path / f"{arch}.gguf", arch)
    with pytest.raises(ValueError, match=f"unsupported GGUF architecture '{arch}'") as e:
        load_model_weights(resolve_model(str(path)), torch.float32)
    _assert_lists_supported(str(e.value), registry.SUPPORTED_GGUF_ARCHITECTURES)
    assert set(registry.SUPPORTED_GGUF_ARCHITECTURES) == {"llama", "qwen2", "qwen3", "gemma2", "gemma3", "gemma4",
                                                          "phi3", "olmo2", "smollm3", "qwen3moe", "qwen35",
                                                          "qwen35moe", "qwen3next", "gpt-oss"}


def test_unreadable_gguf_tensor_is_named(tmp_path: Path) -> None:
    """A tensor of a supported family that vlite has no place for (llama.cpp's optional per-layer rotary
    embedding of SmolLM3 files) fails naming it and the family."""
    import torch

    from vlite.model_loader import load_model_weights, resolve_model

    path = _gguf_file(tmp_path / "smollm3.gguf", "smollm3", ("token_embd.weight", "blk.0.attn_rot_embd.weight"))
    with pytest.raises(ValueError, match="unexpected tensor 'blk.0.attn_rot_embd.weight' for a smollm3 GGUF file"):
        load_model_weights(resolve_model(str(path)), torch.float32)


@pytest.mark.parametrize("arch,extra,sliding", [
    # Qwen2.5's own config.json: a window that is switched off
    ("Qwen2ForCausalLM", {"use_sliding_window": False, "sliding_window": 32768, "max_window_layers": 21}, False),
    ("Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1}, True),
    ("Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 2}, False),
    ("Qwen3ForCausalLM", {"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 64}, True),
    ("Qwen3ForCausalLM", {"layer_types": ["full_attention", "full_attention"], "sliding_window": 64}, False),
    ("LlamaForCausalLM", {"sliding_window": 64}, True)])
def test_sliding_window_is_refused_where_unsupported(arch: str, extra: dict, sliding: bool) -> None:
    config = {**_BASE, "architectures": [arch], **extra}
    if sliding:
        with pytest.raises(ValueError, match="sliding-window attention are not supported"):
            arch_from_hf_config(config)
    else:
        cfg = arch_from_hf_config(config)
        assert registry.spec_for(cfg.architecture).hf_architectures == (arch,) and cfg.attention_windows == (0,)


@pytest.mark.parametrize("arch,extra,windows", [
    ("MistralForCausalLM", {"sliding_window": 4096}, (4096, 4096)),
    ("MistralForCausalLM", {"sliding_window": None}, (0, 0)),
    ("Gemma2ForCausalLM", {"sliding_window": 32}, (32, 0)),  # every other layer, the first sliding
    ("Gemma2ForCausalLM", {"sliding_window": 32, "layer_types": ["full_attention", "sliding_attention"]}, (0, 32)),
    ("Gemma3ForCausalLM", {"sliding_window": 8, "num_hidden_layers": 7}, (8, 8, 8, 8, 8, 0, 8)),  # 5:1
    ("Gemma3ForCausalLM", {"sliding_window": 8, "num_hidden_layers": 4, "sliding_window_pattern": 2}, (8, 0, 8, 0)),
    ("Gemma3ForCausalLM", {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]}, (8, 0))])
def test_layer_windows(arch: str, extra: dict, windows: tuple[int, ...]) -> None:
    cfg = arch_from_hf_config({**_BASE, "architectures": [arch], **extra})
    assert tuple(cfg.layer_window(i) for i in range(cfg.num_hidden_layers)) == windows
    assert cfg.attention_windows == tuple(sorted(set(windows)))
    # the KV cache frees blocks behind the window only where every layer slides
    assert cfg.kv_sliding_window == (windows[0] if min(windows) > 0 else None)


def test_gemma_configs() -> None:
    """What Gemma's config.json says, in the conventions of transformers 4 (flat rope keys) and 5
    (rope_parameters per layer type), and what the family fixes."""
    old = arch_from_hf_config({
        **_BASE, "architectures": ["Gemma3ForCausalLM"], "hidden_activation": "gelu_pytorch_tanh",
        "head_dim": 256, "query_pre_attn_scalar": 256, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "sliding_window": 512,
        "final_logit_softcapping": None, "attn_logit_softcapping": 50.0})
    assert (old.rope_theta, old.rope_scaling, old.rope_local_theta) == (1e6, {"rope_type": "linear", "factor": 8.0},
                                                                        1e4)
    assert old.head_dim == 256 and old.query_pre_attn_scalar == 256 and old.hidden_act == "gelu_pytorch_tanh"
    assert old.qk_norm and old.norm_unit_offset and old.sandwich_norms and old.scale_embeddings
    assert old.attn_logit_softcapping is None  # transformers' Gemma 3 applies none
    new = arch_from_hf_config({
        **_BASE, "model_type": "gemma3_text", "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 2e5},
            "sliding_attention": {"rope_type": "default", "rope_theta": 5e3}}})
    assert (new.rope_theta, new.rope_scaling, new.rope_local_theta) == (2e5, None, 5e3)
    assert new.query_pre_attn_scalar == 256  # transformers' default
    gemma2 = arch_from_hf_config({**_BASE, "architectures": ["Gemma2ForCausalLM"], "sliding_window": 16,
                                  "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
                                  "query_pre_attn_scalar": 144})
    assert (gemma2.attn_logit_softcapping, gemma2.final_logit_softcapping) == (50.0, 30.0)
    assert gemma2.rope_local_theta is None and not gemma2.qk_norm and gemma2.query_pre_attn_scalar == 144
    with pytest.raises(ValueError, match="bidirectional"):
        arch_from_hf_config({**_BASE, "architectures": ["Gemma3ForCausalLM"],
                             "use_bidirectional_attention": True})
    with pytest.raises(ValueError, match="unsupported hidden_act 'gelu'"):
        arch_from_hf_config({**_BASE, "architectures": ["LlamaForCausalLM"], "hidden_act": "gelu"})


def test_registry_and_configs_import_no_torch() -> None:
    """The API server process parses model configs too and never imports torch; nor does the scheduler
    with its (sliding-window) KV cache manager."""
    code = ("import sys, vlite.model_loader, vlite.models.registry, vlite.core.sched.scheduler, vlite.model_arch, "
            "vlite.model_loader.hf_config, vlite.model_loader.gguf_config, vlite.layers.rope_scaling; "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])
