"""Model location, architecture config, weights and tokenizer loading."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from vlite.model_loader.arch_config import LlamaArchConfig, ModelArchConfig
from vlite.model_loader.resolve import ResolvedModel, default_model_path, resolve_model
from vlite.model_loader.tokenizer import load_tokenizer

if TYPE_CHECKING:
    import torch

__all__ = [
    "LlamaArchConfig",
    "ModelArchConfig",
    "ResolvedModel",
    "default_model_path",
    "load_model_weights",
    "load_tokenizer",
    "resolve_model",
]


def load_model_weights(
    resolved: ResolvedModel, dtype: torch.dtype
) -> tuple[ModelArchConfig, dict[str, torch.Tensor]]:
    """Config and HF-named weights (cast to ``dtype``) of a resolved model, GGUF or safetensors."""
    if resolved.gguf_file is not None:
        from vlite.model_loader.cache import cached_gguf_weights
        from vlite.model_loader.gguf_loader import load_gguf

        path = Path(resolved.gguf_file)
        return cached_gguf_weights(path, dtype, lambda: load_gguf(path, dtype))
    from vlite.model_loader.safetensors_loader import load_hf_folder

    return load_hf_folder(Path(resolved.path), dtype)
