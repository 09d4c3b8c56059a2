"""The converted-model cache returns exactly what a fresh GGUF load returns."""

from __future__ import annotations

import torch

from vlite.layers.packed import PackedTensors
from vlite.model_loader import load_model_weights, load_tokenizer, resolve_model


def same(a, b) -> bool:
    if isinstance(a, PackedTensors):
        return isinstance(b, PackedTensors) and (a.fmt, a.sub) == (b.fmt, b.sub) and all(
            (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
            for x, y in ((a.qs, b.qs), (a.scales, b.scales), (a.mins, b.mins)))
    return torch.equal(a, b)

TEXTS = ["Hello, world!", "  leading spaces and\ttabs\n", "héllo 世界 🤖", "<|im_start|>user\nhi<|im_end|>"]


def same_tokenizer(tok, ref) -> None:
    for text in TEXTS:
        assert tok.encode(text) == ref.encode(text)
        ids = ref.encode(text)
        assert tok.decode(ids) == ref.decode(ids)
        assert tok.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
    assert tok.chat_template == ref.chat_template
    messages = [{"role": "user", "content": "hi"}]
    assert (tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    ids = ("eos_token_id", "bos_token_id", "pad_token_id")
    assert [getattr(tok, i) for i in ids] == [getattr(ref, i) for i in ids]
    assert tok.all_special_ids == ref.all_special_ids and tok.special_tokens_map == ref.special_tokens_map
    assert tok.added_tokens_decoder == ref.added_tokens_decoder and tok.get_vocab() == ref.get_vocab()


def test_cache_roundtrip(tmp_path, monkeypatch, hf_tokenizer):
    resolved = resolve_model(None)
    monkeypatch.setenv("VLITE_CACHE_DIR", "off")
    arch0, w0 = load_model_weights(resolved, torch.float32)
    tok0 = load_tokenizer(resolved)
    monkeypatch.setenv("VLITE_CACHE_DIR", str(tmp_path))
    same_tokenizer(tok0, hf_tokenizer)  # vlite's GGUF tokenizer load is AutoTokenizer's, without its second parse
    for _ in range(2):  # first call fills the cache, second reads it
        arch, w = load_model_weights(resolved, torch.float32)
        tok = load_tokenizer(resolved)
        assert arch == arch0
        assert w.keys() == w0.keys() and all(same(w[k], w0[k]) for k in w0)
        assert isinstance(w["model.layers.0.mlp.down_proj.weight"], PackedTensors)  # Q4_1 blocks kept
        same_tokenizer(tok, tok0)
    assert len(list(tmp_path.iterdir())) == 2
