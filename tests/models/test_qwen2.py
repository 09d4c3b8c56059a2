"""Qwen2 / Qwen2.5: q/k/v biases (none on o_proj), tied embeddings; from a sharded Hugging Face folder
and from a GGUF file; float32 greedy output token-identical to transformers. Quantized, it keeps
Llama's one-C++-call-per-layer decode path, bias included."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.models import tiny
from vlite.model_loader import load_model_weights, resolve_model


@pytest.fixture(scope="module")
def hf_model() -> Any:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return tiny.build(Qwen2Config, Qwen2ForCausalLM, seed=2, tie_word_embeddings=True, rope_theta=1e6)


@pytest.fixture(scope="module")
def folder(hf_model: Any, tokenizer: Any, model_dir: Path) -> Path:
    return tiny.save_hf(hf_model, tokenizer, model_dir / "hf", max_shard_size="50KB")


def test_config_from_sharded_hf_folder(folder: Path, hf_model: Any) -> None:
    index = folder / "model.safetensors.index.json"
    assert index.is_file() and len(list(folder.glob("model-*.safetensors"))) > 1
    cfg, weights = load_model_weights(resolve_model(str(folder)), torch.float32)
    assert cfg.architecture == "qwen2" and cfg.attention_bias
    assert not (cfg.attention_out_bias or cfg.mlp_bias or cfg.qk_norm)
    assert cfg.tie_word_embeddings and "lm_head.weight" not in weights
    assert cfg.eos_token_ids == (tiny.EOS_ID, tiny.ALT_EOS_ID)
    reference = hf_model.state_dict()
    assert set(weights) == set(reference) - {"lm_head.weight"}
    assert all(torch.equal(weights[n], reference[n]) for n in weights)


def test_hf_folder_matches_transformers(folder: Path, prompt_ids: list[list[int]], refs: list[Any]) -> None:
    llm, completions = tiny.run_vlite(folder, prompt_ids, block_size=8)
    assert tiny.model_class_name(llm) == "Qwen2ForCausalLM"
    print(tiny.assert_parity(completions, refs))


def test_gguf_matches_transformers(hf_model: Any, tokenizer: Any, model_dir: Path, prompt_ids: list[list[int]],
                                   refs: list[Any]) -> None:
    path = tiny.write_gguf(hf_model, tokenizer, model_dir / "qwen2-f16.gguf", "qwen2", f16=True)
    llm, completions = tiny.run_vlite(path, prompt_ids)
    assert tiny.model_class_name(llm) == "Qwen2ForCausalLM"
    cfg = llm.llm_engine.engine_core.model_runner.arch
    assert cfg.architecture == "qwen2" and cfg.attention_bias and cfg.tie_word_embeddings
    print(tiny.assert_parity(completions, refs))
    text = "class HelpFormatter(object):\n    def __init__(self, prog):"
    assert llm.get_tokenizer().encode(text) == tokenizer.encode(text)


def test_int8_fused_decode_layer_equals_layer_by_layer(folder: Path, prompt_ids: list[list[int]]) -> None:
    """The C++ decode layer adds the QKV bias itself: exactly the tokens and logprobs of the same
    kernels called layer by layer."""
    from vlite import LLM, SamplingParams

    llm = LLM(model=str(folder), dtype="float32", quantization="int8", enable_prefix_caching=False,
              kv_cache_memory_bytes=16 * 2**20)
    model = llm.llm_engine.engine_core.model_runner.model
    if model._fused_layers is None:
        pytest.skip("vlite's C++ kernels are unavailable here")
    assert model._fused_layers[0][4] is model.layers[0].self_attn.qkv_bias is not None
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, ignore_eos=True)
    requests = [{"prompt_token_ids": p} for p in prompt_ids[:4]]
    fused = llm.generate(requests, params, use_tqdm=False)
    model._fused_layers = None
    layered = llm.generate(requests, params, use_tqdm=False)
    for a, b in zip(fused, layered):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert {t: v.logprob for t, v in la.items()} == {t: v.logprob for t, v in lb.items()}
