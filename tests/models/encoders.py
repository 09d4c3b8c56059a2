"""Tiny random encoders (BERT, XLM-RoBERTa and their sequence-classification variants) for the parity
tests: built with transformers, saved as a folder, run by vlite over several sequences flattened into one
step and by transformers one sequence at a time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.models import tiny
from vlite.layers.encoder import EncoderAttentionMetadata
from vlite.layers.quantization import QuantizationPlan
from vlite.model_loader import load_model_weights, resolve_model
from vlite.models.registry import build_model

VOCAB_SIZE = 120
# Repeated lengths (one SDPA call each group) out of order (the model reorders the step), a 1-token sequence.
SEQ_LENS = [7, 1, 19, 7, 33, 4, 19, 7]


def build(config_cls: type, model_cls: type, seed: int = 0, **overrides: Any) -> Any:
    """2 layers, hidden 64, 4 heads, random weights with LayerNorm weights and biases away from 1 and 0."""
    kwargs: dict[str, Any] = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=4, max_position_embeddings=80, initializer_range=0.1)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    return tiny.randomize(model_cls(config_cls(**kwargs)).eval(), seed, "LayerNorm")


def save(model: Any, folder: Path) -> Path:
    model.save_pretrained(folder)
    return folder


def sequences(seed: int = 0, low: int = 3) -> list[list[int]]:
    """Token ids of SEQ_LENS (ids from `low` up: below it the special and padding ids)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(low, VOCAB_SIZE, (n,), generator=gen).tolist() for n in SEQ_LENS]


def load(folder: Path, dtype: torch.dtype = torch.float32) -> Any:
    cfg, weights = load_model_weights(resolve_model(str(folder)), dtype)
    return build_model(cfg, weights, QuantizationPlan(None), dtype).eval()


def run_flat(model: Any, seqs: list[list[int]], token_types: list[list[int]] | None = None) -> torch.Tensor:
    """vlite's hidden states of every sequence, all in one flat forward call: [T, H]."""
    flat = torch.tensor([t for s in seqs for t in s])
    positions = torch.cat([torch.arange(len(s)) for s in seqs])
    types = None if token_types is None else torch.tensor([t for s in token_types for t in s])
    md = EncoderAttentionMetadata.from_seq_lens([len(s) for s in seqs])
    with torch.no_grad():
        return model(flat, positions, [], md, token_type_ids=types)


def first_rows(seqs: list[list[int]]) -> torch.Tensor:
    lens = torch.tensor([len(s) for s in seqs])
    return torch.cumsum(lens, 0) - lens


def assert_hidden_parity(model: Any, hf: Any, seqs: list[list[int]], token_types: list[list[int]] | None = None,
                         atol: float = 1e-5) -> None:
    """vlite's flat step equals transformers' last_hidden_state of each sequence alone."""
    out = run_flat(model, seqs, token_types)
    start = 0
    with torch.no_grad():
        for i, s in enumerate(seqs):
            kwargs = {} if token_types is None else {"token_type_ids": torch.tensor([token_types[i]])}
            ref = hf(torch.tensor([s]), **kwargs).last_hidden_state[0]
            torch.testing.assert_close(out[start:start + len(s)], ref, atol=atol, rtol=0)
            start += len(s)


def assert_logits_parity(model: Any, hf: Any, seqs: list[list[int]], atol: float = 1e-5) -> None:
    """The classification head on the first tokens of the flat step equals transformers' logits."""
    with torch.no_grad():
        logits = model.classify(run_flat(model, seqs)[first_rows(seqs)])
        ref = torch.cat([hf(torch.tensor([s])).logits for s in seqs])
    torch.testing.assert_close(logits, ref, atol=atol, rtol=0)
