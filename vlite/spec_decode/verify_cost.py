"""What a step verifying drafts costs: DraftPolicy's cost model, measured once per model at start-up.

On a CPU a step over q tokens of one request costs more than a 1-token step, by how much depends on
the model, its dtype, the kernels and the cores (vlite.spec_decode.draft_policy has figures). The
runner measures it before its first step, while the KV cache is still empty:

    for q in 1 .. min(max_tokens, MEASURED_VERIFY_TOKENS), best of 5:
        the forward and logits of q tokens of one request after CONTEXT_BLOCKS blocks of context,
        run as the decode rows of a verify step (precise_rows=1, as in a verify step of one request)
    past MEASURED_VERIFY_TOKENS: the line through the last measured half (steps bound by arithmetic)
"""

from __future__ import annotations

import logging
import time
from typing import Any, Optional, Protocol, Sequence

import numpy as np
import torch

from vlite import _custom_ops

logger = logging.getLogger(__name__)

MEASURED_VERIFY_TOKENS = 16
CONTEXT_BLOCKS = 16  # ~256 tokens: a chat prompt's length, where attention costs what it will
REPEATS = 5
# per model shape, dtype and CPU setting: the process's later engines of the same model reuse them
_verify_costs: dict[tuple, np.ndarray] = {}


class VerifyTarget(Protocol):
    """What the measurement reads of the model runner."""

    model: Any  # forward(input_ids, positions, kv_caches, attn_metadata) and compute_logits(hidden)
    kv_caches: list[torch.Tensor]
    attn_backend: Any  # build_metadata, as the runner calls it
    block_size: int
    attention_windows: Sequence[int]
    max_decode_query_len: int
    vocab_size: int


@torch.inference_mode()
def measure_verify_cost(runner: VerifyTarget, max_tokens: int, num_blocks: int, key: tuple) -> Optional[np.ndarray]:
    """cost[q - 1] for q = 1..max_tokens, the seconds of a step verifying q tokens of one request, or None
    where the cache has too few blocks or the timings were disturbed (DraftPolicy then uses its default).

    `key`: what the figures depend on besides the runner's block size and decode query length, the
    threads and the kernels' ISA (which are added): the model shape, dtype, quantization and device.
    The scratch blocks the steps wrote are zeroed after, as the block pool expects them."""
    bs = runner.block_size
    key = (*key, bs, runner.max_decode_query_len, torch.get_num_threads(), _custom_ops.requested_isa())
    if key in _verify_costs and len(_verify_costs[key]) >= max_tokens:
        return _verify_costs[key][:max_tokens]
    measured = min(max_tokens, MEASURED_VERIFY_TOKENS)
    context = CONTEXT_BLOCKS * bs
    if -(-(context + measured) // bs) > num_blocks:
        return None
    block_table = torch.arange(-(-(context + measured) // bs)).view(1, -1)
    lora = getattr(runner, "lora_manager", None)
    if lora is not None:  # the base model's steps (the last step's adapter rows are not these rows)
        lora.step.clear()
    best = np.full(measured, np.inf)
    for _ in range(REPEATS):
        for q in range(1, measured + 1):
            positions = torch.arange(context, context + q)
            slots = block_table[0, positions // bs] * bs + positions % bs
            metadata = runner.attn_backend.build_metadata(
                torch.tensor([0, q]), torch.tensor([context + q]), block_table, slots, bs, runner.attention_windows,
                max_query_len=q, max_decode_query_len=runner.max_decode_query_len, precise_rows=1)
            input_ids = torch.randint(0, runner.vocab_size, (q,))
            start = time.perf_counter()
            hidden = runner.model(input_ids, positions, runner.kv_caches, metadata)
            runner.model.compute_logits(hidden)
            best[q - 1] = min(best[q - 1], time.perf_counter() - start)
    for cache in runner.kv_caches:  # back to the pool's initial state
        cache[:, :, :block_table.shape[1]].zero_()
    if (best < 0.9 * best[0]).any():  # a 1-token step slower than longer ones: the machine was busy
        logger.warning("speculative decoding: verify step timings disturbed (%s ms); using the default "
                       "cost model", " ".join(f"{1e3 * c:.1f}" for c in best))
        return None
    logger.info("speculative decoding: verify step cost (x a 1-token step) for 1..%d tokens: %s", measured,
                " ".join(f"{c:.2f}" for c in best / best[0]))
    if max_tokens > measured:
        half = measured // 2
        slope = max(0.0, (best[-1] - best[half - 1]) / (measured - half))
        best = np.concatenate([best, best[-1] + slope * np.arange(1, max_tokens - measured + 1)])
    _verify_costs[key] = best
    return best
