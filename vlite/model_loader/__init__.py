"""Model location, architecture config, weights and tokenizer loading."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from vlite.model_arch import LlamaArchConfig, ModelArchConfig
from vlite.model_loader.resolve import ResolvedModel, default_model_path, resolve_model
from vlite.model_loader.tokenizer import load_tokenizer

if TYPE_CHECKING:
    import torch

__all__ = [
    "LlamaArchConfig",
    "ModelArchConfig",
    "ResolvedModel",
    "default_model_path",
    "gguf_linear_type",
    "iter_model_weights",
    "load_model_arch",
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


def gguf_linear_type(resolved: ResolvedModel) -> str | None:
    """The GGUF type of a GGUF model's linear weights ("Q4_1", "mixed", "F16", ...); None for a
    Hugging Face folder. From the conversion cache where there is one, else the file's header."""
    if resolved.gguf_file is None:
        return None
    from vlite.model_loader.cache import cached_arch
    from vlite.model_loader.gguf_loader import gguf_arch

    path = Path(resolved.gguf_file)
    return (cached_arch(path) or gguf_arch(path)).source_quantization


def load_model_arch(resolved: ResolvedModel, dtype: torch.dtype) -> ModelArchConfig:
    """The model's config without its weights (the engine core of a multi-process executor sizes the
    KV cache from it; the workers load the weights)."""
    if resolved.gguf_file is not None:
        from vlite.model_loader.cache import cached_gguf_stream
        from vlite.model_loader.gguf_loader import gguf_arch

        cached = cached_gguf_stream(Path(resolved.gguf_file), dtype)
        return cached[0] if cached is not None else gguf_arch(Path(resolved.gguf_file))
    from vlite.model_loader.safetensors_loader import hf_folder_arch

    return hf_folder_arch(Path(resolved.path))


def iter_model_weights(resolved: ResolvedModel, dtype: torch.dtype
                       ) -> tuple[ModelArchConfig, Iterator[tuple[str, Any]]]:
    """Config and HF-named weights one at a time: a tensor-parallel rank keeps only its shard of each,
    so the whole model is never in one process (the GGUF conversion cache is read where it exists)."""
    if resolved.gguf_file is not None:
        from vlite.model_loader.cache import cached_gguf_stream
        from vlite.model_loader.gguf_loader import iter_gguf

        path = Path(resolved.gguf_file)
        return cached_gguf_stream(path, dtype) or iter_gguf(path, dtype)
    from vlite.model_loader.safetensors_loader import iter_hf_folder

    return iter_hf_folder(Path(resolved.path), dtype)
