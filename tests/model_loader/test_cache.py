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


def _mapped_rss(path) -> int:
    """Bytes of `path`'s mappings resident in this process."""
    total, current = 0, None
    for line in open("/proc/self/smaps"):
        head = line.split()
        if head and "-" in head[0] and ":" not in head[0]:
            current = head[5] if len(head) > 5 else None
        elif head and head[0] == "Rss:" and current == str(path):
            total += int(head[1]) * 1024
    return total


def test_cache_file_tensors_are_mapped_and_give_their_pages_back(tmp_path):
    """A cache entry's tensors are views of one map of its file (any dtype, read back equal and writable, as
    safetensors' own copy-on-write map gives them); a packed weight's pages leave the process once it is tiled
    (weight_arena.release_file_pages), as the GGUF file's own do."""
    from safetensors.torch import save_file

    from vlite.layers import weight_arena
    from vlite.model_loader.cache import _mapped_safetensors

    path = tmp_path / "model.safetensors"
    big = torch.randint(0, 256, (1024, 4096), dtype=torch.uint8)
    small = {"norm": torch.randn(7), "half": torch.randn(3, 5).bfloat16(), "idx": torch.arange(9)}
    save_file({"w::qs": big, **small}, str(path), metadata={"w": "{}"})
    tensors, metadata = _mapped_safetensors(str(path))
    assert metadata == {"w": "{}"} and set(tensors) == {"w::qs", *small}
    for name, t in small.items():
        assert torch.equal(tensors[name], t) and tensors[name].dtype == t.dtype
    tensors["norm"].add_(1)  # copy-on-write: the file is not changed
    assert torch.equal(_mapped_safetensors(str(path))[0]["norm"], small["norm"])
    assert torch.equal(tensors["w::qs"], big) and _mapped_rss(path) >= big.numel() * 0.9
    weight_arena.release_file_pages(tensors["w::qs"])
    assert _mapped_rss(path) <= 16 * 1024
    assert torch.equal(tensors["w::qs"], big)  # read again from the page cache
