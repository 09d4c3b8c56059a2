"""The tiny-model fixtures of the per-architecture tests (tokenizer, prompts, references, folder)."""

from tests.models.conftest import folder, model_dir, prompt_ids, refs, tokenizer  # noqa: F401
