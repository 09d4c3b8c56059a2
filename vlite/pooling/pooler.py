"""The pooler: a step's hidden states [T, H] -> one vector (or score) per request whose prompt is complete.

Requests are given by where their tokens start in the step's flat rows and how many there are. Every
reduction is one segment operation over all requests together (index_add_ for sums, scatter_reduce_ for
maxima, plain indexing for first/last rows), in float32 whatever the model's dtype. A decoder prompt chunked
over several steps is pooled by `reduce` on each chunk and `combine` of the partial results (MEAN/MAX/LAST),
then `finish`; a whole prompt in one step is `pool`.

    rows: 0 1 2 3 4 5 6        starts [0, 3], lengths [3, 4]
          a a a b b b b   ->   segment ids of the pooled rows: 0 0 0 1 1 1 1
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from vlite.pooling.config import DenseLayer, PoolerConfig, PoolingType
from vlite.utils import group_offsets

__all__ = ["Pooler", "segment_rows"]

_ACT: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "identity": lambda x: x, "tanh": torch.tanh, "sigmoid": torch.sigmoid, "softmax": lambda x: x.softmax(-1),
    "relu": F.relu, "gelu": F.gelu, "silu": F.silu}


def segment_rows(starts: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, segment ids): every row of the segments, in order, and the segment each belongs to."""
    lengths_np = lengths.long().numpy()
    seg = np.repeat(np.arange(lengths_np.size), lengths_np)
    return torch.from_numpy(starts.long().numpy()[seg] + group_offsets(lengths_np)), torch.from_numpy(seg)


def _load_dense(layer: DenseLayer) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    folder = Path(layer.folder)
    if (folder / "model.safetensors").is_file():
        from safetensors.torch import load_file

        w = load_file(str(folder / "model.safetensors"))
    else:
        w = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    return w["linear.weight"].float(), (w["linear.bias"].float() if layer.bias else None)


