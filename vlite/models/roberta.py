"""RoBERTa and XLM-RoBERTa: BERT's encoder whose positions start past the padding id (`position_offset` =
pad_token_id + 1, as transformers numbers an unpadded sequence) with one token type; the
sequence-classification variant's head runs dense + tanh + out_proj on the first token (<s>)."""

from __future__ import annotations

import torch

from vlite.layers.encoder import ClassificationHead, Encoder
from vlite.layers.linear import Weights
from vlite.layers.quantization import QuantizationPlan
from vlite.model_arch import ModelArchConfig


class RobertaModel(Encoder):
    """RobertaModel and XLMRobertaModel (the same network; XLM-R's vocabulary is larger)."""


class RobertaForSequenceClassification(RobertaModel):
    """logits = classifier.out_proj(tanh(classifier.dense(h_<s>))) (RobertaClassificationHead)."""

    def __init__(self, cfg: ModelArchConfig, w: Weights, plan: QuantizationPlan, dtype: torch.dtype) -> None:
        super().__init__(cfg, w, plan, dtype)
        self.head = ClassificationHead(w, "classifier.dense", "classifier.out_proj", plan, dtype)
