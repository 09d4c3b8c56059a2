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


def test_cache_roundtrip(tmp_path, monkeypatch):
    resolved = resolve_model(None)
    monkeypatch.setenv("VLITE_CACHE_DIR", "off")
    arch0, w0 = load_model_weights(resolved, torch.float32)
    tok0 = load_tokenizer(resolved)
    monkeypatch.setenv("VLITE_CACHE_DIR", str(tmp_path))
    for _ in range(2):  # first call fills the cache, second reads it
        arch, w = load_model_weights(resolved, torch.float32)
        tok = load_tokenizer(resolved)
        assert arch == arch0
        assert w.keys() == w0.keys() and all(same(w[k], w0[k]) for k in w0)
        assert isinstance(w["model.layers.0.mlp.down_proj.weight"], PackedTensors)  # Q4_1 blocks kept
        for text in TEXTS:
            assert tok.encode(text) == tok0.encode(text)
            ids = tok0.encode(text)
            assert tok.decode(ids) == tok0.decode(ids)
            assert tok.decode(ids, skip_special_tokens=True) == tok0.decode(ids, skip_special_tokens=True)
        assert tok.chat_template == tok0.chat_template
        assert (tok.eos_token_id, tok.bos_token_id) == (tok0.eos_token_id, tok0.bos_token_id)
        assert tok.all_special_ids == tok0.all_special_ids
    assert len(list(tmp_path.iterdir())) == 2
