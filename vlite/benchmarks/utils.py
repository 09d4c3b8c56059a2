"""Helpers shared by the benchmarks: statistics, report printing, JSON output, the profiler flag."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Optional

from vlite import profiler
from vlite.entrypoints.cli.args import non_negative_int, parse_number, positive_int


def range_ratio(text: str) -> float:
    value = parse_number(text, float)
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {value}")
    return value


def add_dataset_args(parser: argparse.ArgumentParser, default_num_prompts: int) -> Any:
    """The dataset flags shared by the offline and the serving benchmark; returns their group."""
    group = parser.add_argument_group("dataset options")
    group.add_argument("--dataset", default="random", choices=["random", "copy"],
                       help="where prompts come from when no --dataset-path is given: random token ids, or "
                            "chat prompts whose answers copy spans of the prompt (repeat, correct typos, rename "
                            "a function; at most --output-len tokens each, to the model's end of answer) "
                            "(default: %(default)s)")
    group.add_argument("--dataset-path", default=None, metavar="FILE",
                       help='a JSON list of {"prompt_token_ids": [...], "output_len": n}; overrides --dataset')
    group.add_argument("--num-prompts", type=positive_int, default=None, metavar="N",
                       help=f"number of requests (default: {default_num_prompts} random ones, or every entry "
                            "of --dataset-path)")
    group.add_argument("--input-len", type=positive_int, default=128, metavar="N",
                       help="prompt tokens of a random request (default: %(default)s)")
    group.add_argument("--output-len", type=positive_int, default=128, metavar="N",
                       help="tokens generated per random request (default: %(default)s)")
    group.add_argument("--range-ratio", type=range_ratio, default=0.0, metavar="R",
                       help="random lengths are uniform in [(1-R)*len, (1+R)*len] (default: %(default)s)")
    group.add_argument("--shared-prefix-len", type=non_negative_int, default=0, metavar="N",
                       help="random prompts all start with the same N random tokens, before their own "
                            "--input-len ones: a shared system prompt or document (default: %(default)s)")
    return group


def add_output_args(parser: argparse.ArgumentParser, profile: bool = True) -> None:
    group = parser.add_argument_group("report options")
    group.add_argument("--output-json", default=None, metavar="FILE", help="also save the results as JSON to FILE")
    if profile:
        group.add_argument("--profile", action="store_true",
                           help="time the phases of each engine step (sets VLITE_PROFILE=1) and print a table")


# --------------------------------------------------------------------------------------------------
# Statistics
# --------------------------------------------------------------------------------------------------

def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between the closest ranks; nan if empty."""
    if not values:
        return math.nan
    data = sorted(values)
    pos = (len(data) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def describe(values: Sequence[float], percentiles: Iterable[float] = (50, 90, 99)) -> dict[str, float]:
    """{"mean", "p50", "p90", ..., "count"} of `values` (nan when empty)."""
    out: dict[str, float] = {"mean": sum(values) / len(values) if values else math.nan}
    for q in percentiles:
        out[f"p{q:g}"] = percentile(values, q)
    out["count"] = len(values)
    return out


# --------------------------------------------------------------------------------------------------
# Reports
# --------------------------------------------------------------------------------------------------

def print_block(title: str, rows: list[tuple[str, Any]], file: Any = None) -> None:
    """A titled list of `label: value` lines, values aligned (vLLM's benchmark style)."""
    out = file if file is not None else sys.stdout
    width = max([len(label) for label, _ in rows] + [40])
    total = max(width + 16, len(title) + 6)
    print(f"{' ' + title + ' ':=^{total}}", file=out)
    for label, value in rows:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        print(f"{label + ':':<{total - 14}}{text:>14}", file=out)
    print("=" * total, file=out, flush=True)


def write_json(path: str | None, results: dict) -> None:
    if not path:
        return
    with open(path, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=2, default=str)
        f.write("\n")
    print(f"results saved to {path}", file=sys.stderr)


def jsonable_args(ns: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in vars(ns).items() if k != "handler" and not callable(v)}


# --------------------------------------------------------------------------------------------------
# Profiler
# --------------------------------------------------------------------------------------------------

def setup_profiler(ns: argparse.Namespace) -> bool:
    """`--profile` (or VLITE_PROFILE=1 in the environment): turn the step profiler on. Returns whether it is on."""
    if getattr(ns, "profile", False):
        profiler.enable()  # in this process only: the environment (and any child process) is left alone
    return profiler.is_enabled()


def finish_profiler(results: dict, wall_s: float | None) -> None:
    """Put the profile in `results` and print its table (then forget it)."""
    if not profiler.is_enabled() or not profiler.summary():
        return
    results["profile"] = {"steps": profiler.num_steps(), "phases": profiler.summary(), "wall_s": wall_s}
    profiler.print_summary(wall_s=wall_s)
    profiler.reset()
    profiler.enable(profiler._env_enabled())  # back to what the environment asks for


def hardware_report(engine: Any) -> dict[str, Any]:
    """The CPU, its relevant flags, the kernel build and the weight layout a benchmark ran with."""
    from vlite import _custom_ops

    report = _custom_ops.describe()
    runner = getattr(getattr(engine, "engine_core", None), "model_runner", None)
    plan = getattr(runner, "quantization", None)
    report["weights"] = plan.describe() if plan is not None else "unknown"
    kv = getattr(engine, "kv_cache_config", None)
    if kv is not None:
        from vlite.core.kv_cache_interface import kv_cache_report

        report["kv_cache_groups"] = kv_cache_report(kv)
        report["kv_block_bytes"], report["num_kv_blocks"] = kv.block_bytes, kv.num_blocks
    return report


def print_hardware(report: dict[str, Any]) -> None:
    print(f"cpu: {report['cpu']} [{' '.join(report['cpu_flags'])}]; kernels: {report['kernels']}"
          f"{' (forced by VLITE_CPU_ISA)' if report.get('forced_isa') else ''}; weights: {report['weights']}")
    for g in report.get("kv_cache_groups", ()):
        if "state_bytes_per_request" in g:
            print(f"kv cache group {g['kind']}: {g['layers']} layers, {g['state_bytes_per_request']} state bytes per "
                  f"request ({g['state_slots']} slots, {g['cached_state_slots']} for the prefix cache)")
        else:
            window = f", window {g['window']}" if g["window"] else ""
            print(f"kv cache group {g['kind']}: {g['layers']} layers{window}, {g['kv_bytes_per_token']} KV bytes per "
                  f"token")


def spec_decoding_report(before: Any, after: Any) -> Optional[dict[str, float]]:
    """Speculative decoding over a measured run (SpecDecodingStats before and after it), or None."""
    from vlite.core.sched.stats import SpecDecodingStats

    if after is None:
        return None
    run = SpecDecodingStats(*(getattr(after, f) - (getattr(before, f) if before else 0)
                              for f in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")))
    return {"num_drafts": run.num_drafts, "num_draft_tokens": run.num_draft_tokens,
            "num_accepted_tokens": run.num_accepted_tokens, "acceptance_rate": run.acceptance_rate,
            "mean_acceptance_length": run.mean_acceptance_length}


def spec_decoding_rows(report: Optional[dict[str, float]]) -> list[tuple[str, Any]]:
    if report is None:
        return []
    return [("Spec drafts", report["num_drafts"]), ("Spec draft tokens", report["num_draft_tokens"]),
            ("Spec accepted tokens", report["num_accepted_tokens"]),
            ("Spec acceptance rate", report["acceptance_rate"]),
            ("Spec mean acceptance length", report["mean_acceptance_length"])]


def alternate_runs(llm: Any, prompts: list, params_of: Callable[[str], list], kinds: tuple[str, str],
                   rounds: int) -> dict[str, float]:
    """Best output tok/s of each of two kinds of run of the same prompts (`params_of(kind)`: their
    SamplingParams), alternating which goes first per round, with a line per run (VLITE_PROFILE=1 adds the
    phase times): A/B cost checks such as benchmarks/structured_outputs.py."""
    best = dict.fromkeys(kinds, 0.0)
    for rnd in range(rounds):
        for kind in (kinds if rnd % 2 == 0 else kinds[::-1]):
            params = params_of(kind)
            llm.reset_prefix_cache()
            profiler.reset()
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
            best[kind] = max(best[kind], tokens / elapsed)
            line = f"{kind:6s}: {tokens} tokens in {elapsed:.2f} s = {tokens / elapsed:.1f} output tok/s"
            if profiler.is_enabled():
                line += "  " + ", ".join(f"{k} {v['seconds']:.3f} s" for k, v in profiler.summary().items())
            print(line, flush=True)
    return best
