"""On-disk cache of converted GGUF models, so later starts skip parsing and dequantizing.

A GGUF load parses ~100k metadata entries and dequantizes every tensor (several seconds, twice:
once for the weights, once for the tokenizer). The result is stored once as safetensors in the
target dtype plus a saved fast tokenizer, keyed by the file's path, size, mtime and the dtype.
Any failure to read or write the cache falls back to the normal load.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from vlite.model_loader.arch_config import LlamaArchConfig

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

_FORMAT_VERSION = 2  # 2: arch_config.json has source_quantization


def cache_root() -> Optional[Path]:
    """VLITE_CACHE_DIR, else ~/.cache/vlite; VLITE_CACHE_DIR=off disables the cache."""
    env = os.environ.get("VLITE_CACHE_DIR")
    if env is not None and env.strip().lower() in ("", "0", "off", "none"):
        return None
    return Path(env) if env else Path.home() / ".cache" / "vlite"


def _entry(source: Path, tag: str) -> Optional[Path]:
    root = cache_root()
    if root is None:
        return None
    st = source.stat()
    key = f"{_FORMAT_VERSION}|{source.resolve()}|{st.st_size}|{st.st_mtime_ns}|{tag}"
    return root / f"{source.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}-{tag}"


def _store(entry: Path, write: Callable[[Path], None]) -> None:
    """Write into a temporary folder, then rename, so readers never see half an entry."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=entry.parent, prefix=".tmp-"))
        try:
            write(tmp)
            os.replace(tmp, entry)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            if not entry.exists():
                raise
    except OSError as e:
        logger.debug("could not write the model cache at %s: %s", entry, e)


def cached_gguf_weights(source: Path, dtype: torch.dtype,
                        load: Callable[[], tuple[LlamaArchConfig, dict[str, torch.Tensor]]]
                        ) -> tuple[LlamaArchConfig, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file, save_file

    entry = _entry(source, str(dtype).replace("torch.", ""))
    if entry is not None and (entry / "model.safetensors").exists():
        try:
            config = json.loads((entry / "arch_config.json").read_text())
            config["eos_token_ids"] = tuple(config["eos_token_ids"])
            return LlamaArchConfig(**config), load_file(str(entry / "model.safetensors"))
        except (OSError, ValueError, TypeError, KeyError) as e:
            logger.debug("ignoring unreadable model cache %s: %s", entry, e)
    arch, weights = load()
    if entry is not None:
        def write(d: Path) -> None:
            (d / "arch_config.json").write_text(json.dumps(dataclasses.asdict(arch)))
            save_file({k: v.contiguous() for k, v in weights.items()}, str(d / "model.safetensors"))

        _store(entry, write)
    return arch, weights


def cached_gguf_tokenizer(source: Path, load: Callable[[], Any]) -> Any:
    # The fast-tokenizer class directly: AutoTokenizer imports torch (via transformers' config
    # classes), which the API server process otherwise never loads.
    from transformers import PreTrainedTokenizerFast

    entry = _entry(source, "tokenizer")
    if entry is not None and (entry / "tokenizer_config.json").exists():
        try:
            return PreTrainedTokenizerFast.from_pretrained(str(entry))
        except (OSError, ValueError) as e:
            logger.debug("ignoring unreadable tokenizer cache %s: %s", entry, e)
    tokenizer = load()
    if entry is not None:
        _store(entry, lambda d: tokenizer.save_pretrained(str(d)))
    return tokenizer
