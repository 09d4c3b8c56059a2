"""PEFT adapters made by peft itself on a tiny Llama: vlite's loader and ops give the outputs of peft's LoRA
layers (float32, plain and rsLoRA, all or some modules, mixed in one batch with base rows); what vlite cannot
apply is refused with the adapter's path and the reason."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.lora.peft_models import ALL, fused_output, make_adapter
from tests.models import tiny
from vlite.lora.layout import PROJECTIONS, empty_slots, output_slices
from vlite.lora.ops import LoRAKernelMeta, add_lora_linear
from vlite.lora.peft_adapter import LoRAAdapterError, load_peft_adapter
from vlite.model_loader.hf_config import arch_from_hf_config

peft = pytest.importorskip("peft")
MAX_RANK = 8


@pytest.mark.parametrize("name, modules, scaling", [
    ("all", ALL, 8 / 4), ("rslora_qv", ["q_proj", "v_proj"], 16 / 8 ** 0.5),
    ("all_linear", ALL, 3 / 2), ("regex", ["k_proj", "down_proj"], 5 / 3)])
def test_one_adapter_matches_peft(name: str, modules: list[str], scaling: float, base: Any, cfg: Any,
                                  adapters: dict) -> None:
    folder, model = adapters[name]
    lora = load_peft_adapter(folder, cfg, MAX_RANK)
    assert lora.modules == tuple(sorted(modules)) and lora.scaling == pytest.approx(scaling)
    gen = torch.Generator().manual_seed(5)
    for layer in range(cfg.num_hidden_layers):
        for projection in PROJECTIONS:
            a, b = empty_slots(cfg, projection, 1, MAX_RANK)
            lora.fill_slot(layer, projection, a[0], b[0], MAX_RANK)
            x = torch.randn(6, a.shape[2], generator=gen)
            out = fused_output(base, layer, projection, cfg, x)
            add_lora_linear(out, x, LoRAKernelMeta.make(torch.zeros(6, dtype=torch.long)), a, b,
                            output_slices(cfg, projection, MAX_RANK))
            torch.testing.assert_close(out, fused_output(model, layer, projection, cfg, x), rtol=1e-5, atol=1e-5)


def test_mixed_batch_of_adapters_and_base_rows(base: Any, cfg: Any, adapters: dict) -> None:
    names = ["all", "rslora_qv", "regex"]
    loras = [load_peft_adapter(adapters[n][0], cfg, MAX_RANK) for n in names]
    mapping = torch.tensor([0, -1, 2, 1, 1, -1, 0, 2, 0, 1])
    meta = LoRAKernelMeta.make(mapping)
    gen = torch.Generator().manual_seed(7)
    for layer in range(cfg.num_hidden_layers):
        for projection in PROJECTIONS:
            a, b = empty_slots(cfg, projection, len(loras), MAX_RANK)
            for slot, lora in enumerate(loras):
                lora.fill_slot(layer, projection, a[slot], b[slot], MAX_RANK)
            x = torch.randn(len(mapping), a.shape[2], generator=gen)
            out = fused_output(base, layer, projection, cfg, x)
            expected = out.clone()
            for slot, n in enumerate(names):
                rows = mapping == slot
                expected[rows] = fused_output(adapters[n][1], layer, projection, cfg, x[rows])
            add_lora_linear(out, x, meta, a, b, output_slices(cfg, projection, MAX_RANK))
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_merged_weights_equal_peft_merge(base: Any, cfg: Any, adapters: dict) -> None:
    """W + B @ A (scaling in B) is the weight peft's merge_and_unload writes."""
    folder, model = adapters["all"]
    lora = load_peft_adapter(folder, cfg, MAX_RANK)
    merged = copy.deepcopy(model).merge_and_unload()
    for w in lora.layers[1]["qkv"]:
        base_w = getattr(base.model.layers[1].self_attn, w.module).weight
        torch.testing.assert_close(base_w + w.lora_b @ w.lora_a,
                                   getattr(merged.model.layers[1].self_attn, w.module).weight, rtol=1e-5, atol=1e-6)


