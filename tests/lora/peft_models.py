"""PEFT adapters made by peft itself for the LoRA tests (random, non-zero B: peft starts B at zero)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base: Any, folder: Path, seed: int = 0, scale: float = 0.2, **lora: Any) -> Any:
    """peft's LoRA model over a copy of `base`, B random non-zero (N(0, scale)), saved to `folder`."""
    import peft

    lora.setdefault("lora_dropout", 0.0)
    torch.manual_seed(seed)  # peft draws A from torch's global generator
    model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(**lora)).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
    model.save_pretrained(folder)
    return model


def fused_output(model: Any, layer: int, projection: str, cfg: Any, x: torch.Tensor) -> torch.Tensor:
    """The output of vlite's fused projection computed by `model`'s own modules (peft's or the base's)."""
    from vlite.lora.layout import projection_modules

    block = model.get_decoder().layers[layer]
    with torch.no_grad():
        return torch.cat([getattr(getattr(block, m.parent), m.name)(x) for m in projection_modules(cfg, projection)],
                         dim=-1)
