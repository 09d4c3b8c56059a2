"""How a pooling model turns hidden states into its output; no torch (the API process reads it too)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

__all__ = ["PoolingType", "DenseLayer", "PoolerConfig", "ACTIVATIONS"]


class PoolingType:
    """Which hidden states of a prompt make its vector."""

    MEAN = "MEAN"  # the average over its tokens
    MEAN_SQRT_LEN = "MEAN_SQRT_LEN"  # the sum over its tokens / sqrt(tokens) (sentence-transformers' mean_sqrt_len)
    CLS = "CLS"  # its first token
    LAST = "LAST"  # its last token
    MAX = "MAX"  # the element-wise maximum over its tokens
    ALL = "ALL"  # every token's (token embeddings)
    ALL_TYPES = (MEAN, MEAN_SQRT_LEN, CLS, LAST, MAX, ALL)


# Activations the pooler computes (Dense layers, classification scores): torch.nn class names -> ours.
ACTIVATIONS = {"Identity": "identity", "Tanh": "tanh", "Sigmoid": "sigmoid", "Softmax": "softmax", "ReLU": "relu",
               "GELU": "gelu", "SiLU": "silu"}


@dataclass(frozen=True)
class DenseLayer:
    """A sentence-transformers Dense module: activation(x @ W.T + b), weights in `folder` (linear.weight/bias)."""

    folder: str
    in_features: int
    out_features: int
    bias: bool = True
    activation: str = "tanh"  # ACTIVATIONS' values


@dataclass(frozen=True)
class PoolerConfig:
    """What the pooler does with a model's hidden states.

    task "embed": pooling_type's vector of each prompt (prompt tokens of an instruction left out where
    include_prompt is False), then the Dense layers in order, then L2 normalization where `normalize`;
    Matryoshka models may be asked for fewer `dimensions` (truncated, then normalized).
    task "classify": the classification head on the first token (CLS pooling), `activation` over its
    num_labels logits.
    """

    task: str = "embed"  # "embed" or "classify"
    pooling_type: str = PoolingType.LAST
    include_prompt: bool = True
    normalize: bool = True
    dense: tuple[DenseLayer, ...] = ()
    max_seq_length: Optional[int] = None  # prompts are truncated to it (sentence_bert_config.json)
    do_lower_case: bool = False  # sentence-transformers lowercases the text before its tokenizer
    prompts: dict[str, str] = field(default_factory=dict)  # name -> text put before the input
    default_prompt_name: Optional[str] = None
    similarity_fn_name: Optional[str] = None  # "cosine", "dot", ... (config_sentence_transformers.json)
    is_matryoshka: bool = False
    matryoshka_dimensions: Optional[tuple[int, ...]] = None  # the sizes it was trained for; None: any
    num_labels: int = 0  # classify
    activation: str = "identity"  # classify: over the logits ("sigmoid", "softmax", "identity")

    def __post_init__(self) -> None:
        if self.task not in ("embed", "classify"):
            raise ValueError(f"unknown pooling task {self.task!r}")
        if self.pooling_type not in PoolingType.ALL_TYPES:
            raise ValueError(f"unknown pooling type {self.pooling_type!r}; vlite has: {', '.join(PoolingType.ALL_TYPES)}")
        if self.activation not in ACTIVATIONS.values():
            raise ValueError(f"unknown activation {self.activation!r}")
        object.__setattr__(self, "dense", tuple(self.dense))
        if self.matryoshka_dimensions is not None:
            object.__setattr__(self, "matryoshka_dimensions", tuple(int(d) for d in self.matryoshka_dimensions))

    @property
    def output_size(self) -> Optional[int]:
        """The embedding size after the Dense layers (None without any: the model's hidden size)."""
        return self.dense[-1].out_features if self.dense else None

    def check_dimensions(self, dimensions: Optional[int], hidden_size: int) -> None:
        """Refuse a `dimensions` request the model cannot serve (as vLLM does: Matryoshka models only)."""
        if dimensions is None:
            return
        full = self.output_size or hidden_size
        if not self.is_matryoshka:
            raise ValueError("dimensions must be unset: this model does not support matryoshka representation")
        if self.matryoshka_dimensions and dimensions not in self.matryoshka_dimensions:
            raise ValueError(f"dimensions {dimensions} is not one of the model's {self.matryoshka_dimensions}")
        if not 1 <= dimensions <= full:
            raise ValueError(f"dimensions must be in 1..{full}, got {dimensions}")
