"""Speculative decoding's single-stream ratio on copy prompts, paired: a base and a speculative engine
in one process, run alternately on each of `vlite bench latency --dataset copy`'s prompts, so that the
machine's drift (a third within minutes on the cloud VMs we measure on) falls on both alike.

    python benchmarks/spec_paired.py [--num-prompts 30] [--evict-weights] [--num-speculative-tokens 8]

Decode tok/s = 1 / mean inter-token latency, as bench latency's. `--evict-weights` flushes the model's
weights from every cache level (`clflushopt`, x86) before each step and leaves that time out: a CPU
whose L3 holds the model between steps (this project's Xeon VM: 480 MiB) otherwise shows a cheaper
memory-bound 1-token step than most CPUs (16-32 MiB of L3 per core complex) ever get.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from vlite import LLM
from vlite.benchmarks.datasets import copy_requests
from vlite.sampling_params import RequestOutputKind, SamplingParams

SPEC = {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
KINDS = ["repeat", "correct typos", "rename function"]  # copy_requests' kinds, in turn

_EVICT_SRC = """
#include <immintrin.h>
void evict(int64_t addr, int64_t n) {
  for (int64_t a = addr & ~int64_t(63); a < addr + n; a += 64) _mm_clflushopt(reinterpret_cast<void*>(a));
  _mm_sfence();
}
"""


def copy_prompts(tokenizer, num_prompts: int, output_len: int) -> list[list[int]]:
    """As bench latency's iterations: iteration i's own prompt, the kinds (KINDS) taking turns."""
    return [copy_requests(tokenizer, i + 1, output_len, seed=i)[-1].prompt_token_ids for i in range(num_prompts)]


def weight_spans(model: torch.nn.Module) -> list[tuple[int, int]]:
    """(address, bytes) of every tensor storage the model's modules hold, packed weights included."""
    seen: set[int] = set()
    spans = []

    def visit(x: object, depth: int = 0) -> None:
        if isinstance(x, torch.Tensor):
            st = x.untyped_storage()
            if st.data_ptr() not in seen and st.nbytes() > 4096:
                seen.add(st.data_ptr())
                spans.append((st.data_ptr(), st.nbytes()))
        elif isinstance(x, (list, tuple)) and depth < 4:
            for y in x:
                visit(y, depth + 1)
        elif hasattr(x, "__dict__") and depth < 4 and not isinstance(x, (type, torch.nn.Module)):
            for y in vars(x).values():
                visit(y, depth + 1)

    for mod in model.modules():
        for t in list(mod.parameters(recurse=False)) + list(mod.buffers(recurse=False)):
            visit(t)
        for v in vars(mod).values():
            visit(v)
    return spans


def decode_gaps(llm: LLM, prompt: list[int], max_tokens: int, evict) -> np.ndarray:
    """Gaps between the stamps of one request's tokens (ms), eviction time left out."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, output_kind=RequestOutputKind.DELTA)
    engine.add_request("r", {"prompt_token_ids": prompt}, params)
    stamps, skipped, t0 = [], 0.0, time.perf_counter()
    while engine.has_unfinished_requests():
        if evict is not None:
            t = time.perf_counter()
            evict()
            skipped += time.perf_counter() - t
        for out in engine.step():
            stamps.extend([time.perf_counter() - t0 - skipped] * len(out.outputs[0].token_ids))
    engine.reset_prefix_cache()
    return 1e3 * np.diff(stamps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=30)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--evict-weights", action="store_true")
    parser.add_argument("--num-speculative-tokens", type=int, default=SPEC["num_speculative_tokens"])
    ns = parser.parse_args()
    engines = {"base": LLM(),
               "spec": LLM(speculative_config={**SPEC, "num_speculative_tokens": ns.num_speculative_tokens})}
    evictors = {name: None for name in engines}
    if ns.evict_weights:
        from torch.utils.cpp_extension import load_inline

        ext = load_inline("vlite_bench_evict", cpp_sources=[_EVICT_SRC], functions=["evict"],
                          extra_cflags=["-O2", "-mclflushopt"])
        for name, llm in engines.items():
            spans = weight_spans(llm.llm_engine.engine_core.model_runner.model)
            evictors[name] = lambda spans=spans: [ext.evict(a, n) for a, n in spans]
        print(f"evicting {sum(n for _, n in spans) / 2**20:.0f} MiB of weights before each step")
    tok = engines["base"].get_tokenizer()
    prompts = copy_prompts(tok, ns.num_prompts, ns.output_len)
    for name, llm in engines.items():  # warm-up
        decode_gaps(llm, prompts[0], 16, evictors[name])
    gaps: dict[tuple[str, int], list[np.ndarray]] = {(n, k): [] for n in engines for k in range(len(KINDS))}
    for i, prompt in enumerate(prompts):
        for name in (["base", "spec"] if i % 2 == 0 else ["spec", "base"]):
            gaps[(name, i % len(KINDS))].append(decode_gaps(engines[name], prompt, ns.output_len, evictors[name]))

    def rate(name: str, kinds: range) -> float:
        return 1e3 / np.concatenate([g for k in kinds for g in gaps[(name, k)]]).mean()

    every = range(len(KINDS))
    b, s = rate("base", every), rate("spec", every)
    print(f"copy{ns.num_prompts} paired: base {b:.1f} tok/s, speculative {s:.1f} tok/s, ratio {s / b:.3f}x")
    for k, label in enumerate(KINDS[:min(len(KINDS), ns.num_prompts)]):
        kb, ks = rate("base", range(k, k + 1)), rate("spec", range(k, k + 1))
        print(f"  {label:16s} base {kb:.1f}, speculative {ks:.1f}, ratio {ks / kb:.3f}x")


if __name__ == "__main__":
    main()
