"""Tokenizer for a resolved model, always a transformers fast tokenizer."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

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

    For GGUF sources transformers rebuilds the tokenizer from the file's metadata;
    if it leaves ``chat_template`` unset, the template is read from the file here
    (or, where the file has none, its family's: Gemma 3) so chat requests keep working.
    """
    if resolved.gguf_file is None:
        from transformers import AutoTokenizer

        with _quiet_transformers():
            return AutoTokenizer.from_pretrained(str(resolved.path))
    from vlite.model_loader.cache import cached_gguf_tokenizer

    with _quiet_transformers():
        return cached_gguf_tokenizer(resolved.gguf_file, lambda: _load_gguf_tokenizer(resolved))


def _load_gguf_tokenizer(resolved: ResolvedModel) -> Any:
    """The tokenizer transformers builds from the file's tokenizer.ggml.* metadata, in the class AutoTokenizer
    would pick for the architecture (the generic fast class where it has none). Not AutoTokenizer itself: it
    parses the whole file again with gguf's reader to build a model config (seconds for a 128k vocabulary)."""
    from transformers import PreTrainedTokenizerFast
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES, tokenizer_class_from_name

    from vlite.model_loader.gguf_loader import open_gguf

    assert resolved.gguf_file is not None
    fields = open_gguf(resolved.gguf_file).fields
    arch = fields.get("general.architecture")
    class_name = TOKENIZER_MAPPING_NAMES.get(arch.contents()) if arch is not None else None
    cls = (tokenizer_class_from_name(class_name) if class_name else None) or PreTrainedTokenizerFast
    tokenizer = cls.from_pretrained(str(resolved.path), gguf_file=resolved.gguf_file.name)
    if not getattr(tokenizer, "chat_template", None):
        template = _gguf_chat_template(fields)
        if template:
            tokenizer.chat_template = template
    return tokenizer
