"""gpt-oss: q/k/v/o biases, a learned attention sink per query head, sliding-window and full layers alternating,
YaRN rope, every MLP a mixture (router bias, softmax over the chosen 4 of 8 experts, experts with biases and a
clamped SwiGLU); from a Hugging Face folder (dense experts as transformers saves them; MXFP4 blocks as the
published checkpoints hold them) and from a GGUF file written by llama.cpp's own converter; float32 greedy output
token-identical to transformers on prompts longer than the window, chunked prefill mixed with decodes, on the
C++ kernels and on the torch path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.models import tiny
from vlite.layers.moe import SparseMoE
from vlite.model_loader import load_model_weights, resolve_model

WINDOW = 24  # the prompts run to 290 tokens, prefilled in chunks of 32
YARN = {"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 64, "rope_theta": 150000.0}


@pytest.fixture(scope="module")
def hf_model() -> Any:
    from transformers import GptOssConfig, GptOssForCausalLM

    # head_dim 64: the C++ kernels' fast decode and blocked prefill paths; YaRN's original context (64) well
    # inside the prompts, so its scaled frequencies matter.
    model = tiny.build(GptOssConfig, GptOssForCausalLM, seed=5, num_hidden_layers=2, head_dim=64,
                       intermediate_size=32, num_local_experts=8, num_experts_per_tok=4, sliding_window=WINDOW,
                       rope_parameters=YARN)
    gen = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("sinks", "_proj_bias")):  # transformers starts them at 0 (sinks: random too)
                p.copy_(torch.randn(p.shape, generator=gen) * (1.0 if name.endswith("sinks") else 0.3))
            if name.endswith("gate_up_proj"):  # wide enough that the clamps at +-7 take part
                p.mul_(20.0)
            p.copy_(p.half().float())
    return model


def test_config_from_hf_folder(folder: Path) -> None:
    cfg, weights = load_model_weights(resolve_model(str(folder)), torch.float32)
    assert cfg.architecture == "gpt-oss" and cfg.layer_windows == (WINDOW, 0) and cfg.head_dim == 64
    assert cfg.attention_sinks and cfg.attention_bias and cfg.attention_out_bias and cfg.mlp_bias
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.moe_layers) == (8, 4, 32, (0, 1))
    assert cfg.router_topk_softmax and cfg.hidden_act == "swiglu_oai"
    assert (cfg.swiglu_alpha, cfg.swiglu_limit) == (1.702, 7.0)
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.rope_scaling["truncate"] is False
    assert cfg.rope_scaling["attention_factor"] == pytest.approx(0.1 * torch.log(torch.tensor(8.0)).item() + 1)
    assert weights["model.layers.1.self_attn.sinks"].shape == (4,)
    assert weights["model.layers.0.mlp.gate.bias"].shape == (8,)
    assert weights["model.layers.1.mlp.experts.7.gate_proj.weight"].shape == (32, 64)
    assert weights["model.layers.1.mlp.experts.7.down_proj.bias"].shape == (64,)


def test_experts_deinterleaved(hf_model: Any, folder: Path) -> None:
    """The checkpoint's stacked, interleaved gate_up [E, H, 2I] -> each expert's gate rows (even columns), up rows
    (odd ones), in Linear layout; down [E, I, H] transposed."""
    _, weights = load_model_weights(resolve_model(str(folder)), torch.float32)
    experts = hf_model.model.layers[1].mlp.experts
    for e in (0, 5):
        torch.testing.assert_close(weights[f"model.layers.1.mlp.experts.{e}.gate_proj.weight"],
                                   experts.gate_up_proj[e, :, 0::2].T, rtol=0, atol=0)
        torch.testing.assert_close(weights[f"model.layers.1.mlp.experts.{e}.up_proj.bias"],
                                   experts.gate_up_proj_bias[e, 1::2], rtol=0, atol=0)
        torch.testing.assert_close(weights[f"model.layers.1.mlp.experts.{e}.down_proj.weight"],
                                   experts.down_proj[e].T, rtol=0, atol=0)


@pytest.mark.parametrize("kernels", ["1", "0"])
def test_hf_folder_matches_transformers(folder: Path, prompt_ids: list[list[int]], refs: list[Any],
                                        monkeypatch: pytest.MonkeyPatch, kernels: str) -> None:
    """On the C++ kernels (prompt tokens as decode rows: sinks in the split-and-merge decode kernel) and on the
    torch path (VLITE_CPU_KERNELS=0: the einsum path with the sink column, windowed prefill chunks)."""
    monkeypatch.setenv("VLITE_CPU_KERNELS", kernels)
    llm, completions = tiny.run_vlite(folder, prompt_ids)
    model = llm.llm_engine.engine_core.model_runner.model
    assert tiny.model_class_name(llm) == "GptOssForCausalLM"
    assert all(type(layer.mlp) is SparseMoE for layer in model.layers)
    # the sliding layer in its own KV cache group, which frees the blocks behind its window
    assert [g.window for g in llm.llm_engine.engine_core.kv_cache_manager.groups] == [0, WINDOW]
    print(tiny.assert_parity(completions, refs))


def test_mxfp4_checkpoint(hf_model: Any, tokenizer: Any, model_dir: Path) -> None:
    """A checkpoint whose experts are MXFP4 (`*_blocks`, `*_scales`, as openai/gpt-oss-* ship) loads to the weights
    transformers' own dequantization gives (convert_moe_packed_tensors), in the same per-expert layout."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from vlite.model_loader.gpt_oss_weights import dequantize_mxfp4

    folder = tiny.save_hf(hf_model, tokenizer, model_dir / "mxfp4")
    gen = torch.Generator().manual_seed(9)
    tensors = load_file(str(folder / "model.safetensors"))
    dense = {}
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, k, n = tensors.pop(name).shape  # [E, in, out]: blocks are [E, out, in / 32, 16]
        blocks = torch.randint(0, 256, (e, n, k // 32, 16), generator=gen, dtype=torch.uint8)
        scales = torch.randint(120, 130, (e, n, k // 32), generator=gen, dtype=torch.uint8)
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        ref = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)  # it gives [E, in, out]
        torch.testing.assert_close(dequantize_mxfp4(blocks, scales), ref, rtol=0, atol=0)
        dense[name] = ref  # [E, out, in]
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    _, weights = load_model_weights(resolve_model(str(folder)), torch.float32)
    for layer in (0, 1):
        gate_up, down = (dense[f"model.layers.{layer}.mlp.experts.{p}"] for p in ("gate_up_proj", "down_proj"))
        for e in (0, 7):
            p = f"model.layers.{layer}.mlp.experts.{e}"
            torch.testing.assert_close(weights[f"{p}.gate_proj.weight"], gate_up[e, 0::2], rtol=0, atol=0)
            torch.testing.assert_close(weights[f"{p}.up_proj.weight"], gate_up[e, 1::2], rtol=0, atol=0)
            torch.testing.assert_close(weights[f"{p}.down_proj.weight"], down[e], rtol=0, atol=0)


needs_llama_cpp = pytest.mark.skipif(tiny.llama_cpp_dir() is None,
                                     reason="llama.cpp's source tree (shared/anchors/llamacpp.sh)")


@pytest.fixture(scope="module")
def gguf_f32(folder: Path, model_dir: Path) -> Path:
    """llama.cpp's converter's "gpt-oss" file of the float checkpoint (F32: the weights are transformers' exactly)."""
    return tiny.llama_cpp_convert(folder, model_dir / "gpt-oss-f32.gguf", "f32")


@needs_llama_cpp
def test_gguf_matches_transformers(gguf_f32: Path, folder: Path, prompt_ids: list[list[int]],
                                   refs: list[Any]) -> None:
    """Experts as ffn_{gate,up,down}_exps (gate and up split from the interleaved stack) with their biases, the
    sinks as attn_sinks, the router as ffn_gate_inp with its bias, YaRN as rope.scaling keys."""
    cfg, weights = load_model_weights(resolve_model(str(gguf_f32)), torch.float32)
    assert cfg.architecture == "gpt-oss" and cfg.layer_windows == (WINDOW, 0) and cfg.attention_sinks
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 4, 32)
    assert {k: cfg.rope_scaling[k] for k in ("rope_type", "factor", "original_max_position_embeddings", "truncate")} \
        == {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "truncate": False}
    _, hf_weights = load_model_weights(resolve_model(str(folder)), torch.float32)
    for name in ("model.layers.0.self_attn.sinks", "model.layers.1.mlp.gate.bias",
                 "model.layers.1.mlp.experts.3.up_proj.bias", "model.layers.0.mlp.experts.6.gate_proj.weight"):
        torch.testing.assert_close(weights[name], hf_weights[name], rtol=0, atol=0)
    llm, completions = tiny.run_vlite(gguf_f32, prompt_ids)
    assert tiny.model_class_name(llm) == "GptOssForCausalLM"
    print(tiny.assert_parity(completions, refs))


@needs_llama_cpp
def test_gguf_mxfp4_experts(gguf_f32: Path, model_dir: Path) -> None:
    """llama-quantize MXFP4_MOE (what every published gpt-oss GGUF is): the 3-D expert tensors in ggml's MXFP4, the
    rest Q8_0. Each expert's slice goes through the loader's one packed path (to_packed): with the MXFP4 type
    supported, every expert weight is the file's blocks exactly (gguf's own dequantizer); without it, the error
    names the type and the tensor."""
    import gguf

    from vlite.model_loader.gguf_quants import SUPPORTED_TYPES
    from vlite.model_loader.gguf_reader import GGUFReader

    path = tiny.llama_cpp_quantize(gguf_f32, model_dir / "gpt-oss-mxfp4.gguf", "MXFP4_MOE")
    if path is None:
        pytest.skip("llama-quantize is not built")
    stacks = {t.name: t for t in GGUFReader(str(path)).tensors if "_exps.weight" in t.name}
    assert {t.tensor_type.name for t in stacks.values()} == {"MXFP4"}
    if "MXFP4" not in SUPPORTED_TYPES:
        with pytest.raises(ValueError, match="MXFP4") as e:
            load_model_weights(resolve_model(str(path)), torch.float32)
        assert "_exps" in str(e.value)
        return
    _, weights = load_model_weights(resolve_model(str(path)), torch.float32)
    for layer, part, hf in ((0, "gate", "gate_proj"), (1, "down", "down_proj")):
        t = stacks[f"blk.{layer}.ffn_{part}_exps.weight"]
        want = gguf.quants.dequantize(t.data, t.tensor_type)
        for e in (0, 7):
            got = weights[f"model.layers.{layer}.mlp.experts.{e}.{hf}.weight"]
            got = got.dequantize(torch.float32) if hasattr(got, "dequantize") else got
            assert torch.equal(got, torch.from_numpy(want[e].copy()))


def test_int8_experts(folder: Path, prompt_ids: list[list[int]], refs: list[Any]) -> None:
    """--quantization int8: every projection on the kernels (experts' with their biases, clamped SwiGLU in torch),
    router and sinks dense; teacher-forced agreement with transformers' float32 stays close. Measured (Zen 3, AVX2):
    top-1 86.7%, median |logprob gap| 0.019, max 0.59: this model's gate/up weights are 20x wider so that the clamps
    take part, and int8's rounding grows with them (the same model at 1x: 99.2%, 0.003, 0.045)."""
    from vlite import LLM
    from vlite.layers.quantization import QuantizedLinear

    llm = LLM(model=str(folder), dtype="float32", quantization="int8", max_num_batched_tokens=tiny.STEP_TOKENS,
              kv_cache_memory_bytes=16 * 2**20)
    layer = llm.llm_engine.engine_core.model_runner.model.layers[1]
    assert isinstance(layer.mlp.experts[3].gate_up_weight, QuantizedLinear) and layer.mlp.experts[3].ops is None
    assert isinstance(layer.self_attn.qkv_weight, QuantizedLinear) and layer.self_attn.sinks.dtype == torch.float32
    rate, median, worst = tiny.teacher_forced_agreement(llm, prompt_ids, refs)
    print(f"int8 gpt-oss vs transformers float32: top-1 {rate:.1%}, |logprob gap| median {median:.4f} max {worst:.3f}")
    assert rate >= 0.8 and median < 0.04
