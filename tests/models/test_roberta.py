"""XLM-RoBERTa / RoBERTa encoders (vlite.models.roberta): positions past the padding id (pad_token_id + 1),
one token type; flat multi-sequence calls equal transformers per sequence (float32); the
sequence-classification head's logits (the `roberta.` prefix of its checkpoint)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.models import encoders
from vlite.model_loader import load_model_weights, resolve_model

PAD = 1


@pytest.fixture(scope="module")
def xlmr(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    from transformers import XLMRobertaConfig, XLMRobertaModel

    hf = encoders.build(XLMRobertaConfig, XLMRobertaModel, seed=4, type_vocab_size=1, pad_token_id=PAD,
                        max_position_embeddings=36 + PAD + 1)
    return hf, encoders.save(hf, tmp_path_factory.mktemp("xlmr"))


@pytest.fixture(scope="module")
def xlmr_cls(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    from transformers import XLMRobertaConfig, XLMRobertaForSequenceClassification

    hf = encoders.build(XLMRobertaConfig, XLMRobertaForSequenceClassification, seed=6, type_vocab_size=1,
                        pad_token_id=PAD, num_labels=1)
    return hf, encoders.save(hf, tmp_path_factory.mktemp("xlmr_cls"))


def test_config(xlmr: tuple[Any, Path], xlmr_cls: tuple[Any, Path]) -> None:
    cfg, _ = load_model_weights(resolve_model(str(xlmr[1])), torch.float32)
    assert cfg.architecture == "roberta" and cfg.position_offset == PAD + 1 and cfg.type_vocab_size == 1
    assert cfg.longest_context == 36  # the longest sequence the position table holds
    cfg, weights = load_model_weights(resolve_model(str(xlmr_cls[1])), torch.float32)
    assert cfg.architecture == "roberta_cls" and cfg.classifier == "roberta" and cfg.num_labels == 1
    assert {"classifier.dense.weight", "classifier.out_proj.bias"} <= weights.keys()


def test_hidden_states_match_transformers(xlmr: tuple[Any, Path]) -> None:
    hf, folder = xlmr
    encoders.assert_hidden_parity(encoders.load(folder), hf, encoders.sequences(low=PAD + 1))


def test_classification_logits_match_transformers(xlmr_cls: tuple[Any, Path]) -> None:
    hf, folder = xlmr_cls
    encoders.assert_logits_parity(encoders.load(folder), hf, encoders.sequences(seed=7, low=PAD + 1))
