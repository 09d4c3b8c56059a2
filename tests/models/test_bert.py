"""BERT encoders (vlite.models.bert): several sequences flattened into one call equal transformers' BertModel
on each alone (float32), with and without token types; BertForSequenceClassification's logits; config and
checkpoint names (the `bert.` prefix of task models, the base model's unused pooler)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.models import encoders
from vlite.model_loader import load_model_weights, resolve_model


@pytest.fixture(scope="module")
def bert(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    from transformers import BertConfig, BertModel

    hf = encoders.build(BertConfig, BertModel, seed=1, type_vocab_size=2)
    return hf, encoders.save(hf, tmp_path_factory.mktemp("bert"))


@pytest.fixture(scope="module")
def bert_cls(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    from transformers import BertConfig, BertForSequenceClassification

    hf = encoders.build(BertConfig, BertForSequenceClassification, seed=2, type_vocab_size=2, num_labels=3)
    return hf, encoders.save(hf, tmp_path_factory.mktemp("bert_cls"))


def test_config_and_weights(bert: tuple[Any, Path], bert_cls: tuple[Any, Path]) -> None:
    cfg, weights = load_model_weights(resolve_model(str(bert[1])), torch.float32)
    assert cfg.architecture == "bert" and not cfg.is_causal and cfg.hidden_act == "gelu"
    assert cfg.type_vocab_size == 2 and cfg.position_offset == 0 and cfg.longest_context == 80
    assert cfg.rms_norm_eps == 1e-12 and not cfg.classifier
    assert "pooler.dense.weight" not in weights and "embeddings.word_embeddings.weight" in weights
    cfg, weights = load_model_weights(resolve_model(str(bert_cls[1])), torch.float32)
    assert cfg.architecture == "bert_cls" and cfg.classifier == "bert" and cfg.num_labels == 3
    assert {"pooler.dense.weight", "classifier.weight", "encoder.layer.1.output.dense.bias"} <= weights.keys()


def test_hidden_states_match_transformers(bert: tuple[Any, Path]) -> None:
    hf, folder = bert
    encoders.assert_hidden_parity(encoders.load(folder), hf, encoders.sequences())


def test_token_types_match_transformers(bert: tuple[Any, Path]) -> None:
    hf, folder = bert
    seqs = encoders.sequences(seed=5)
    types = [[int(i >= len(s) // 2) for i in range(len(s))] for s in seqs]  # a pair: first half 0, then 1
    encoders.assert_hidden_parity(encoders.load(folder), hf, seqs, types)


def test_one_sequence_and_equal_lengths(bert: tuple[Any, Path]) -> None:
    hf, folder = bert
    model = encoders.load(folder)
    encoders.assert_hidden_parity(model, hf, encoders.sequences()[2:3])
    encoders.assert_hidden_parity(model, hf, [s for s in encoders.sequences() if len(s) == 7])


def test_classification_logits_match_transformers(bert_cls: tuple[Any, Path]) -> None:
    hf, folder = bert_cls
    model = encoders.load(folder)
    encoders.assert_logits_parity(model, hf, encoders.sequences(seed=3))
    encoders.assert_hidden_parity(model, hf.bert, encoders.sequences(seed=3))


def test_bf16_close_to_float32(bert: tuple[Any, Path]) -> None:
    _, folder = bert
    seqs = encoders.sequences()
    ref = encoders.run_flat(encoders.load(folder), seqs)
    out = encoders.run_flat(encoders.load(folder, torch.bfloat16), seqs).float()
    assert torch.nn.functional.cosine_similarity(out, ref).min() > 0.99


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("act", ["gelu", "gelu_new", "gelu_pytorch_tanh"])
def test_gelus_and_bf16_match_transformers(tmp_path: Path, act: str, fused: bool,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """hidden_act's GELU approximation is the one run, on oneDNN's fused linear (+ GELU, + residual) and on the
    plain torch path that CPUs without oneDNN's bf16 take; in bf16 both agree with transformers within bf16's
    rounding."""
    from transformers import BertConfig, BertModel

    from vlite.layers import encoder

    if fused and not encoder._ONEDNN_DTYPES:
        pytest.skip("this torch has no oneDNN linear")
    if not fused:
        monkeypatch.setattr(encoder, "_ONEDNN_DTYPES", frozenset())

    hf = encoders.build(BertConfig, BertModel, seed=3, hidden_act=act)
    folder = encoders.save(hf, tmp_path / act)
    encoders.assert_hidden_parity(encoders.load(folder), hf, encoders.sequences())
    model = encoders.load(folder, torch.bfloat16)
    out = encoders.run_flat(model, encoders.sequences()[:1]).float()
    with torch.no_grad():
        ref = hf(torch.tensor(encoders.sequences()[:1])).last_hidden_state[0]
    assert (out - ref).abs().max() < 0.1 and torch.nn.functional.cosine_similarity(out, ref).min() > 0.999


def test_unsupported_activation_refused(tmp_path: Path) -> None:
    from transformers import BertConfig, BertModel

    folder = encoders.save(encoders.build(BertConfig, BertModel, hidden_act="relu"), tmp_path / "relu")
    with pytest.raises(ValueError, match="unsupported hidden_act 'relu'; supported: gelu, gelu_new"):
        load_model_weights(resolve_model(str(folder)), torch.float32)