class Pooler(nn.Module):
    """`config`'s pooling; `classify`: the model's head (the states of each prompt's first token, or of its last
    with LAST pooling -> logits) for task "classify"."""

    def __init__(self, config: PoolerConfig,
                 classify: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> None:
        super().__init__()
        self.config = config
        self.classify = classify
        if config.task == "classify" and classify is None:
            raise ValueError("a classification pooler needs the model's classification head")
        self.dense = [(*_load_dense(d), _ACT[d.activation]) for d in config.dense]  # float32

    # -- reductions ---------------------------------------------------------------------------------------
    def reduce(self, hidden: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """[N, H] float32: each segment's sum (MEAN kinds), maximum (MAX), first row (CLS) or last row (LAST)."""
        kind = self.config.pooling_type
        starts, lengths = starts.long(), lengths.long()
        if kind == PoolingType.CLS:
            return hidden[starts].float()
        if kind == PoolingType.LAST:
            return hidden[starts + lengths - 1].float()
        rows, seg = segment_rows(starts, lengths)
        x = hidden[rows].float()
        out = x.new_zeros(lengths.numel(), hidden.shape[-1])
        if kind == PoolingType.MAX:
            return out.scatter_reduce_(0, seg[:, None].expand_as(x), x, "amax", include_self=False)
        if kind in (PoolingType.MEAN, PoolingType.MEAN_SQRT_LEN):
            return out.index_add_(0, seg, x)
        raise ValueError(f"{kind} pooling does not reduce (ALL: use `tokens`)")

    def combine(self, before: torch.Tensor, chunk: torch.Tensor) -> torch.Tensor:
        """The reduction of a prompt so far (`before`) and of its next chunk, both from `reduce`."""
        kind = self.config.pooling_type
        if kind == PoolingType.MAX:
            return torch.maximum(before, chunk)
        if kind == PoolingType.LAST:
            return chunk
        if kind == PoolingType.CLS:
            return before
        return before + chunk

    def finish(self, reduced: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """[N, H] pooled vectors from whole prompts' reductions (`lengths`: the tokens each reduced)."""
        kind = self.config.pooling_type
        n = lengths.to(torch.float32).clamp(min=1)[:, None]
        if kind == PoolingType.MEAN:
            return reduced / n
        if kind == PoolingType.MEAN_SQRT_LEN:
            return reduced / n.sqrt()
        return reduced

    def pool(self, hidden: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor,
             skip: Optional[torch.Tensor] = None) -> torch.Tensor:
        """[N, H] float32 pooled vectors of whole prompts in one step. `skip` [N]: leading tokens left out of
        the pooling (an instruction prompt where include_prompt is False); LAST ignores it."""
        if skip is not None and self.config.pooling_type != PoolingType.LAST:
            skip = torch.minimum(skip, lengths - 1)  # at least one token pooled, whatever was truncated
            starts, lengths = starts + skip, lengths - skip
        return self.finish(self.reduce(hidden, starts, lengths), lengths)

    # -- outputs ------------------------------------------------------------------------------------------
    def embed(self, pooled: torch.Tensor, dimensions: Optional[Sequence[Optional[int]]] = None,
              normalize: Optional[bool] = None) -> torch.Tensor | list[torch.Tensor]:
        """Pooled vectors -> embeddings [N, D] float32: the Dense layers, Matryoshka truncation to each row's
        `dimensions` (then a list of rows), L2 normalization unless `normalize` (per call) or the config
        says not."""
        x = pooled.float()
        for weight, bias, act in self.dense:
            x = act(F.linear(x, weight, bias))
        norm = self.config.normalize if normalize is None else normalize
        if dimensions is None or all(d is None for d in dimensions):
            return F.normalize(x, p=2, dim=-1) if norm else x
        rows = [x[i, :d] if d is not None else x[i] for i, d in enumerate(dimensions)]
        return [F.normalize(r, p=2, dim=-1) if norm else r for r in rows]

    def score(self, first_token_hidden: torch.Tensor, activation: Optional[bool] = None) -> torch.Tensor:
        """[N, num_labels] float32: the classification head on the first tokens, then the activation
        (unless `activation` is False: raw logits)."""
        logits = self.classify(first_token_hidden).float()
        return logits if activation is False else _ACT[self.config.activation](logits)

    def outputs(self, hidden: torch.Tensor, starts: np.ndarray, lengths: np.ndarray, params: Sequence[Any]
                ) -> list[list[float]]:
        """What the engine sends for each request whose whole prompt (or, for LAST pooling, its last chunk) is
        `lengths` rows of `hidden` from `starts`, with its PoolingParams: the embedding (its `dimensions`,
        `normalize`), or the classifier's scores (its `activation`)."""
        starts_t, lengths_t = torch.from_numpy(np.asarray(starts)), torch.from_numpy(np.asarray(lengths))
        if self.config.task == "classify":  # the head on the first token (encoders) or the last (decoders, LAST)
            rows = starts_t + lengths_t - 1 if self.config.pooling_type == PoolingType.LAST else starts_t
            logits = self.classify(hidden[rows.long()]).float()
            raw = torch.tensor([p.activation is False for p in params])[:, None]
            return torch.where(raw, logits, _ACT[self.config.activation](logits)).tolist()
        skip = [p.prompt_tokens_skipped for p in params]
        pooled = self.pool(hidden, starts_t, lengths_t, torch.tensor(skip) if any(skip) else None)
        norm = [self.config.normalize if p.normalize is None else p.normalize for p in params]
        dims = [p.dimensions for p in params]
        if len(set(norm)) == 1:
            out = self.embed(pooled, dims, norm[0])
            return out.tolist() if isinstance(out, torch.Tensor) else [r.tolist() for r in out]
        # requests of one step asking for and against normalization (rare): each on its own
        return [self.embed(pooled[i:i + 1], dims[i:i + 1], n)[0].tolist() for i, n in enumerate(norm)]

    def tokens(self, hidden: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor) -> list[torch.Tensor]:
        """ALL: each request's rows [len, H] float32 (normalized where the config says)."""
        rows, _ = segment_rows(starts, lengths)
        x = hidden[rows].float()
        if self.config.normalize:
            x = F.normalize(x, p=2, dim=-1)
        return list(x.split(lengths.tolist()))
