"""Phi-3 / Phi-4-mini: fused qkv_proj and gate_up_proj tensors in the checkpoint, rotary over 3/4 of
each head (Phi-4-mini's partial_rotary_factor), a sliding window on every layer (Phi-3-mini-4k);
and LongRoPE: the short factors within the original context (the default max_model_len), the long ones for
every request when max_model_len is past it; from Hugging Face folders and from GGUF files laid out as
llama.cpp's converter writes them; float32 greedy output token-identical to transformers."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.e2e.prompts import prompts_of_lengths
from tests.models import tiny
from vlite.model_loader import load_model_weights, resolve_model
from vlite.model_loader.hf_config import arch_from_hf_config

WINDOW = 100  # shorter than the longest prompts: the window changes their outputs


@pytest.fixture(scope="module")
def hf_model() -> Any:
    from transformers import Phi3Config, Phi3ForCausalLM

    # head_dim 16: rotary turns the leading 12 dims of each head, the last 4 pass unrotated.
    return tiny.build(Phi3Config, Phi3ForCausalLM, seed=5, tie_word_embeddings=False, sliding_window=WINDOW,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.75},
                      pad_token_id=tiny.ALT_EOS_ID)


def test_config_from_hf_folder(folder: Path) -> None:
    cfg, weights = load_model_weights(resolve_model(str(folder)), torch.float32)
    assert cfg.architecture == "phi3" and cfg.fused_checkpoint
    assert cfg.partial_rotary_factor == 0.75 and cfg.rotary_dim == 12 and cfg.rope_scaling is None
    assert cfg.layer_windows == (WINDOW, WINDOW)
    assert weights["model.layers.0.self_attn.qkv_proj.weight"].shape == (16 * (4 + 2 * 2), 64)
    assert weights["model.layers.0.mlp.gate_up_proj.weight"].shape == (2 * 128, 64)
    assert "model.layers.0.self_attn.q_proj.weight" not in weights


def test_hf_folder_matches_transformers(folder: Path, prompt_ids: list[list[int]], refs: list[Any]) -> None:
    llm, completions = tiny.run_vlite(folder, prompt_ids)
    assert tiny.model_class_name(llm) == "Phi3ForCausalLM"
    print(tiny.assert_parity(completions, refs))


def test_gguf_matches_transformers(hf_model: Any, tokenizer: Any, model_dir: Path, prompt_ids: list[list[int]],
                                   refs: list[Any]) -> None:
    """llama.cpp's layout: attn_qkv and ffn_up (gate and up) stay fused, rope.dimension_count 12 of head_dim
    16, the window on every layer, Q/K rows in Hugging Face order (NEOX rotary)."""
    path = tiny.write_gguf(hf_model, tokenizer, model_dir / "phi3-f16.gguf", "phi3", f16=True)
    cfg, weights = load_model_weights(resolve_model(str(path)), torch.float32)
    assert cfg.architecture == "phi3" and cfg.fused_checkpoint and cfg.head_dim == 16 and cfg.rotary_dim == 12
    assert cfg.layer_windows == (WINDOW, WINDOW) and cfg.rope_scaling is None and not cfg.tie_word_embeddings
    state = hf_model.state_dict()
    for name in ("model.layers.0.self_attn.qkv_proj.weight", "model.layers.1.mlp.gate_up_proj.weight"):
        torch.testing.assert_close(weights[name], state[name], rtol=0, atol=0)
    llm, completions = tiny.run_vlite(path, prompt_ids)
    assert tiny.model_class_name(llm) == "Phi3ForCausalLM"
    print(tiny.assert_parity(completions, refs))


def test_packed_fused_weights_split(hf_model: Any) -> None:
    """A quantized GGUF file's fused tensors stay packed: the split takes row blocks of the blocks, the values
    those of the dense split (Q8_0 here)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from vlite.layers.packed import PackedTensors
    from vlite.model_loader.gguf_quants import to_packed
    from vlite.models.phi3 import split_fused

    cfg = arch_from_hf_config(hf_model.config.to_dict())
    dense = {name: t.detach() for name, t in hf_model.state_dict().items()}
    packed = {}
    for name in ("model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"):
        data = quantize(dense[name].numpy(), GGMLQuantizationType.Q8_0)
        packed[name] = to_packed(data, GGMLQuantizationType.Q8_0, tuple(dense[name].shape))
        dense[name] = packed[name].dequantize()
    want, got = split_fused(cfg, dense), split_fused(cfg, {**dense, **packed})
    for proj in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
        part = got[f"model.layers.0.{proj}.weight"]
        assert isinstance(part, PackedTensors)
        torch.testing.assert_close(part.dequantize(), want[f"model.layers.0.{proj}.weight"], rtol=0, atol=0)


