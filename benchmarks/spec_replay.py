"""Speculative decoding's single-stream ratio predicted offline: the greedy outputs of copy prompts replayed
through NgramProposer and DraftPolicy with a table of step costs, no model in the loop.

    python benchmarks/spec_replay.py [--num-prompts 30] [--cost 1,1.3,1.5,...]

The outputs come from one base engine run (greedy, so they are what a speculative engine emits too).
At each position the proposer drafts from the tokens so far, the policy picks a draft count, the
drafts that equal the output are accepted, and the step costs `cost[drafts]` base steps. Printed: the
predicted ratio (tokens per base-step time) per prompt kind; the same with an oracle that verifies
exactly the drafts that will be accepted (the most any draft-count policy gets from these drafts);
and the ratio if every verified row cost 0.9 / 0.8 / 0.7 of what it does (what a cheaper verify row
is worth). `--cost`: step cost for 1, 2, ... tokens, x a 1-token step, as `spec_steps.py` measures it
(default: the AVX2 path's, sixteenth session); `--policy-cost`: the table the policy decides by, where
it differs (the engine's start-up timings, which spec_steps.py prints). One policy serves all prompts,
as in the engine.
"""

from __future__ import annotations

import argparse
from typing import Optional

import numpy as np
from spec_paired import KINDS, copy_prompts  # the script beside this one (python benchmarks/...)

from vlite import LLM
from vlite.config import SpeculativeConfig
from vlite.sampling_params import SamplingParams
from vlite.spec_decode.draft_policy import DraftPolicy
from vlite.spec_decode.ngram_proposer import NgramProposer

# engine steps of 1..9 tokens, x a base step (benchmarks/spec_steps.py, AVX2 path, 2026-12-03, sixteenth
# session; the fifteenth's, from the start-up table: 1, 1.3, 1.5, 1.75, 1.95, 2.1, 2.17, 2.25, 2.8)
AVX2_COST = [1.0, 1.21, 1.38, 1.59, 1.83, 1.99, 2.16, 2.36, 2.41]


def replay(data: list[tuple[list[int], list[int]]], cost: np.ndarray, config: SpeculativeConfig,
           oracle: bool = False, policy_cost: Optional[np.ndarray] = None) -> tuple[float, list[float]]:
    """(ratio, ratio per kind) of replaying `data` (prompt, greedy output) with step costs `cost`; the
    policy decides by `policy_cost` (the engine's: its start-up timings) where given, else by `cost`."""
    k = config.num_speculative_tokens
    kind_tokens, kind_cost = np.zeros(len(KINDS)), np.zeros(len(KINDS))
    # One policy for all prompts, as the engine's: its match-length buckets carry what earlier requests
    # taught them (a fresh policy per prompt predicted 1.47x for the 12 prompts the engine ran at 1.70x).
    proposer, policy = NgramProposer(config), DraftPolicy(k, cost if policy_cost is None else policy_cost)
    for idx, (prompt, out) in enumerate(data):
        acc, rej = np.zeros(1), np.zeros(1)
        seq = np.array(prompt + out, dtype=np.int64)
        i, spent = 0, 0.0
        while i < len(out):
            n = len(prompt) + i
            drafts, num, match_len = proposer.propose(seq[None, :n], np.array([n]), np.array([k]))
            if not oracle:
                num = np.minimum(num, policy.num_drafts(acc, rej, match_len))
            m = min(int(num[0]), len(out) - i - 1)
            a = 0
            while a < m and drafts[0, a] == seq[n + a]:
                a += 1
            if oracle:
                m = a  # verify exactly the drafts that will be accepted
            spent += cost[m]
            i += a + 1
            acc, rej = policy.update(acc, rej, np.array([m]), np.array([a]), match_len)
        kind_tokens[idx % len(KINDS)] += len(out)
        kind_cost[idx % len(KINDS)] += spent
    return kind_tokens.sum() / kind_cost.sum(), list(kind_tokens / np.maximum(kind_cost, 1e-9))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=30)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--cost", type=str, default=",".join(map(str, AVX2_COST)))
    parser.add_argument("--policy-cost", type=str, default=None,
                        help="the table the policy decides by (the engine's start-up one), if not --cost")
    parser.add_argument("--num-speculative-tokens", type=int, default=8)
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    ns = parser.parse_args()
    cost = np.array([float(c) for c in ns.cost.split(",")])
    policy_cost = None if ns.policy_cost is None else np.array([float(c) for c in ns.policy_cost.split(",")])
    for flag, table in (("--cost", cost), ("--policy-cost", policy_cost)):
        if table is not None and len(table) < ns.num_speculative_tokens + 1:
            parser.error(f"{flag} needs {ns.num_speculative_tokens + 1} values (1..k+1 tokens), got {len(table)}")
    llm = LLM()
    tok = llm.get_tokenizer()
    prompts = copy_prompts(tok, ns.num_prompts, ns.output_len)
    # one prompt at a time: a single stream's numerics (a batch of many rows runs without the residual
    # int8 rows on the AVX2 path, and its greedy outputs may differ)
    params = SamplingParams(temperature=0.0, max_tokens=ns.output_len)
    data = [(p, list(llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0].token_ids))
            for p in prompts]
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=ns.num_speculative_tokens,
                               prompt_lookup_min=ns.prompt_lookup_min, prompt_lookup_max=ns.prompt_lookup_max)

    def show(label: str, c: np.ndarray, oracle: bool = False, pc: Optional[np.ndarray] = policy_cost) -> None:
        ratio, kinds = replay(data, c, config, oracle, pc)
        print(f"{label:28s} {ratio:.3f}x  (" + ", ".join(f"{k} {r:.2f}" for k, r in zip(KINDS, kinds)) + ")")

    print(f"{sum(len(o) for _, o in data)} output tokens, step costs {cost.tolist()}")
    show("policy", cost)
    show("oracle draft counts", cost, oracle=True)
    for s in (0.9, 0.8, 0.7):
        show(f"verified rows at {s:.1f} the cost", 1 + s * (cost - 1),
             pc=None if policy_cost is None else 1 + s * (policy_cost - 1))


if __name__ == "__main__":
    main()
