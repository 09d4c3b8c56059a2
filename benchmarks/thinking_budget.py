"""wl32 with and without thinking budgets (issue 48's cost check: one budgeted request moves throughput <= 2%).

32 random-token prompts as in benchmarks/structured_outputs.py (160 +-60% input, 80 +-60% output tokens,
temperature 1, ignore_eos), each ending in the start tag "<think>" so that its output starts inside a thinking
block (the engine runs a generic reasoning parser with <think> / </think>, several tokens each on the default
model). The "budget" run gives the first NUM_BUDGETED requests a budget of half their output, so their
end tag is forced mid-output (token by token); the "plain" run is the same requests without one. Both
generate the same number of tokens. Runs alternate; the best of each is reported, with the ratio.

    .venv/bin/python benchmarks/thinking_budget.py [ROUNDS] [NUM_BUDGETED] [MODEL]

Figures: docs/benchmarks.md (default model, 2026-12-06: one budgeted request 0.998, all 32 0.972).
"""

from __future__ import annotations

import sys
from typing import Optional

from vlite import LLM, SamplingParams
from vlite.benchmarks.datasets import random_requests, tokenizer_special_ids
from vlite.benchmarks.utils import alternate_runs

TAGS = {"reasoning_start_str": "<think>", "reasoning_end_str": "</think>"}


def main(rounds: int, num_budgeted: int, model: Optional[str]) -> None:
    llm = LLM(**({"model": model} if model else {}), reasoning_parser="generic", reasoning_config=TAGS)
    engine = llm.llm_engine
    tokenizer = engine.get_tokenizer()
    start = tokenizer.encode(TAGS["reasoning_start_str"], add_special_tokens=False)
    reqs = random_requests(32, 160, 80, 0.6, 0, engine.input_processor.vocab_size, tokenizer_special_ids(tokenizer))
    prompts = [{"prompt_token_ids": r.prompt_token_ids + start} for r in reqs]
    llm.generate(prompts, SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up: the first full batch is slow
    best = alternate_runs(llm, prompts, lambda kind: [
        SamplingParams(temperature=1.0, max_tokens=r.output_len, ignore_eos=True,
                       thinking_token_budget=r.output_len // 2 if kind == "budget" and i < num_budgeted else None)
        for i, r in enumerate(reqs)], ("budget", "plain"), rounds)
    print(f"best: plain {best['plain']:.1f}, budget ({num_budgeted} budgeted) {best['budget']:.1f} output tok/s; "
          f"budget / plain = {best['budget'] / best['plain']:.3f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3, int(sys.argv[2]) if len(sys.argv) > 2 else 1,
         sys.argv[3] if len(sys.argv) > 3 else None)
