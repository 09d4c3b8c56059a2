"""Load a Hugging Face-format model folder (config.json + *.safetensors, sharded or not)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from vlite.model_arch import ModelArchConfig, expected_weight_names, ignored_weight_names
from vlite.model_loader.hf_config import arch_from_hf_config

_INDEX_FILE = "model.safetensors.index.json"
# Buffers some older checkpoints saved; the engine recomputes them.
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


def _read_json(path: Path) -> dict[str, Any] | None:
    """Parsed JSON file, or None if it does not exist."""
    if not path.is_file():
        return None
    with path.open(encoding="utf-8") as f:
        return json.load(f)


def _safetensors_files(folder: Path) -> list[Path]:
    """Checkpoint shards to read.

    With an index file only the shards it names are used, so stray files such as
    Mistral's ``consolidated.safetensors`` are not mixed in.
    """
    index = _read_json(folder / _INDEX_FILE)
    if index is not None:
        names = sorted(set(index["weight_map"].values()))
        return [folder / n for n in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder}: no *.safetensors files found")
    return files


def load_hf_folder(path: Path, dtype: torch.dtype) -> tuple[ModelArchConfig, dict[str, torch.Tensor]]:
    """Read config and weights (cast to ``dtype``) from a Hugging Face model folder."""
    config, tensors = iter_hf_folder(path, dtype)
    weights = dict(tensors)
    missing = sorted(expected_weight_names(config) - weights.keys())
    if missing:
        raise ValueError(f"{path}: missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    return config, weights


def hf_folder_arch(path: Path) -> ModelArchConfig:
    """The folder's config (config.json, generation_config.json), without reading any weight."""
    path = Path(path)
    hf_config = _read_json(path / "config.json")
    if hf_config is None:
        raise ValueError(f"{path}: config.json not found")
    return arch_from_hf_config(hf_config, _read_json(path / "generation_config.json"))


def iter_hf_folder(path: Path, dtype: torch.dtype) -> tuple[ModelArchConfig, Iterator[tuple[str, torch.Tensor]]]:
    """The folder's config, and its weights one at a time (a tensor-parallel rank keeps only its shard)."""
    config = hf_folder_arch(path)
    return config, _hf_tensors(Path(path), config, dtype)


def _hf_tensors(path: Path, config: ModelArchConfig, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    expected = expected_weight_names(config)
    transform = None
    if config.is_causal:
        from vlite.models.registry import spec_for

        transform = spec_for(config.architecture).hf_tensor_transform or None
    if transform is None:
        tensors = ((name, read().to(dtype)) for name, read in _stored_tensors(path, config))
    else:  # the family's own layout (gpt-oss: stacked, maybe MXFP4 experts) -> the shared names
        import importlib

        module, _, function = transform.partition(":")
        tensors = getattr(importlib.import_module(module), function)(_stored_tensors(path, config), config, dtype)
    for name, tensor in tensors:
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # tied: the engine reuses the embedding
        if name not in expected:
            raise ValueError(f"{path}: unexpected tensor {name!r} for a {config.architecture} checkpoint")
        yield name, tensor


def _stored_tensors(path: Path, config: ModelArchConfig) -> Iterator[tuple[str, Callable[[], torch.Tensor]]]:
    """Each stored tensor the model may use, under its (renamed) name, with a function that reads it."""
    from safetensors import safe_open

    ignored = ignored_weight_names(config)
    rename = None
    if not config.is_causal:  # encoders: `bert.`-prefixed task models, unused buffers and heads
        from vlite.model_loader.encoder_config import checkpoint_name as rename
    else:
        from vlite.models.registry import spec_for

        spec = spec_for(config.architecture)
        if spec.hf_renames or spec.hf_skipped:
            rename = lambda stored, _config: _text_model_name(stored, spec.hf_renames, spec.hf_skipped)  # noqa: E731
    for file in _safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            for stored in f.keys():
                name = rename(stored, config) if rename else stored
                if name is None or _IGNORED.search(name) or name in ignored:
                    continue
                yield name, (lambda f=f, stored=stored: f.get_tensor(stored))


def _text_model_name(stored: str, renames: tuple[tuple[str, str], ...], skipped: tuple[str, ...]) -> str | None:
    """A text model's name for a stored tensor (its prefix renamed), or None for a part it does not use."""
    if stored.startswith(skipped):
        return None
    for old, new in renames:
        if stored.startswith(old):
            return new + stored[len(old):]
    return stored
