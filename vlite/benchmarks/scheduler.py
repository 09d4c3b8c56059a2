"""`vlite bench scheduler`: the cost of the pure-Python scheduler per engine step, without a model.

A `Scheduler` over a `KVCacheManager` gets `--num-requests` requests of `--prompt-len` random
tokens. A fake model answers every step (one token per sampled request), first until every
request has finished its prompt and runs in the decode phase, then for `--num-warmup-steps`
untimed steps, then for `--num-steps` timed ones. Per step, the time of `schedule()` plus
`update_from_output()` is recorded (building the fake model output is not); the report gives
the mean, p50 and p99 in microseconds, of both calls together and of each.

The KV pool is sized so that nothing is preempted, and requests never reach their max_tokens,
so every timed step schedules all requests for one decode token each. Every `block_size` steps
each request fills a block, which is hashed and registered in the prefix cache (when enabled).
No torch, no model.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

from vlite.benchmarks.utils import add_output_args, describe, jsonable_args, print_block, write_json
from vlite.entrypoints.cli.args import non_negative_int, positive_int

HELP = "µs per step of the pure-Python Scheduler + KVCacheManager (fake model, decode phase)"
DESCRIPTION = ("Micro-benchmark of the scheduler alone: --num-requests running requests in the decode phase, a "
               "fake model output each step; times schedule() + update_from_output() per step (mean, p50, p99 "
               "in µs). No torch, no model.")


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("benchmark options")
    group.add_argument("--num-requests", type=positive_int, default=256, metavar="N",
                       help="running requests (default: %(default)s)")
    group.add_argument("--prompt-len", type=positive_int, default=128, metavar="N",
                       help="prompt tokens per request (default: %(default)s)")
    group.add_argument("--num-steps", type=positive_int, default=1000, metavar="N",
                       help="timed decode steps (default: %(default)s)")
    group.add_argument("--num-warmup-steps", type=non_negative_int, default=50, metavar="N",
                       help="untimed decode steps first (default: %(default)s)")
    group.add_argument("--block-size", type=positive_int, default=16, metavar="N",
                       help="tokens per KV cache block (default: %(default)s)")
    group.add_argument("--max-num-batched-tokens", type=positive_int, default=2048, metavar="N",
                       help="token budget of one step; raised to --num-requests if below (default: %(default)s)")
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                       help="hash and register full blocks in the prefix cache (default: on)")
    group.add_argument("--seed", type=int, default=0, metavar="SEED", help="seed of the random prompts")
    add_output_args(parser, profile=False)


def run_scheduler_bench(num_requests: int = 256, prompt_len: int = 128, num_steps: int = 1000,
                        num_warmup_steps: int = 50, block_size: int = 16, max_num_batched_tokens: int = 2048,
                        enable_prefix_caching: bool = True, seed: int = 0) -> dict[str, Any]:
    from vlite.config import SchedulerConfig
    from vlite.core.kv_cache_manager import KVCacheManager, cdiv
    from vlite.core.sched.output import ModelRunnerOutput
    from vlite.core.sched.scheduler import Scheduler
    from vlite.request import Request
    from vlite.sampling_params import SamplingParams

    budget = max(max_num_batched_tokens, num_requests)
    # Steps until every prompt is computed: each step spends at most num_requests tokens on decodes.
    prefill_steps_bound = num_requests + cdiv(num_requests * prompt_len, max(budget - num_requests, 1))
    max_len = prompt_len + prefill_steps_bound + num_warmup_steps + num_steps + 2
    num_blocks = num_requests * cdiv(max_len, block_size) + 1
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching)
    config = SchedulerConfig(max_num_seqs=num_requests, max_num_batched_tokens=budget, max_model_len=max_len + 1)
    scheduler = Scheduler(config, kv)
    rng = random.Random(seed)
    params = SamplingParams(temperature=0.0, max_tokens=max_len, ignore_eos=True)
    for i in range(num_requests):
        prompt = [rng.randrange(100, 32000) for _ in range(prompt_len)]
        scheduler.add_request(Request(request_id=f"req-{i}", prompt_token_ids=prompt, sampling_params=params,
                                      eos_token_ids=(0,), arrival_time=float(i)))

    token = [100]

    def fake_model_output(so: Any) -> Any:
        req_ids = list(so.sample_req_ids)
        token[0] = token[0] % 30000 + 1
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=[[token[0]] for _ in req_ids])

    # Prefill until every request is decoding (one token per step).
    prefill_steps = 0
    while any(r.num_output_tokens == 0 for r in scheduler.requests.values()):
        so = scheduler.schedule()
        scheduler.update_from_output(so, fake_model_output(so))
        prefill_steps += 1
        if prefill_steps > prefill_steps_bound:
            raise RuntimeError("the requests did not all reach the decode phase")

    schedule_us: list[float] = []
    update_us: list[float] = []
    clock = time.perf_counter_ns
    for step in range(num_warmup_steps + num_steps):
        t0 = clock()
        so = scheduler.schedule()
        t1 = clock()
        output = fake_model_output(so)
        t2 = clock()
        scheduler.update_from_output(so, output)
        t3 = clock()
        if step >= num_warmup_steps:
            if len(so.num_scheduled_tokens) != num_requests:
                raise RuntimeError(f"step scheduled {len(so.num_scheduled_tokens)} of {num_requests} requests")
            schedule_us.append((t1 - t0) / 1e3)
            update_us.append((t3 - t2) / 1e3)
    if scheduler.num_preemptions or len(scheduler.requests) != num_requests:
        raise RuntimeError("a request was preempted or finished during the benchmark")
    total_us = [a + b for a, b in zip(schedule_us, update_us)]
    return {
        "benchmark": "scheduler",
        "num_requests": num_requests,
        "prompt_len": prompt_len,
        "num_steps": num_steps,
        "prefill_steps": prefill_steps,
        "block_size": block_size,
        "enable_prefix_caching": enable_prefix_caching,
        "step_us": describe(total_us, (50, 99)),
        "schedule_us": describe(schedule_us, (50, 99)),
        "update_from_output_us": describe(update_us, (50, 99)),
        "steps_per_s": 1e6 / (sum(total_us) / len(total_us)),
    }


def format_table(results: dict[str, Any]) -> str:
    lines = [f"{'µs per step':<32}{'mean':>10}{'p50':>10}{'p99':>10}"]
    for label, key in (("schedule + update_from_output", "step_us"), ("  schedule()", "schedule_us"),
                       ("  update_from_output()", "update_from_output_us")):
        d = results[key]
        lines.append(f"{label:<32}{d['mean']:>10.1f}{d['p50']:>10.1f}{d['p99']:>10.1f}")
    return "\n".join(lines)


def main(ns: argparse.Namespace) -> int:
    results = run_scheduler_bench(ns.num_requests, ns.prompt_len, ns.num_steps, ns.num_warmup_steps,
                                  ns.block_size, ns.max_num_batched_tokens, ns.enable_prefix_caching, ns.seed)
    results["args"] = jsonable_args(ns)
    print_block("vlite scheduler (no model)", [
        ("Running requests", results["num_requests"]),
        ("Prompt tokens each", results["prompt_len"]),
        ("Timed decode steps", results["num_steps"]),
        ("Prefix caching", "on" if results["enable_prefix_caching"] else "off"),
        ("Mean µs per step", results["step_us"]["mean"]),
        ("Steps/s (scheduler alone)", results["steps_per_s"]),
    ])
    print(format_table(results))
    write_json(ns.output_json, results)
    return 0
