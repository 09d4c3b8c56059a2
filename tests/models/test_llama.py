"""Llama with every optional part switched on (q/k/v/o and MLP biases, untied head), from a Hugging
Face folder and from a float32 GGUF file (llama.cpp's rotary row order for Q/K, biases included);
float32 greedy output token-identical to transformers. The real default model's parity is
tests/e2e/test_parity.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.models import tiny


@pytest.fixture(scope="module")
def hf_model() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    return tiny.build(LlamaConfig, LlamaForCausalLM, seed=1, tie_word_embeddings=False, attention_bias=True,
                      mlp_bias=True)


def test_hf_folder_matches_transformers(hf_model: Any, tokenizer: Any, model_dir: Path, prompt_ids: list[list[int]],
                                        refs: list[Any]) -> None:
    folder = tiny.save_hf(hf_model, tokenizer, model_dir / "hf")
    llm, completions = tiny.run_vlite(folder, prompt_ids, block_size=4)
    assert tiny.model_class_name(llm) == "LlamaForCausalLM"
    cfg = llm.llm_engine.engine_core.model_runner.arch
    assert cfg.attention_bias and cfg.attention_out_bias and cfg.mlp_bias and not cfg.qk_norm
    print(tiny.assert_parity(completions, refs))


def test_gguf_matches_transformers(hf_model: Any, tokenizer: Any, model_dir: Path, prompt_ids: list[list[int]],
                                   refs: list[Any]) -> None:
    path = tiny.write_gguf(hf_model, tokenizer, model_dir / "llama-f32.gguf", "llama", f16=False)
    llm, completions = tiny.run_vlite(path, prompt_ids)
    cfg = llm.llm_engine.engine_core.model_runner.arch
    assert cfg.architecture == "llama" and cfg.attention_bias and cfg.attention_out_bias and cfg.mlp_bias
    print(tiny.assert_parity(completions, refs))


def test_q4_0_gguf_loads_through_the_files_map(hf_model: Any, tokenizer: Any, model_dir: Path,
                                               prompt_ids: list[list[int]]) -> None:
    """A Q4_0 file (llama.cpp's rotary row order for Q/K): its matrices load as views of the file's memory map
    (no copy), Q/K rows back in Hugging Face order, each the gguf quantizer's values of the checkpoint's
    weight; the model runs on the kernels' tiles of them, and once it is built the map is gone."""
    import gc

    import gguf
    import numpy as np
    import torch

    from vlite import LLM, SamplingParams
    from vlite.layers import weight_arena
    from vlite.model_loader.gguf_loader import load_gguf

    path = tiny.write_gguf(hf_model, tokenizer, model_dir / "llama-q4_0.gguf", "llama", quant="Q4_0")
    _, weights = load_gguf(path, torch.float32)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                 "model.layers.1.mlp.down_proj.weight", "lm_head.weight"):
        w = weights[name]
        assert w.compact and w.fmt == "q4_0", name
        if "_proj" not in name or "down" in name:
            assert weight_arena.file_offset(w.qs) is not None, name  # the file's bytes, not a copy
        source = hf_model.state_dict()[name].float().numpy()
        expected = gguf.quants.dequantize(gguf.quants.quantize(source, gguf.GGMLQuantizationType.Q4_0),
                                          gguf.GGMLQuantizationType.Q4_0)
        assert np.array_equal(w.dequantize().numpy(), expected.reshape(source.shape)), name
    del weights, w
    gc.collect()
    llm = LLM(model=str(path), kv_cache_memory_bytes=16 * 2**20)
    assert llm.llm_engine.engine_core.model_runner.quantization.method == "gguf"
    out = llm.generate([{"prompt_token_ids": p} for p in prompt_ids[:2]],
                       SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 4 for o in out)
    gc.collect()
    assert not [p for _, _, p in weight_arena._FILE_MAPS.values() if p == str(path.resolve())]
