"""Qwen3-MoE: Qwen3's attention with a mixture of experts (8 experts, top 2, renormalized) on two of its
three layers and a dense MLP on the third (`mlp_only_layers`); from a Hugging Face folder, float32 greedy
output token-identical to transformers; int8 and int4 quantize the experts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.models import tiny
from vlite.layers.mlp import GatedMLP
from vlite.layers.moe import SparseMoE
from vlite.model_loader import load_model_weights, resolve_model
from vlite.model_loader.hf_config import arch_from_hf_config


@pytest.fixture(scope="module")
def hf_model() -> Any:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    # Experts 32 wide (the dense layer: 128), as Qwen3-MoE's experts are narrower than its dense MLPs.
    return tiny.build(Qwen3MoeConfig, Qwen3MoeForCausalLM, seed=11, num_hidden_layers=3, head_dim=32,
                      num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                      mlp_only_layers=[1], tie_word_embeddings=False, rope_theta=1e6)


def test_config_from_hf_folder(folder: Path) -> None:
    cfg, weights = load_model_weights(resolve_model(str(folder)), torch.float32)
    assert cfg.architecture == "qwen3_moe" and cfg.qk_norm and cfg.head_dim == 32
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 2, 32)
    assert cfg.norm_topk_prob and cfg.moe_layers == (0, 2)
    assert weights["model.layers.2.mlp.experts.7.down_proj.weight"].shape == (64, 32)
    assert weights["model.layers.0.mlp.gate.weight"].shape == (8, 64)
    assert weights["model.layers.1.mlp.gate_proj.weight"].shape == (128, 64)  # the dense layer
    assert "model.layers.1.mlp.gate.weight" not in weights


@pytest.mark.parametrize("extra,moe_layers", [
    ({}, (0, 1, 2, 3, 4, 5)),
    ({"decoder_sparse_step": 2}, (1, 3, 5)),  # transformers: sparse where (i + 1) % step == 0
    ({"decoder_sparse_step": 2, "mlp_only_layers": [3]}, (1, 5)),
    ({"mlp_only_layers": [0, 5]}, (1, 2, 3, 4)),
    ({"num_experts": 0}, ())])  # no experts: a dense model
def test_dense_and_sparse_layers(extra: dict, moe_layers: tuple[int, ...]) -> None:
    cfg = arch_from_hf_config({
        "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 32, "hidden_size": 16, "intermediate_size": 64,
        "num_hidden_layers": 6, "num_attention_heads": 2, "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 8, **extra})
    assert cfg.moe_layers == moe_layers


def test_hf_folder_matches_transformers(folder: Path, prompt_ids: list[list[int]], refs: list[Any]) -> None:
    llm, completions = tiny.run_vlite(folder, prompt_ids)
    model = llm.llm_engine.engine_core.model_runner.model
    assert tiny.model_class_name(llm) == "Qwen3MoeForCausalLM"
    assert [type(layer.mlp) for layer in model.layers] == [SparseMoE, GatedMLP, SparseMoE]
    print(tiny.assert_parity(completions, refs))


def test_gguf_matches_transformers(hf_model: Any, tokenizer: Any, model_dir: Path, prompt_ids: list[list[int]],
                                   refs: list[Any]) -> None:
    """llama.cpp's "qwen3moe" layout: each layer's experts stacked in ffn_{gate,up,down}_exps, the router
    ffn_gate_inp. The dense layer (mlp_only_layers; released Qwen3-MoE models have none, llama.cpp's
    qwen3moe none either) keeps plain ffn_* tensors, and vlite finds the mixture layers by their router."""
    path = tiny.write_gguf(hf_model, tokenizer, model_dir / "qwen3moe-f16.gguf", "qwen3moe", f16=True)
    cfg, weights = load_model_weights(resolve_model(str(path)), torch.float32)
    assert cfg.architecture == "qwen3_moe" and cfg.moe_layers == (0, 2) and cfg.norm_topk_prob
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 2, 32)
    assert cfg.intermediate_size == 128
    assert weights["model.layers.2.mlp.experts.7.down_proj.weight"].shape == (64, 32)
    llm, completions = tiny.run_vlite(path, prompt_ids)
    assert tiny.model_class_name(llm) == "Qwen3MoeForCausalLM"
    print(tiny.assert_parity(completions, refs))


@pytest.mark.parametrize("method,min_rate,max_median,max_gap", [("int8", 0.9, 0.03, 0.2), ("int4", 0.6, 0.3, 1.0)])
def test_quantized_experts(folder: Path, prompt_ids: list[list[int]], refs: list[Any], method: str,
                           min_rate: float, max_median: float, max_gap: float) -> None:
    """--quantization quantizes every expert's projections (the router stays dense) and runs them on the
    kernels; the teacher-forced agreement with transformers' float32 stays close. Measured: int8 top-1
    98.3%, median |logprob gap| 0.006, max 0.024; int4 (every linear but the head) 75%, 0.11, 0.49."""
    from vlite import LLM
    from vlite.layers.quantization import QuantizedLinear

    llm = LLM(model=str(folder), dtype="float32", quantization=method, max_num_batched_tokens=8,
              kv_cache_memory_bytes=16 * 2**20)
    moe = llm.llm_engine.engine_core.model_runner.model.layers[0].mlp
    assert isinstance(moe.gate_weight, torch.nn.Parameter)
    expert = moe.experts[5]
    assert isinstance(expert.gate_up_weight, QuantizedLinear) and isinstance(expert.down_weight, QuantizedLinear)
    assert expert.down_weight.fmt == (8 if method == "int8" else 4)
    rate, median, worst = tiny.teacher_forced_agreement(llm, prompt_ids, refs)
    print(f"{method} Qwen3-MoE vs transformers float32: top-1 {rate:.1%}, |logprob gap| median {median:.4f} "
          f"max {worst:.3f}")
    assert rate >= min_rate and median < max_median and worst < max_gap


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_gguf_quantized_experts_stay_in_their_blocks(tmp_path: Path, qtype: str) -> None:
    """A stacked quantized expert tensor splits into one packed weight per expert, each dequantizing to
    exactly the gguf package's values for its slice."""
    import gguf
    import numpy as np
    from gguf.quants import dequantize, quantize

    from vlite.layers.packed import PackedTensors
    from vlite.model_loader.gguf_loader import _split_experts

    rng = np.random.default_rng(0)
    kind = gguf.GGMLQuantizationType[qtype]
    stacked = quantize(rng.standard_normal((3, 16, 256)).astype(np.float32), kind)  # 3 experts, 16 rows, K 256
    path = tmp_path / "experts.gguf"
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_tensor("blk.0.ffn_down_exps.weight", stacked, raw_dtype=kind)  # shape from the bytes
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    t = gguf.GGUFReader(str(path)).tensors[0]
    cfg = arch_from_hf_config({
        "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 32, "hidden_size": 16, "intermediate_size": 64,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_experts": 3, "num_experts_per_tok": 2,
        "moe_intermediate_size": 256})
    out = _split_experts(path, t, cfg, 0, "down", torch.float32)
    assert sorted(out) == [f"model.layers.0.mlp.experts.{e}.down_proj.weight" for e in range(3)]
    for e in range(3):
        packed = out[f"model.layers.0.mlp.experts.{e}.down_proj.weight"]
        assert isinstance(packed, PackedTensors)
        ref = dequantize(stacked[e], kind).reshape(16, 256)
        assert torch.equal(packed.dequantize(), torch.from_numpy(np.ascontiguousarray(ref, dtype=np.float32)))
