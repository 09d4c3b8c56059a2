"""Where a speculative single stream's time goes, step by step: every engine step of a speculative engine
on `vlite bench latency --dataset copy`'s prompts, grouped by the tokens it verified, beside the steps of
a base engine run alternately on the same prompts.

    python benchmarks/spec_steps.py [--num-prompts 12] [--num-speculative-tokens 8]

Per group: steps, mean step time (and x the base step), its parts (the runner's forward, the logits, the
sampler with the rejection sampler and the proposer), tokens out per step and their rate relative to
base steps ("eff": tokens per base-step time). A verify step that costs c base steps and yields t tokens
pays only where t > c; the per-row cost of a step is what the 2x target on the AVX2 path comes down to.
"""

from __future__ import annotations

import argparse
import collections
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from spec_paired import copy_prompts  # the script beside this one (python benchmarks/...)

from vlite import LLM
from vlite.sampling_params import SamplingParams

PARTS = ("exec", "fwd", "logits", "sample")


def timed(record: dict[str, float], key: str, f: Callable[..., Any]) -> Callable[..., Any]:
    def g(*args: Any, **kwargs: Any) -> Any:
        if key == "exec":
            record["q"] = args[0].total_num_scheduled_tokens
        t = time.perf_counter()
        out = f(*args, **kwargs)
        record[key] = record.get(key, 0.0) + time.perf_counter() - t
        return out
    return g


def instrument(llm: LLM, record: dict[str, float]) -> None:
    """Time the executor's two calls of a step and, inside the first, the model's forward and logits."""
    core = llm.llm_engine.engine_core
    executor, model = core.executor, core.model_runner.model
    executor.execute_model = timed(record, "exec", executor.execute_model)
    executor.sample_tokens = timed(record, "sample", executor.sample_tokens)
    model.forward = timed(record, "fwd", model.forward)
    model.compute_logits = timed(record, "logits", model.compute_logits)


def run(llm: LLM, prompt: list[int], max_tokens: int, record: dict[str, float],
        steps: dict[Any, list[tuple[float, ...]]], label: Any = None) -> None:
    """One greedy request; every step but the prefill recorded under its scheduled tokens (or `label`)."""
    engine = llm.llm_engine
    engine.add_request("r", {"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    first, produced = True, 0
    while engine.has_unfinished_requests():
        record.clear()
        t = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t
        now = len(outs[0].outputs[0].token_ids) if outs else produced
        if not first:
            steps[label if label is not None else record.get("q", 0)].append(
                (dt, *(record.get(p, 0.0) for p in PARTS), now - produced))
        first, produced = False, now
    engine.reset_prefix_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=12)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--num-speculative-tokens", type=int, default=8)
    ns = parser.parse_args()
    spec = {"method": "ngram", "num_speculative_tokens": ns.num_speculative_tokens, "prompt_lookup_min": 2,
            "prompt_lookup_max": 4}
    base, llm = LLM(), LLM(speculative_config=spec)
    record: dict[str, float] = {}
    instrument(base, record)
    instrument(llm, record)
    tok = llm.get_tokenizer()
    prompts = copy_prompts(tok, ns.num_prompts, ns.output_len)
    steps: dict[Any, list[tuple[float, ...]]] = collections.defaultdict(list)
    for i, prompt in enumerate(prompts):
        for name in (["base", "spec"] if i % 2 == 0 else ["spec", "base"]):
            run(base if name == "base" else llm, prompt, ns.output_len, record, steps,
                "base" if name == "base" else None)
    b = 1e3 * np.mean([s[0] for s in steps.pop("base")])
    total_ms = sum(1e3 * s[0] for v in steps.values() for s in v)
    total_tokens = sum(s[-1] for v in steps.values() for s in v)
    print(f"base step {b:.2f} ms; speculative {total_tokens} tokens in {total_ms:.0f} ms: "
          f"{total_tokens * b / total_ms:.3f}x the base rate")
    table = llm.llm_engine.engine_core.model_runner.draft_policy.cost
    print(f"cost table (start-up, x a 1-token step): {np.round(table, 2)}")
    print("tokens  steps   ms   x base   exec   fwd  logits  sample  tok/step  eff  share")
    for q in sorted(steps):
        a = np.array(steps[q])
        m = a.mean(axis=0)
        ms = 1e3 * m[:5]
        print(f"{q:6d} {len(a):6d} {ms[0]:6.2f} {ms[0] / b:6.2f} {ms[1]:6.2f} {ms[2]:6.2f} {ms[3]:6.2f} {ms[4]:6.2f}"
              f" {m[5]:8.2f} {m[5] / (ms[0] / b):5.2f} {1e3 * a[:, 0].sum() / total_ms:5.2f}")


if __name__ == "__main__":
    main()
