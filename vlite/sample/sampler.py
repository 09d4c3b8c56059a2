"""Sampler: logits of the sampled rows -> token ids (+ logprobs), batched over the step.

Order of operations (as in the design):
  1. raw logprobs (log_softmax of the model's logits) if any row wants logprobs
  2. logits -> float32
  3. logits processors: allowed_token_ids mask, bad_words, min_tokens (EOS/stop suppressed),
     logit_bias, then a thinking budget's forced token (the one token its row may yield)
  4. penalties: repetition (prompt + output), frequency and presence (output)
  5. greedy rows: argmax; other rows: temperature -> min_p -> top-k/top-p -> random sample
  6. logprobs of the top-N tokens and of the sampled token, with the sampled token's rank
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from vlite.sample.metadata import SamplingMetadata

_NEG_INF = float("-inf")


@dataclass
class LogprobsTensors:
    token_ids: torch.Tensor  # [B, N+1], column 0 the sampled token
    logprobs: torch.Tensor  # [B, N+1]
    ranks: torch.Tensor  # [B] rank of the sampled token (1 = most likely)


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    logprobs_tensors: Optional[LogprobsTensors]


class Sampler:
    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        raw_logprobs, logits = process_logits(logits, md)
        sampled = self.sample(logits, md)
        lp = None
        if raw_logprobs is not None:
            lp = gather_logprobs(raw_logprobs, md.max_num_logprobs or 0, sampled)
        return SamplerOutput(sampled, lp)

    @staticmethod
    def sample(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        greedy = None if md.all_random else greedy_argmax(logits)
        if md.all_greedy:
            assert greedy is not None
            return greedy
        assert md.temperature is not None
        random = random_sample(target_probs(logits, md), md.generators)
        if greedy is None:
            return random
        return torch.where(md.temperature < 1e-5, greedy, random)


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax (the first index of the largest value, as torch's). On the CPU through numpy,
    whose vectorized argmax took 23 us for 7 rows of a 49,152-token vocabulary where torch's took 243."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return torch.from_numpy(logits.numpy().argmax(axis=-1))
    return logits.argmax(dim=-1)


def process_logits(logits: torch.Tensor, md: SamplingMetadata) -> tuple[Optional[torch.Tensor], torch.Tensor]:
    """Steps 1-4: (raw logprobs if any row wants logprobs, else None; float32 logits after the logits
    processors and penalties)."""
    raw_logprobs = None
    if md.max_num_logprobs is not None:
        raw_logprobs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
    if md.no_processors and md.no_penalties:  # nothing to write into the logits: no copy
        return raw_logprobs, logits.to(torch.float32)
    logits = logits.to(torch.float32, copy=True)
    logits = apply_logits_processors(logits, md)
    return raw_logprobs, apply_penalties(logits, md)


def target_probs(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """The distribution a random row samples from: temperature -> min_p -> top-k/top-p -> softmax.

    Greedy rows carry temperature 1 here; what is sampled for them is discarded.
    """
    assert md.temperature is not None
    temperature = torch.where(md.temperature < 1e-5, 1.0, md.temperature)
    logits = logits / temperature[:, None]
    if md.min_p is not None:
        logits = apply_min_p(logits, md.min_p)
    if md.top_k is not None or md.top_p is not None:
        logits = apply_top_k_top_p(logits, md.top_k, md.top_p)
    return torch.softmax(logits, dim=-1)


def apply_logits_processors(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    if md.disallowed_mask is not None:
        logits.masked_fill_(md.disallowed_mask, _NEG_INF)
    for row, words in md.bad_words_token_ids.items():
        past = md.output_token_lists[row]
        for word in words:
            prefix = word[:-1]
            if not prefix or (len(past) >= len(prefix) and past[len(past) - len(prefix):] == prefix):
                logits[row, word[-1]] = _NEG_INF
    if md.min_tokens is not None:
        rows, ids = md.min_tokens
        logits[rows, ids] = _NEG_INF
    if md.logit_bias is not None:
        rows, ids, bias = md.logit_bias
        logits.index_put_((rows, ids), bias, accumulate=True)
    if md.forced_tokens is not None:
        force_tokens(logits, *md.forced_tokens)
    return logits


def force_tokens(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
    """Thinking budgets: each of `rows` may yield only its token of `token_ids` (two indexed writes, whatever
    the vocabulary). Last among the processors, so no mask or bias before can rule the token out; penalties
    after it leave it finite and every other token -inf, so greedy, random, top-k/p and min_p all take it."""
    logits[rows] = _NEG_INF
    logits[rows, token_ids] = 0.0


def _token_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, L] ids padded with vocab_size -> [B, V] occurrence counts."""
    counts = torch.zeros(token_ids.shape[0], vocab_size + 1, dtype=torch.int32, device=token_ids.device)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids, dtype=torch.int32))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    if md.no_penalties:
        return logits
    vocab_size = logits.shape[1]
    assert md.output_token_ids is not None
    output_counts = _token_counts(md.output_token_ids, vocab_size)
    if md.repetition_penalties is not None:
        assert md.prompt_token_ids is not None
        seen = (_token_counts(md.prompt_token_ids, vocab_size) > 0) | (output_counts > 0)
        p = md.repetition_penalties[:, None].expand_as(logits)
        penalized = torch.where(logits > 0, logits / p, logits * p)
        logits = torch.where(seen, penalized, logits)
    if md.frequency_penalties is not None:
        logits = logits - md.frequency_penalties[:, None] * output_counts
    if md.presence_penalties is not None:
        logits = logits - md.presence_penalties[:, None] * (output_counts > 0)
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the most likely token's."""
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return logits.masked_fill(probs < threshold, _NEG_INF)


