"""wl32 with and without every request under a JSON schema (issue 15's cost check).

32 random-token prompts, 160 +-60% input and 80 +-60% output tokens (the workload of
`vlite bench throughput --num-prompts 32 --input-len 160 --output-len 80 --range-ratio 0.6`), temperature 1,
ignore_eos, on the default model. The schema's shortest match (40 array items) is longer than any
request's max_tokens, so both runs generate exactly the same tokens' count; the grammar is compiled once
in the warm-up (cached by its spec, as on a server that sees the schema again). Runs alternate; the best
of each is reported, with the ratio (issue 15 asks for >= 0.9).

    .venv/bin/python benchmarks/structured_outputs.py [ROUNDS]      (VLITE_PROFILE=1 adds the phase times)
"""

from __future__ import annotations

import sys

from vlite import LLM, SamplingParams, StructuredOutputsParams
from vlite.benchmarks.datasets import random_requests, tokenizer_special_ids
from vlite.benchmarks.utils import alternate_runs

SCHEMA = {"type": "array", "minItems": 40, "items": {
    "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999},
                                     "name": {"type": "string", "maxLength": 16}, "ok": {"type": "boolean"}},
    "required": ["id", "name", "ok"], "additionalProperties": False}}


def main(rounds: int) -> None:
    llm = LLM()
    engine = llm.llm_engine
    reqs = random_requests(32, 160, 80, 0.6, 0, engine.input_processor.vocab_size,
                           tokenizer_special_ids(engine.get_tokenizer()))
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in reqs]
    schema = StructuredOutputsParams(json=SCHEMA)
    llm.generate([prompts[0]], SamplingParams(max_tokens=2, structured_outputs=schema), use_tqdm=False)  # warm-up
    best = alternate_runs(llm, prompts, lambda kind: [
        SamplingParams(temperature=1.0, max_tokens=r.output_len, ignore_eos=True,
                       structured_outputs=schema if kind == "json" else None) for r in reqs], ("json", "plain"), rounds)
    print(f"best: plain {best['plain']:.1f}, json {best['json']:.1f} output tok/s; "
          f"json / plain = {best['json'] / best['plain']:.3f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
