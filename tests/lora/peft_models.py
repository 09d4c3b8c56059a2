"""PEFT adapters made by peft itself for the LoRA tests (random, non-zero B: peft starts B at zero)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch


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
