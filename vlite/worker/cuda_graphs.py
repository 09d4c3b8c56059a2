"""CUDA graphs for all-decode steps: the model's forward captured once per padded batch size at
start-up and replayed, so a decode step costs one graph launch instead of a few hundred kernel launches.

    capture sizes: 1, 2, 4, then every 8 up to max_num_seqs (vLLM's rule)
    a step of n decodes runs the graph of the smallest size >= n; rows n.. are padding:

        input_ids / positions  0             slot_mapping  -1 (the cache write skips it)
        query_start_loc        0, 1, 2, ...  seq_lens      0  (the attention reads no key, writes zeros)

The graphs read static buffers that each replay refills from the step's device tensors (copies on
the device); the attention metadata of every graph points into them. Steps with a prompt chunk,
more decodes than the largest size, or --enforce-eager run eagerly, and so do cascade steps (a common
prefix attended once for the batch, TritonAttentionMetadata.common_prefix_len > 0): the graphs are
captured on the plain attention path, and the prefix length, a host int, picks other launches.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Optional, Sequence

import torch

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The padded batch sizes captured for `max_num_seqs` requests at most."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs] + list(range(8, max_num_seqs, 8))
    return sorted(set(sizes) | {max_num_seqs})


class CUDAGraphRunner:
    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], attn_backend: Any, block_size: int,
                 windows: Sequence[int], max_num_seqs: int, max_blocks_per_req: int, device: torch.device) -> None:
        self.model, self.kv_caches = model, kv_caches
        self.sizes = capture_sizes(max_num_seqs)
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int64, device=device)
        self.block_table = torch.zeros(n, max_blocks_per_req, dtype=torch.int64, device=device)
        self._metadata = {s: attn_backend.build_metadata(self.query_start_loc[:s + 1], self.seq_lens[:s],
                                                         self.block_table[:s], self.slot_mapping[:s], block_size,
                                                         windows, max_query_len=1) for s in self.sizes}
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.num_replays = 0  # steps served by a graph (tests and benchmarks check graphs were used)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first (the smaller ones then reuse its memory pool)."""
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            args = (self.input_ids[:size], self.positions[:size], self.kv_caches, self._metadata[size])
            self.model(*args)  # warm-up: Triton compiles, cuBLAS picks its kernels, outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.model(*args)
            self._graphs[size] = (graph, out)
        torch.cuda.synchronize()
        logger.info("vlite: captured CUDA graphs for %d decode batch sizes (%s) in %.1f s", len(self.sizes),
                    ", ".join(map(str, self.sizes)), time.perf_counter() - start)

    def padded_size(self, num_reqs: int, num_tokens: int, common_prefix_len: int = 0) -> Optional[int]:
        """The graph size for a step, or None when the step must run eagerly (not all decodes, too many,
        a cascade step: the graphs hold the plain attention path)."""
        if num_tokens != num_reqs or num_reqs > self.sizes[-1] or common_prefix_len > 0:
            return None
        return next(s for s in self.sizes if s >= num_reqs)

    def run(self, size: int, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            seq_lens: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
        """The hidden states [n, hidden] of n decodes (their step tensors on the device), by replay."""
        n = input_ids.shape[0]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(slot_mapping)
        self.slot_mapping[n:size].fill_(-1)
        self.seq_lens[:n].copy_(seq_lens)
        self.seq_lens[n:size].zero_()
        self.block_table[:n, :block_table.shape[1]].copy_(block_table)
        graph, out = self._graphs[size]
        graph.replay()
        self.num_replays += 1
        return out[:n]
