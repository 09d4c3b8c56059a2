"""The tensor-parallel group of this process: torch.distributed under a thin, typed wrapper.

One process per rank (vlite.worker.worker); the layers ask `get_tp_group()` once, when they are
built: None means no tensor parallelism, and the single-process path stays exactly as it was.
gloo on CPU; the same calls take NCCL on GPUs (`backend`).
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from vlite.model_loader.tp_shard import TPShard


class TPGroup:
    """This rank's place in the tensor-parallel group and the collectives the layers need."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.is_driver = rank == 0
        self.shard: Optional[TPShard] = None  # this rank's part of the model, set when it is loaded

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place (row-parallel projections, the vocab-parallel embedding)."""
        dist.all_reduce(t)
        return t

    def all_gather_last(self, t: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Concatenate every rank's `t` along the last dim (vocab-parallel logits); `sizes`: each rank's
        width (they may differ by one: shards are padded to the widest for the collective)."""
        width = max(sizes)
        if t.shape[-1] < width:
            t = torch.nn.functional.pad(t, (0, width - t.shape[-1]))
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(parts, t.contiguous())
        return torch.cat([p[..., :s] for p, s in zip(parts, sizes)], dim=-1)

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's `t` on every rank (the sampled tokens: only rank 0 samples)."""
        dist.broadcast(t, src=0)
        return t


_TP: Optional[TPGroup] = None


def init_tp_group(rank: int, world_size: int, init_method: str, backend: str = "gloo",
                  timeout_s: float = 60.0) -> TPGroup:
    """Join the group (blocks until every rank has). `timeout_s` bounds each collective: a rank
    that stops answering fails the others' collectives instead of hanging them forever."""
    global _TP
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    _TP = TPGroup(rank, world_size)
    return _TP


def get_tp_group() -> Optional[TPGroup]:
    """This process's tensor-parallel group; None without tensor parallelism (or with one rank)."""
    return _TP if _TP is not None and _TP.world_size > 1 else None


def destroy_tp_group() -> None:
    global _TP
    if dist.is_initialized():
        dist.destroy_process_group()
    _TP = None
