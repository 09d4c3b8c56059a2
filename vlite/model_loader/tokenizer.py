"""Tokenizer for a resolved model, always a transformers fast tokenizer."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from vlite.model_loader.gguf_reader import transformers_metadata
from vlite.model_loader.resolve import ResolvedModel


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Silence transformers' info/warning chatter and progress bars for one call."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


def _gguf_chat_template(fields: dict[str, Any]) -> str | None:
    """The ``tokenizer.chat_template`` metadata string of a GGUF header's `fields`, else its family's own template
    where vlite knows one (`chat_templates.FAMILY_CHAT_TEMPLATES`: files of base checkpoints carry none)."""
    from vlite.model_loader.chat_templates import FAMILY_CHAT_TEMPLATES

    field = fields.get("tokenizer.chat_template")
    if field is not None:
        return field.contents()
    arch = fields.get("general.architecture")
    return None if arch is None else FAMILY_CHAT_TEMPLATES.get(arch.contents())


def load_tokenizer(resolved: ResolvedModel) -> Any:
    """Load the model's tokenizer (a ``PreTrainedTokenizerFast``) with its chat template.

    For GGUF sources the tokenizer is transformers' conversion of the file's metadata, written once as
    tokenizer.json into the model cache and read from there (the first start and later ones give the same
    object); if transformers leaves ``chat_template`` unset, the template is read from the file here (or,
    where the file has none, its family's: Gemma 3) so chat requests keep working.
    """
    if resolved.gguf_file is None:
        with _quiet_transformers():
            return _folder_tokenizer_class(resolved.path).from_pretrained(str(resolved.path))
    from vlite.model_loader.cache import cached_gguf_tokenizer

    gguf_file = resolved.gguf_file
    with _quiet_transformers():
        return cached_gguf_tokenizer(gguf_file, lambda folder: write_gguf_tokenizer(gguf_file, folder))


def _folder_tokenizer_class(folder: Path) -> Any:
    """The class tokenizer_config.json names (its fast variant first, as AutoTokenizer picks), else AutoTokenizer.
    AutoTokenizer's module imports transformers' model configurations and with them torch, which the API
    server's process never loads."""
    import transformers

    try:
        name = json.loads((folder / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        name = None
    if isinstance(name, str) and name:
        for candidate in (name if name.endswith("Fast") else name + "Fast", name):
            try:
                cls = getattr(transformers, candidate, None)
            except Exception:  # a lazily imported class whose backend is missing
                cls = None
            if isinstance(cls, type) and hasattr(cls, "from_pretrained"):
                return cls
    from transformers import AutoTokenizer

    return AutoTokenizer


_patch_lock = threading.Lock()


def write_gguf_tokenizer(path: Path, folder: Path) -> None:
    """Write the tokenizer of GGUF file `path` into `folder` (tokenizer.json, tokenizer_config.json).

    It is what ``AutoTokenizer.from_pretrained(..., gguf_file=...)`` builds: transformers' own
    `get_gguf_tokenizer` (which keys of the file are the vocabulary, merges, special tokens and flags, with its
    per-family rules) and `convert_gguf_tokenizer`. Only the metadata comes from vlite's header reader instead of
    transformers' (1.6 s for a 128k vocabulary against 0.2 s), and the result is saved by `tokenizers` itself
    rather than ``save_pretrained`` (which makes an ``AddedToken`` of every added token)."""
    from vlite.model_loader.gguf_loader import open_gguf

    try:
        import transformers.integrations.gguf.reader as hf_reader
        from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer
    except ImportError:  # an older transformers: AutoTokenizer's own load of the file, saved as it saves it
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        if not getattr(tokenizer, "chat_template", None):
            tokenizer.chat_template = _gguf_chat_template(open_gguf(path).fields)
        tokenizer.save_pretrained(str(folder))
        return
    reader = open_gguf(path)
    fields = reader.fields

    def read_gguf_metadata(gguf_path: str, string_arrays: Any = ()) -> tuple[dict, tuple[str, ...]]:
        return transformers_metadata(fields, string_arrays), tuple(t.name for t in reader.tensors)

    with _patch_lock:
        original = hf_reader.read_gguf_metadata
        hf_reader.read_gguf_metadata = read_gguf_metadata
        try:
            architecture, tokenizer_dict, config = get_gguf_tokenizer(str(path))
        finally:
            hf_reader.read_gguf_metadata = original
    fast, extra = convert_gguf_tokenizer(architecture, tokenizer_dict)
    config.update(extra)
    for name, default in _class_special_tokens(fields).items():
        config.setdefault(name, default)
    if not config.get("chat_template"):
        config.pop("chat_template", None)
        template = _gguf_chat_template(fields)
        if template:
            config["chat_template"] = template
    fast.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


_SPECIAL_TOKEN_ARGS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _class_special_tokens(fields: dict[str, Any]) -> dict[str, Any]:
    """The special tokens the tokenizer class AutoTokenizer picks for the file's architecture sets by default
    (Gemma's ``<mask>``): its constructor's defaults, which the file's own tokens override."""
    import inspect

    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES, tokenizer_class_from_name

    arch = fields.get("general.architecture")
    class_name = TOKENIZER_MAPPING_NAMES.get(arch.contents()) if arch is not None else None
    if isinstance(class_name, tuple):  # (slow, fast) names
        class_name = class_name[-1] or class_name[0]
    cls = tokenizer_class_from_name(class_name) if class_name else None
    if cls is None:
        return {}
    params = inspect.signature(cls.__init__).parameters
    return {name: params[name].default for name in _SPECIAL_TOKEN_ARGS
            if name in params and isinstance(params[name].default, str)}