def refused(folder: Path, cfg: Any, max_rank: int = MAX_RANK) -> str:
    with pytest.raises(LoRAAdapterError) as e:
        load_peft_adapter(folder, cfg, max_rank)
    assert str(folder) in str(e.value)
    return str(e.value)


def test_refusals(base: Any, cfg: Any, adapters: dict, tmp_path: Path) -> None:
    assert "rank 8 exceeds max_lora_rank (4)" in refused(adapters["rslora_qv"][0], cfg, max_rank=4)
    wide = dataclasses.replace(cfg, intermediate_size=256)
    assert "do not match the base model" in refused(adapters["all"][0], wide)

    make_adapter(base, tmp_path / "head", r=2, lora_alpha=2, target_modules=["q_proj", "lm_head"])
    assert "target module 'lm_head' is not supported" in refused(tmp_path / "head", cfg)
    make_adapter(base, tmp_path / "dora", r=2, lora_alpha=2, target_modules=["q_proj"], use_dora=True)
    assert "DoRA (use_dora=True) is not supported" in refused(tmp_path / "dora", cfg)
    make_adapter(base, tmp_path / "bias", r=2, lora_alpha=2, target_modules=["q_proj"], bias="all")
    assert "bias='all' is not supported" in refused(tmp_path / "bias", cfg)
    make_adapter(base, tmp_path / "save", r=2, lora_alpha=2, target_modules=["q_proj"], modules_to_save=["lm_head"])
    assert "modules_to_save" in refused(tmp_path / "save", cfg)
    # a regex target that reaches the LM head: refused through its tensors
    make_adapter(base, tmp_path / "regex_head", r=2, lora_alpha=2, target_modules=r".*(q_proj|lm_head)")
    message = refused(tmp_path / "regex_head", cfg)
    assert "module 'lm_head' (base_model.model.lm_head." in message and "is not supported" in message

    make_adapter(base, tmp_path / "rank", r=4, lora_alpha=4, target_modules=["q_proj"])
    config = json.loads((tmp_path / "rank" / "adapter_config.json").read_text())
    (tmp_path / "rank" / "adapter_config.json").write_text(json.dumps({**config, "r": 2}))
    assert "layer 0 q_proj: lora_A (4, 64) and lora_B (64, 4) do not match" in refused(tmp_path / "rank", cfg)

    (tmp_path / "missing").mkdir()
    assert "adapter_config.json not found" in refused(tmp_path / "missing", cfg)
    make_adapter(base, tmp_path / "no_weights", r=2, lora_alpha=2, target_modules=["q_proj"])
    (tmp_path / "no_weights" / "adapter_model.safetensors").unlink()
    assert "adapter_model.safetensors not found" in refused(tmp_path / "no_weights", cfg)


def test_fused_checkpoint_modules(tmp_path: Path) -> None:
    """Phi-3 stores qkv_proj and gate_up_proj fused: one A per fused projection, B over all its rows."""
    from transformers import Phi3Config, Phi3ForCausalLM

    phi3 = tiny.build(Phi3Config, Phi3ForCausalLM, pad_token_id=0)
    cfg = arch_from_hf_config(phi3.config.to_dict())
    assert cfg.fused_checkpoint
    model = make_adapter(phi3, tmp_path / "phi3", r=4, lora_alpha=4, target_modules="all-linear")
    lora = load_peft_adapter(tmp_path / "phi3", cfg, MAX_RANK)
    assert lora.modules == ("down_proj", "gate_up_proj", "o_proj", "qkv_proj")
    gen = torch.Generator().manual_seed(3)
    for projection in PROJECTIONS:
        a, b = empty_slots(cfg, projection, 2, MAX_RANK)
        lora.fill_slot(1, projection, a[1], b[1], MAX_RANK)
        x = torch.randn(4, a.shape[2], generator=gen)
        out = fused_output(phi3, 1, projection, cfg, x)
        expected = torch.cat([out[:2], fused_output(model, 1, projection, cfg, x[2:])])
        add_lora_linear(out, x, LoRAKernelMeta.make(torch.tensor([-1, -1, 1, 1])), a, b,
                        output_slices(cfg, projection, MAX_RANK))
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
