"""Reference greedy decoding with transformers, and the near-tie comparison rule."""

from __future__ import annotations

import hashlib
import inspect
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

NEAR_TIE = 1e-3
ATOL = 1e-3  # logprob agreement with transformers in float32


@dataclass
class Reference:
    token_ids: list[int]
    logprobs: torch.Tensor  # [steps, vocab] log_softmax of transformers' float32 logits


def _forward_conventions(model) -> tuple[str, dict, torch.device]:
    """The model's KV-cache keyword, last-position-only logits keyword, and device."""
    # transformers renamed past_key_values to cache; use whichever this version has.
    params = inspect.signature(model.forward).parameters
    name = "cache" if "cache" in params else "past_key_values"
    # Only the last position's logits: a 600-token prompt over Gemma's 262,144-token vocabulary would
    # otherwise compute (and hold) 630 MB of logits nobody reads.
    last = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
    device = next(model.parameters()).device  # the reference runs where the model is (a GPU: VLITE_TEST_DEVICE)
    return name, last, device


@torch.inference_mode()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> Reference:
    """Plain greedy loop over transformers' forward with its KV cache (no EOS stop)."""
    name, last, device = _forward_conventions(model)
    out = model(input_ids=torch.tensor([prompt_ids], device=device), use_cache=True, **last)
    past, logits = getattr(out, name), out.logits[0, -1]
    tokens, lps = [], []
    for _ in range(max_new_tokens):
        lps.append(torch.log_softmax(logits.float(), -1).cpu())
        token = int(logits.argmax())
        tokens.append(token)
        out = model(input_ids=torch.tensor([[token]], device=device), use_cache=True, **{name: past})
        past, logits = getattr(out, name), out.logits[0, -1]
    return Reference(tokens, torch.stack(lps))


@torch.inference_mode()
def hf_greedy_batch(model, prompts: list[list[int]], max_new_tokens: int) -> list[Reference]:
    """hf_greedy for several prompts in one batch (left-padded, masked): each forward reads the
    weights once for all of them (the suite's eight prompts: 46 -> 23 s on 2 cores). The padding
    changes only the GEMMs' shapes (last-bit differences, well inside ATOL and NEAR_TIE)."""
    if len(prompts) == 1:
        return [hf_greedy(model, prompts[0], max_new_tokens)]
    name, last, device = _forward_conventions(model)
    width = max(len(p) for p in prompts)
    pad = [width - len(p) for p in prompts]
    ids = torch.tensor([[0] * n + list(p) for n, p in zip(pad, prompts)], device=device)
    mask = torch.tensor([[0] * n + [1] * len(p) for n, p in zip(pad, prompts)], device=device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **last)
    past, logits = getattr(out, name), out.logits[:, -1]
    tokens, lps = [], []
    for _ in range(max_new_tokens):
        lps.append(torch.log_softmax(logits.float(), -1).cpu())
        token = logits.argmax(-1)
        tokens.append(token.cpu())
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        positions = positions[:, -1:] + 1
        out = model(input_ids=token[:, None], attention_mask=mask, position_ids=positions, use_cache=True,
                    **{name: past})
        past, logits = getattr(out, name), out.logits[:, -1]
    token_ids, logprobs = torch.stack(tokens, 1), torch.stack(lps, 1)
    return [Reference(token_ids[i].tolist(), logprobs[i]) for i in range(len(prompts))]


def compare_greedy(ours: list[int], our_logprobs, ref: Reference, atol: float) -> dict:
    """Token-identical up to the first divergence, which must follow a near-tie in the reference.

    `our_logprobs` is CompletionOutput.logprobs (per position {token_id: Logprob}); at every
    compared position the top-N logprobs must match the reference's within `atol`.
    Returns {"matched": n, "diverged_at": i or None, "max_diff": float}.
    """
    max_diff = 0.0
    n = min(len(ours), len(ref.token_ids))
    for i in range(n):
        ref_lp = ref.logprobs[i]
        if our_logprobs is not None:
            for token_id, lp in our_logprobs[i].items():
                diff = abs(lp.logprob - float(ref_lp[token_id]))
                max_diff = max(max_diff, diff)
                assert diff < atol, f"position {i}: logprob of token {token_id} differs by {diff}"
        if ours[i] != ref.token_ids[i]:
            top2 = torch.topk(ref_lp, 2).values
            gap = float(top2[0] - top2[1])
            assert gap < NEAR_TIE, (f"diverged at position {i} (ours {ours[i]}, reference {ref.token_ids[i]}) "
                                    f"but the reference's top-2 gap is {gap:.2e}, not a near-tie")
            assert ours[i] in torch.topk(ref_lp, 2).indices.tolist()
            return {"matched": i, "diverged_at": i, "max_diff": max_diff}
    assert len(ours) == len(ref.token_ids)
    return {"matched": n, "diverged_at": None, "max_diff": max_diff}


def compare_runs(a, b) -> int:
    """Two engine runs of the same greedy request: identical, or apart only after a near-tie.

    a, b: CompletionOutputs with logprobs >= 1. Returns the number of identical leading tokens.
    """
    for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)):
        if x != y:
            lp = sorted((v.logprob for v in a.logprobs[i].values()), reverse=True)
            assert len(lp) >= 2 and lp[0] - lp[1] < NEAR_TIE, f"runs diverge at {i} without a near-tie"
            return i
    assert len(a.token_ids) == len(b.token_ids)
    return len(a.token_ids)


def cached_references(compute: Callable[[], list[Reference]], model_file: Path, prompts: list[list[int]],
                      max_new_tokens: int) -> list[Reference]:
    """`compute()`'s references, kept on disk between test runs (VLITE_CACHE_DIR, else ~/.cache/vlite): a suite
    run spent ~30 s recomputing the same transformers outputs. The key holds everything they depend on: the model
    file's bytes, the prompts, the token count, this module's code and the transformers and torch versions; any
    change computes them again. VLITE_TEST_REFERENCE_CACHE=0 always computes."""
    if os.environ.get("VLITE_TEST_REFERENCE_CACHE", "1") == "0":
        return compute()
    import transformers

    h = hashlib.sha256()
    with open(model_file, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    h.update(repr((prompts, max_new_tokens, transformers.__version__, torch.__version__)).encode())
    h.update(Path(__file__).read_bytes())
    root = Path(os.environ.get("VLITE_CACHE_DIR") or Path.home() / ".cache" / "vlite") / "test-references"
    path = root / f"{h.hexdigest()[:24]}.pt"
    if path.is_file():
        try:
            return [Reference(t, lp) for t, lp in torch.load(path, weights_only=True)]
        except Exception:  # a damaged file: compute again
            pass
    refs = compute()
    root.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    torch.save([(r.token_ids, r.logprobs) for r in refs], tmp)
    os.replace(tmp, path)  # whole or absent for a concurrent run
    return refs