def apply_top_k_top_p(logits: torch.Tensor, top_k: Optional[torch.Tensor],
                      top_p: Optional[torch.Tensor]) -> torch.Tensor:
    """Keep the k most likely tokens, then the smallest set whose probability reaches p.

    One ascending sort serves both: top-k masks everything below the k-th largest value;
    top-p masks the low tail whose cumulative probability is at most 1 - p (the most likely
    token always survives).
    """
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    vocab_size = logits.shape[1]
    if top_k is not None:
        kth = sorted_logits.gather(1, (vocab_size - top_k.clamp(1, vocab_size))[:, None])
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, _NEG_INF)
    if top_p is not None:
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        drop = cum <= (1 - top_p)[:, None]
        drop[:, -1] = False
        sorted_logits = sorted_logits.masked_fill(drop, _NEG_INF)
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def seeded_generator(seed: int, position: int) -> torch.Generator:
    """The generator of a seeded request's output token `position`: a request's samples then depend
    only on its seed and tokens (not on the batch, preemptions, or speculative decoding's drafts)."""
    return torch.Generator().manual_seed((seed * 0x9E3779B97F4A7C15 + position) & 0xFFFFFFFFFFFFFFFF)


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Inverse-CDF sampling: one uniform draw per row, located in the row's cumulative sum.

    (On a CPU this beats the exponential race used on GPUs, which draws a random number for every
    vocabulary entry.) A seeded row draws its uniform from its own generator (see seeded_generator),
    so its samples do not depend on the rest of the batch.
    """
    u = torch.rand(probs.shape[0]) if len(generators) < probs.shape[0] else torch.empty(probs.shape[0])
    for row, gen in generators.items():
        u[row] = torch.rand(1, generator=gen)
    u = u.to(probs.device, non_blocking=True)  # drawn on the CPU: seeded rows' generators live there
    return inverse_cdf_sample(probs, u)


# Tokens per block of the two-level cumulative sum: a step's sampled rows cost one summing pass over the
# vocabulary and two short cumulative sums, not a sequential cumsum over all of it (32 rows of 49,152: torch's
# cumsum 0.64 ms, ~4-7% of a decode step of 32 requests on 2 cores; two levels 0.12 ms). Small vocabularies keep
# the one cumsum (the few small ops of two levels cost more there).
CDF_BLOCK = 1024


@functools.lru_cache(maxsize=None)
def cdf_block(vocab: int) -> int:
    """The block size for `vocab` tokens: a divisor within 2x of CDF_BLOCK (no padding copy: 128,256 -> 1,002),
    else CDF_BLOCK; 0 (one level) under 8 blocks."""
    if vocab < 8 * CDF_BLOCK:
        return 0
    for d in range(0, CDF_BLOCK // 2):
        for b in (CDF_BLOCK + d, CDF_BLOCK - d):
            if vocab % b == 0:
                return b
    return CDF_BLOCK


def inverse_cdf_sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The token at each row's uniform `u` [B] in [0, 1) of its cumulative (unnormalized) probabilities.

    Large vocabularies in two levels: the block where the row's cumulative block sums pass u * total, then
    the token within it, counted from the sum before the block. `right=True` skips zero-probability tokens
    (and blocks): the chosen position is where the cumulative sum rises past the target.
    """
    rows, vocab = probs.shape
    bs = cdf_block(vocab)
    if bs == 0:
        cdf = probs.cumsum(dim=-1)
        total = cdf[:, -1:]
        # u * total < total, so some token's cumulative sum exceeds it.
        target = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
        return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=vocab - 1)
    nb = -(-vocab // bs)
    if nb * bs != vocab:  # zeros past the vocabulary: never chosen
        probs = torch.nn.functional.pad(probs, (0, nb * bs - vocab))
    blocks = probs.reshape(rows, nb, bs)
    block_cdf = blocks.sum(dim=-1).cumsum(dim=-1)  # [B, nb]
    total = block_cdf[:, -1:]
    target = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    block = torch.searchsorted(block_cdf, target, right=True).clamp_(max=nb - 1)  # [B, 1]
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)), 0.0)  # <= target
    within = blocks[torch.arange(rows, device=probs.device), block[:, 0]].cumsum(dim=-1).add_(before)  # [B, bs]
    # rounding may leave the block's own cumulative sum at or under the target: its last rise then
    target = torch.minimum(target, torch.nextafter(within[:, -1:], torch.zeros_like(target)))
    index = torch.searchsorted(within, target, right=True).clamp_(max=bs - 1)
    return (block * bs + index).squeeze(1)


def gather_logprobs(logprobs: torch.Tensor, num_logprobs: int, token_ids: torch.Tensor) -> LogprobsTensors:
    """Top-N logprobs per row, with the sampled token's logprob and rank in front."""
    sampled = logprobs.gather(1, token_ids[:, None])
    ranks = (logprobs > sampled).sum(dim=-1) + 1
    if num_logprobs > 0:
        top_lp, top_ids = torch.topk(logprobs, num_logprobs, dim=-1)
        ids = torch.cat([token_ids[:, None], top_ids], dim=1)
        lps = torch.cat([sampled, top_lp], dim=1)
    else:
        ids, lps = token_ids[:, None], sampled
    return LogprobsTensors(ids, lps, ranks)
