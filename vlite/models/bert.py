"""BERT: the shared encoder (vlite.layers.encoder) with token-type embeddings; BertForSequenceClassification
(cross-encoders) adds the pooler (dense + tanh on [CLS]) and a linear classifier."""

from __future__ import annotations

import torch

from vlite.layers.encoder import ClassificationHead, Encoder
from vlite.layers.linear import Weights
from vlite.layers.quantization import QuantizationPlan
from vlite.model_arch import ModelArchConfig


class BertModel(Encoder):
    """Word + token-type + absolute position embeddings, post-LN layers; no head (embedding models). The
    checkpoint's pooler, which BertModel carries but sentence-transformers never runs, is not loaded."""


class BertForSequenceClassification(BertModel):
    """logits = classifier(tanh(pooler.dense(h_CLS)))."""

    def __init__(self, cfg: ModelArchConfig, w: Weights, plan: QuantizationPlan, dtype: torch.dtype) -> None:
        super().__init__(cfg, w, plan, dtype)
        self.head = ClassificationHead(w, "pooler.dense", "classifier", plan, dtype)
