"""On-disk cache of converted GGUF models, so later starts skip parsing and dequantizing.

A GGUF load converts the tensors vlite does not keep in their blocks, and transformers builds the
tokenizer from ~100k-400k metadata strings (seconds for a Llama 3 vocabulary). The result is stored
once as safetensors (dense tensors in the target dtype, packed ones as their qs/scales/mins parts)
plus a saved fast tokenizer, keyed by the file's path, size, mtime and the dtype. Weights kept in the file's own
blocks (Q4_0, K-quants) are not copied: the entry records where they are in the GGUF file, which is
mapped (read-only) at the next start, so the cache holds no second copy of them.
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
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

from vlite.model_arch import ModelArchConfig

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

_FORMAT_VERSION = 7  # 2: arch_config.json has source_quantization; 3: packed tensors; 4: model families, features;
# 5: GGUF end-of-turn EOS ids (Gemma 3), family chat templates where the file has none; 6: Q4_0/K-quants in
# the file's own blocks (packed tensors without scales); 7: those by their offset in the GGUF file, not copied


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
        except BaseException:  # a bad file: no half-written folder left behind
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    except OSError as e:
        logger.debug("could not write the model cache at %s: %s", entry, e)


_PARTS = ("qs", "scales", "mins")


def _flatten(weights: dict[str, Any], source: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Packed tensors become NAME::qs / ::scales / ::mins entries, their layout the metadata; those still
    the GGUF file's own bytes (views of its map) are recorded by their offset in it, not copied."""
    from vlite.layers import weight_arena
    from vlite.layers.packed import PackedTensors

    tensors, layouts = {}, {}
    for name, w in weights.items():
        if isinstance(w, PackedTensors):
            where = weight_arena.file_offset(w.qs) if w.compact and w.qs.is_contiguous() else None
            if where is not None and where[0] == os.path.realpath(source):
                layouts[name] = json.dumps({"fmt": w.fmt, "sub": w.sub, "offset": where[1], "shape": list(w.qs.shape)})
                continue
            for part in _PARTS:
                if getattr(w, part) is not None:
                    tensors[f"{name}::{part}"] = getattr(w, part).contiguous()
            layouts[name] = json.dumps({"fmt": w.fmt, "sub": w.sub})
        else:
            tensors[name] = w.contiguous()
    return tensors, layouts


class _SourceMap:
    """The GGUF file mapped once (read-only) for the cache entries that point into it."""

    def __init__(self, source: Path) -> None:
        self.source = source
        self._map: Any = None

    def view(self, spec: dict[str, Any]) -> torch.Tensor:
        import numpy as np

        from vlite.layers import weight_arena
        from vlite.model_loader.gguf_quants import readonly_view

        if self._map is None:
            self._map = np.memmap(self.source, mode="r")
            weight_arena.register_file_map(self._map, str(self.source))
        rows, cols = spec["shape"]
        start = spec["offset"]
        if start < 0 or start + rows * cols > self._map.size:
            raise ValueError(f"cache entry points past the end of {self.source}")
        return readonly_view(self._map[start:start + rows * cols].reshape(rows, cols))


_SAFETENSORS_DTYPES = {"U8": "uint8", "I8": "int8", "I16": "int16", "I32": "int32", "I64": "int64", "F16": "float16",
                       "BF16": "bfloat16", "F32": "float32", "F64": "float64", "BOOL": "bool"}


def _mapped_safetensors(path: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A cache entry's tensors as views of one (copy-on-write) memory map of its safetensors file, registered with the
    weight arena: packed weights stored here (GGUF Q/K rows reordered for rotary: 189 MB for the 3B shape) give
    their pages back once tiled, as the GGUF file's own do (safetensors' reader kept them resident)."""
    import numpy as np
    import torch

    from vlite.layers import weight_arena
    from vlite.model_loader.gguf_quants import readonly_view

    data = np.memmap(path, mode="c")  # copy-on-write, as safetensors' own map: a model may adjust a weight in place
    size = int.from_bytes(data[:8].tobytes(), "little")
    if not 0 < size <= data.size - 8:
        raise ValueError(f"{path}: not a safetensors file (header size {size})")
    header = json.loads(data[8:8 + size].tobytes())
    metadata = header.pop("__metadata__", None) or {}
    weight_arena.register_file_map(data, path)
    out = {}
    for name, info in header.items():
        dtype = getattr(torch, _SAFETENSORS_DTYPES[info["dtype"]])
        lo, hi = info["data_offsets"]
        if not 0 <= lo <= hi <= data.size - 8 - size:
            raise ValueError(f"{path}: tensor {name} lies past the end of the file")
        raw = data[8 + size + lo:8 + size + hi]
        if (8 + size + lo) % torch.empty((), dtype=dtype).element_size():
            raw = np.array(raw)  # unaligned for its dtype (safetensors aligns them): a copy
        out[name] = readonly_view(raw).view(dtype).reshape(info["shape"])
    return out, metadata


def _packed(spec: dict[str, Any], get: Callable[[str], Any], source: _SourceMap) -> Any:
    from vlite.layers.packed import PackedTensors

    if "offset" in spec:
        return PackedTensors(spec["fmt"], source.view(spec), None, None, spec["sub"])
    return PackedTensors(spec["fmt"], get("qs"), get("scales"), get("mins"), spec["sub"])


def _unflatten(tensors: dict[str, torch.Tensor], layouts: dict[str, str], source: Path) -> dict[str, Any]:
    weights: dict[str, Any] = {k: v for k, v in tensors.items() if "::" not in k}
    mapped = _SourceMap(source)
    for name, layout in layouts.items():
        weights[name] = _packed(json.loads(layout), lambda p, n=name: tensors.get(f"{n}::{p}"), mapped)
    return weights


def _read_arch(entry: Path) -> ModelArchConfig:
    """A cache entry's config (raises OSError, ValueError, TypeError or KeyError where unreadable)."""
    config = json.loads((entry / "arch_config.json").read_text())
    config["eos_token_ids"] = tuple(config["eos_token_ids"])
    return ModelArchConfig(**config)


