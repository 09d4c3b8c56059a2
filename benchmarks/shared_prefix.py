"""32 requests sharing one long prompt, in whatever vlite tree PYTHONPATH points at (issue 47's workload).

Each request is the same PREFIX_LEN random tokens plus 24 of its own, 128 output tokens (temperature 1,
ignore_eos); PREFIX_LEN 0 is the same requests without the shared prompt. The prompts are built here rather
than by `vlite bench throughput --shared-prefix-len`, so that trees from before that flag existed run the
same workload: alternate trees by running this once per tree, in turn.

    PYTHONPATH=/path/to/tree .venv/bin/python benchmarks/shared_prefix.py [PREFIX_LEN] [ITERS] [OUTPUT_LEN]

MODEL=path.gguf picks another model. Prints the tree, the prefix length and each iteration's output tok/s
(the prefix cache reset before each). Figures: docs/benchmarks.md ("Long shared context").
"""

from __future__ import annotations

import os
import random
import sys
import time

import vlite
from vlite import LLM, SamplingParams


def main(prefix_len: int, iters: int, output_len: int) -> None:
    llm = LLM(**({"model": os.environ["MODEL"]} if os.environ.get("MODEL") else {}), max_model_len=4096)
    rng = random.Random(0)
    prefix = [rng.randrange(100, 30000) for _ in range(prefix_len)]
    prompts = [{"prompt_token_ids": prefix + [rng.randrange(100, 30000) for _ in range(24)]} for _ in range(32)]
    llm.generate([{"prompt_token_ids": prefix[:16] or [100] * 16}], SamplingParams(max_tokens=2), use_tqdm=False)
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=1.0)
    rates = []
    for _ in range(iters):
        llm.reset_prefix_cache()
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        rates.append(len(prompts) * output_len / (time.perf_counter() - start))
    tree = os.path.dirname(os.path.dirname(os.path.abspath(vlite.__file__)))
    print(f"{tree} prefix {prefix_len} out tok/s {[round(r, 1) for r in rates]}")


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:4]]
    main(*(args + [2000, 2, 128][len(args):]))