@pytest.fixture(scope="module")
def longrope_model() -> Any:
    """Phi-4-mini's layout: longrope over 3/4 of each head, a context 4x the original one."""
    from transformers import Phi3Config, Phi3ForCausalLM

    rope = {"rope_type": "longrope", "rope_theta": 1e4, "partial_rotary_factor": 0.75,
            "original_max_position_embeddings": 512, "short_factor": [1.0, 1.3, 1.9, 2.6, 4.2, 7.5],
            "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]}
    return tiny.build(Phi3Config, Phi3ForCausalLM, seed=6, tie_word_embeddings=True, max_position_embeddings=2048,
                      original_max_position_embeddings=512,
                      rope_parameters=rope, pad_token_id=tiny.ALT_EOS_ID)


@pytest.fixture(scope="module")
def longrope_folder(longrope_model: Any, tokenizer: Any, model_dir: Path) -> Path:
    return tiny.save_hf(longrope_model, tokenizer, model_dir / "longrope")


def test_longrope_matches_transformers(longrope_folder: Path, prompt_ids: list[list[int]]) -> None:
    """Within original_max_position_embeddings transformers rotates with the short factors, and scales
    cos/sin by sqrt(1 + ln(4) / ln(512)); vlite serves exactly that context."""
    from transformers import AutoModelForCausalLM

    cfg, _ = load_model_weights(resolve_model(str(longrope_folder)), torch.float32)
    assert cfg.max_position_embeddings == 512 and cfg.rope_scaling["rope_type"] == "longrope"
    assert cfg.rope_scaling["attention_factor"] == pytest.approx((1 + math.log(4) / math.log(512)) ** 0.5)
    refs = tiny.references(AutoModelForCausalLM.from_pretrained(longrope_folder).eval(), prompt_ids)
    llm, completions = tiny.run_vlite(longrope_folder, prompt_ids)
    print(tiny.assert_parity(completions, refs))


def test_longrope_gguf_matches_transformers(longrope_model: Any, tokenizer: Any, model_dir: Path,
                                            prompt_ids: list[list[int]]) -> None:
    """A LongRoPE GGUF file: the factors as rope_factors_long / rope_factors_short tensors, the original
    context and the attention factor in the metadata; no output tensor (tied)."""
    path = tiny.write_gguf(longrope_model, tokenizer, model_dir / "longrope-f16.gguf", "phi3", f16=True)
    cfg, weights = load_model_weights(resolve_model(str(path)), torch.float32)
    rope = longrope_model.config.rope_parameters
    assert cfg.rope_scaling["short_factor"] == pytest.approx(rope["short_factor"])
    assert cfg.rope_scaling["long_factor"] == pytest.approx(rope["long_factor"])
    assert cfg.rope_scaling["attention_factor"] == pytest.approx((1 + math.log(4) / math.log(512)) ** 0.5)
    assert cfg.max_position_embeddings == 512 and cfg.rotary_dim == 12 and cfg.tie_word_embeddings
    assert not any("rope_factors" in name for name in weights)
    llm, completions = tiny.run_vlite(path, prompt_ids)
    print(tiny.assert_parity(completions, tiny.references(longrope_model, prompt_ids)))


# A small original context, so that prompts past it stay cheap: the long factors apply past ORIG.
ORIG, LONG = 64, 256
LONG_PROMPTS = [70, 130, 200]  # past ORIG; with MAX_NEW tokens each still within LONG
SHORT_PROMPTS = [1, 4, 19, 40]  # with MAX_NEW tokens each within ORIG


def _long_context_model(short_factor: list[float]) -> Any:
    from transformers import Phi3Config, Phi3ForCausalLM

    rope = {"rope_type": "longrope", "rope_theta": 1e4, "partial_rotary_factor": 0.75,
            "original_max_position_embeddings": ORIG, "short_factor": short_factor,
            "long_factor": [1.0, 1.5, 3.0, 6.0, 12.0, 24.0]}
    return tiny.build(Phi3Config, Phi3ForCausalLM, seed=7, tie_word_embeddings=False, max_position_embeddings=LONG,
                      original_max_position_embeddings=ORIG, rope_parameters=rope, pad_token_id=tiny.ALT_EOS_ID)


@pytest.fixture(scope="module")
def long_context_model() -> Any:
    return _long_context_model([1.0, 1.1, 1.3, 1.6, 2.0, 2.5])


@pytest.fixture(scope="module")
def long_context_folder(long_context_model: Any, tokenizer: Any, model_dir: Path) -> Path:
    return tiny.save_hf(long_context_model, tokenizer, model_dir / "long-context")


@pytest.fixture(scope="module")
def long_context_refs(long_context_model: Any, tokenizer: Any) -> tuple[list[list[int]], list[Any]]:
    """Prompts of SHORT_PROMPTS and LONG_PROMPTS lengths, and transformers' greedy output with the long factors
    for every token: the model itself for the long prompts (one forward over a prompt past ORIG picks the long
    factors, and each decode step's position is past ORIG too); for the short ones, the same weights with the
    long factors as its short ones too (the attention factor is the same: it depends on LONG / ORIG only)."""
    prompts = prompts_of_lengths(tokenizer, SHORT_PROMPTS + LONG_PROMPTS)
    always_long = _long_context_model([1.0, 1.5, 3.0, 6.0, 12.0, 24.0])
    always_long.load_state_dict(long_context_model.state_dict())
    short, long = prompts[:len(SHORT_PROMPTS)], prompts[len(SHORT_PROMPTS):]
    refs = tiny.references(always_long, short) + tiny.references(long_context_model, long)
    # transformers rotates a long prompt with the long factors: the "always long" model agrees on it
    assert tiny.references(always_long, long[:1])[0].token_ids == refs[len(short)].token_ids
    return prompts, refs


def test_longrope_long_context_matches_transformers(long_context_folder: Path,
                                                    long_context_refs: tuple[list[list[int]], list[Any]]) -> None:
    """max_model_len past original_max_position_embeddings: every request rotates with the long factors,
    prompts past the original context (chunked: 32 tokens a step) as transformers does them, and the short
    prompts in the same batch too (transformers would give those the short factors)."""
    prompts, refs = long_context_refs
    cfg, _ = load_model_weights(resolve_model(str(long_context_folder)), torch.float32)
    assert cfg.max_position_embeddings == ORIG and cfg.longest_context == LONG
    long_cfg = cfg.with_max_model_len(LONG)
    assert long_cfg.rope_scaling["use_long_factor"] and long_cfg.max_position_embeddings == LONG
    assert cfg.with_max_model_len(ORIG) is cfg
    llm, completions = tiny.run_vlite(long_context_folder, prompts, max_model_len=LONG)
    assert llm.llm_engine.max_model_len == LONG
    print(tiny.assert_parity(completions, refs))


def test_longrope_default_context(long_context_folder: Path, long_context_model: Any, tokenizer: Any,
                                  caplog: pytest.LogCaptureFixture) -> None:
    """By default max_model_len is the original context: the short factors, as transformers within it (the
    log says how to get the long context); a prompt past it is refused, and so is a max_model_len past
    max_position_embeddings."""
    from vlite import LLM, SamplingParams

    prompts = prompts_of_lengths(tokenizer, SHORT_PROMPTS)
    with caplog.at_level("INFO", logger="vlite"):
        llm, completions = tiny.run_vlite(long_context_folder, prompts)
    assert llm.llm_engine.max_model_len == ORIG
    assert f"--max-model-len above {ORIG} (up to {LONG}) runs the long factors" in caplog.text
    print(tiny.assert_parity(completions, tiny.references(long_context_model, prompts)))
    long_prompt = prompts_of_lengths(tokenizer, [ORIG + 1])[0]
    refused = re.escape(f"prompt is {ORIG + 1} tokens long, more than max_model_len ({ORIG})")
    with pytest.raises(ValueError, match=refused):
        llm.generate([{"prompt_token_ids": long_prompt}], SamplingParams(max_tokens=1), use_tqdm=False)
    with pytest.raises(ValueError, match=re.escape(f"max_model_len ({LONG + 1}) exceeds the model's limit ({LONG})")):
        LLM(model=str(long_context_folder), dtype="float32", max_model_len=LONG + 1)


def test_longrope_gguf_long_context(long_context_model: Any, tokenizer: Any, model_dir: Path,
                                    long_context_refs: tuple[list[list[int]], list[Any]]) -> None:
    """The same from a GGUF file (factors as rope_factors_long / rope_factors_short tensors, context_length
    the full context): max_model_len past the original context runs the long factors."""
    prompts, refs = long_context_refs
    path = tiny.write_gguf(long_context_model, tokenizer, model_dir / "long-context-f16.gguf", "phi3", f16=True)
    cfg, _ = load_model_weights(resolve_model(str(path)), torch.float32)
    assert cfg.max_position_embeddings == ORIG and cfg.longest_context == LONG
    llm, completions = tiny.run_vlite(path, prompts, max_model_len=LONG)
    print(tiny.assert_parity(completions, refs))


def test_unsupported_rope_scaling_refused(folder: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.pop("rope_parameters", None)
    config["rope_scaling"] = {"type": "dynamic", "factor": 4.0}
    with pytest.raises(ValueError, match="dynamic"):
        arch_from_hf_config(config)