def cached_arch(source: Path) -> Optional[ModelArchConfig]:
    """The config a conversion cache of `source` recorded, in whichever dtype there is one (what does
    not depend on the dtype, such as the weights' GGUF type, is known before the weights load)."""
    for tag in ("bfloat16", "float32"):
        entry = _entry(source, tag)
        if entry is None:
            return None
        try:
            return _read_arch(entry)
        except (OSError, ValueError, TypeError, KeyError):
            continue
    return None


def cached_gguf_weights(source: Path, dtype: torch.dtype,
                        load: Callable[[], tuple[ModelArchConfig, dict[str, Any]]]
                        ) -> tuple[ModelArchConfig, dict[str, Any]]:
    from safetensors.torch import save_file

    entry = _entry(source, str(dtype).replace("torch.", ""))
    if entry is not None and (entry / "model.safetensors").exists():
        try:
            arch = _read_arch(entry)
            return arch, _unflatten(*_mapped_safetensors(str(entry / "model.safetensors")), source)
        except (OSError, ValueError, TypeError, KeyError) as e:
            logger.debug("ignoring unreadable model cache %s: %s", entry, e)
    arch, weights = load()
    if entry is not None:
        def write(d: Path) -> None:
            (d / "arch_config.json").write_text(json.dumps(dataclasses.asdict(arch)))
            tensors, layouts = _flatten(weights, source)
            save_file(tensors, str(d / "model.safetensors"), metadata=layouts)

        _store(entry, write)
    return arch, weights


def cached_gguf_stream(source: Path, dtype: torch.dtype) -> Optional[tuple[ModelArchConfig, Iterator[tuple[str, Any]]]]:
    """The cached conversion's config and its weights one at a time (each read from the file when
    its turn comes), or None where there is no readable entry."""
    entry = _entry(source, str(dtype).replace("torch.", ""))
    if entry is None or not (entry / "model.safetensors").exists():
        return None
    try:
        arch = _read_arch(entry)
        stored, layouts = _mapped_safetensors(str(entry / "model.safetensors"))
    except (OSError, ValueError, TypeError, KeyError) as e:
        logger.debug("ignoring unreadable model cache %s: %s", entry, e)
        return None

    def tensors() -> Iterator[tuple[str, Any]]:
        mapped = _SourceMap(source)
        for name in list(stored):
            base, _, part = name.partition("::")
            if not part:
                yield name, stored.pop(name)
            elif part == "qs":
                yield base, _packed(json.loads(layouts[base]), lambda p, b=base: stored.pop(f"{b}::{p}", None), mapped)
        for name, layout in layouts.items():  # the GGUF file's own blocks, by offset
            spec = json.loads(layout)
            if "offset" in spec:
                yield name, _packed(spec, lambda p: None, mapped)

    return arch, tensors()


def cached_gguf_tokenizer(source: Path, write: Callable[[Path], None]) -> Any:
    """The tokenizer of GGUF file `source`, from its cache entry; `write(folder)` fills one when there is none
    (where the cache is off or unwritable, a temporary folder)."""
    entry = _entry(source, "tokenizer")
    if entry is not None and (entry / "tokenizer_config.json").exists():
        try:
            return _saved_tokenizer(entry)
        except (OSError, ValueError, TypeError) as e:
            logger.debug("ignoring unreadable tokenizer cache %s: %s", entry, e)
    if entry is not None:
        _store(entry, write)
        if (entry / "tokenizer_config.json").exists():
            return _saved_tokenizer(entry)
    with tempfile.TemporaryDirectory(prefix="vlite-tokenizer-") as folder:
        write(Path(folder))
        return _saved_tokenizer(Path(folder))


# bookkeeping keys save_pretrained writes that are not constructor arguments of the tokenizer
_NOT_INIT_KWARGS = ("added_tokens_decoder", "tokenizer_class", "backend", "is_local", "local_files_only",
                    "name_or_path")


def _saved_tokenizer(entry: Path) -> Any:
    """A saved fast tokenizer, built from its tokenizer.json and config directly.

    `from_pretrained` would make an `AddedToken` of every added token and deep-copy them all: seconds for a
    vocabulary padded with tens of thousands of control tokens (Llama 3 shapes). The fast-tokenizer class
    itself: AutoTokenizer imports torch (via transformers' config classes), which the API server process
    otherwise never loads."""
    from transformers import PreTrainedTokenizerFast

    config = json.loads((entry / "tokenizer_config.json").read_text())
    for key in _NOT_INIT_KWARGS:
        config.pop(key, None)
    template = entry / "chat_template.jinja"
    if template.exists() and "chat_template" not in config:
        config["chat_template"] = template.read_text()
    return PreTrainedTokenizerFast(tokenizer_file=str(entry / "tokenizer.json"), **config)
