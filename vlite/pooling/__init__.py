"""Pooling models' last step: the hidden states of a request's whole prompt reduced to one vector (MEAN, CLS,
LAST, MAX; or every token's, ALL), then sentence-transformers' Dense and Normalize modules and Matryoshka
truncation (embeddings), or a sequence-classification head and its activation (scores).

`config.py` (no torch): `PoolerConfig`, read from a sentence-transformers folder by
vlite/model_loader/sentence_transformers.py. `pooler.py` (torch): `Pooler`, segment reductions over a step's
flat tokens with no Python loop over requests.
"""

from vlite.pooling.config import DenseLayer, PoolerConfig, PoolingType

__all__ = ["DenseLayer", "PoolerConfig", "PoolingType"]
