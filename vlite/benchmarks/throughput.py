"""`vlite bench throughput`: offline throughput of one `LLM.generate` over many requests.

Every request generates exactly its `output_len` tokens (`ignore_eos=True`). The timer covers
the `generate` call only (not the model load, not the warmup). Counted:

    input tokens   the prompts' token ids
    output tokens  the tokens generated (= the sum of the requests' output_len)

`--compare-hf` runs the same requests through transformers' `generate` in the same process:
static batches of `--hf-batch-size` requests in dataset order, left-padded, greedy, each batch
generating `max(output_len)` of its requests (`min_new_tokens = max_new_tokens`, so EOS never
ends a row early). Its output tokens are counted like vlite's, each request's own `output_len`;
the extra tokens a row generates past its own length (padding to the batch's longest) are
reported separately as `padding output tokens` and not counted. Its timer covers the `generate`
calls only.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import asdict
from typing import Any

from vlite.benchmarks.datasets import (BenchRequest, copy_requests, load_json_dataset, random_requests, summarize,
                                       tokenizer_special_ids)
from vlite.benchmarks.utils import (
    add_dataset_args,
    add_output_args,
    finish_profiler,
    hardware_report,
    jsonable_args,
    print_block,
    print_hardware,
    setup_profiler,
    spec_decoding_report,
    spec_decoding_rows,
    write_json,
)
from vlite.entrypoints.cli.args import add_common_args, add_engine_args, engine_args_from_cli, positive_int
from vlite.entrypoints.cli.engine import configure_quiet

HELP = "offline throughput: requests/s and tokens/s of one LLM.generate (optionally vs transformers)"
DESCRIPTION = ("Offline throughput: all requests go into one LLM.generate; prints requests/s, input, output and "
               "total tokens/s. Random token-id prompts (--dataset random) or a JSON file (--dataset-path) of "
               '[{"prompt_token_ids": [...], "output_len": n}, ...]. Every request generates exactly its output '
               "length (ignore_eos). --compare-hf also runs them through transformers' generate.")

DEFAULT_NUM_PROMPTS = 64


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = add_dataset_args(parser, DEFAULT_NUM_PROMPTS)
    group = parser.add_argument_group("benchmark options")
    group.add_argument("--temperature", type=float, default=1.0, metavar="T",
                       help="sampling temperature of vlite's requests; 0 is greedy, as transformers runs "
                            "(default: %(default)s, as vllm bench throughput)")
    group.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                       help="run one short request before timing, then reset the prefix cache (default: on)")
    group.add_argument("--progress", action="store_true", help="show a progress bar while generating")
    group = parser.add_argument_group("transformers comparison")
    group.add_argument("--compare-hf", action="store_true",
                       help="also run the requests through transformers' AutoModelForCausalLM.generate")
    group.add_argument("--hf-batch-size", type=positive_int, default=16, metavar="N",
                       help="static batch size of the transformers run (default: %(default)s)")
    group.add_argument("--hf-dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                       help="dtype of the transformers model (default: %(default)s)")
    add_output_args(parser)
    add_common_args(parser)
    add_engine_args(parser)


def get_requests(ns: argparse.Namespace, tokenizer: Any = None, vocab_size: int | None = None
                 ) -> list[BenchRequest]:
    """The benchmark's requests from the parsed flags (the random ones need the model's vocabulary)."""
    if ns.dataset_path:
        return load_json_dataset(ns.dataset_path, ns.num_prompts)
    if ns.dataset == "copy":
        if tokenizer is None:
            raise ValueError("copy prompts need the model's tokenizer")
        return copy_requests(tokenizer, ns.num_prompts or DEFAULT_NUM_PROMPTS, ns.output_len, ns.seed)
    if vocab_size is None:
        raise ValueError("random prompts need the model's vocab_size")
    return random_requests(ns.num_prompts or DEFAULT_NUM_PROMPTS, ns.input_len, ns.output_len, ns.range_ratio,
                           ns.seed, vocab_size, tokenizer_special_ids(tokenizer) if tokenizer is not None else (),
                           shared_prefix_len=ns.shared_prefix_len)


def _rates(num_requests: int, input_tokens: int, output_tokens: int, elapsed: float) -> dict[str, float]:
    elapsed = max(elapsed, 1e-9)
    return {
        "elapsed_s": elapsed,
        "num_requests": num_requests,
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "requests_per_s": num_requests / elapsed,
        "input_tokens_per_s": input_tokens / elapsed,
        "output_tokens_per_s": output_tokens / elapsed,
        "total_tokens_per_s": (input_tokens + output_tokens) / elapsed,
    }


def run_vlite(llm: Any, requests: list[BenchRequest], temperature: float = 1.0, progress: bool = False,
              warmup: bool = True) -> dict[str, Any]:
    """Generate every request in one LLM.generate; the rates and what was counted."""
    from vlite import profiler
    from vlite.sampling_params import SamplingParams

    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [SamplingParams(temperature=temperature, top_p=1.0, max_tokens=r.output_len, ignore_eos=r.ignore_eos,
                             detokenize=True) for r in requests]
    if warmup:
        first = requests[0]
        llm.generate([{"prompt_token_ids": first.prompt_token_ids[:16]}],
                     SamplingParams(temperature=temperature, max_tokens=2, ignore_eos=True), use_tqdm=False)
        llm.reset_prefix_cache()
    profiler.reset()
    spec_before = llm.llm_engine.engine_core.make_stats().spec_decoding
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=progress)
    elapsed = time.perf_counter() - start
    spec = spec_decoding_report(spec_before, llm.llm_engine.engine_core.make_stats().spec_decoding)
    input_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    expected = sum(r.output_len for r in requests)
    if output_tokens != expected and all(r.ignore_eos for r in requests):
        print(f"warning: generated {output_tokens} tokens, expected {expected} (max_model_len reached?)",
              file=sys.stderr)
    rates: dict[str, Any] = _rates(len(outputs), input_tokens, output_tokens, elapsed)
    if spec is not None:
        rates["spec_decoding"] = spec
    return rates


# --------------------------------------------------------------------------------------------------
# transformers
# --------------------------------------------------------------------------------------------------

def load_hf_model(resolved: Any, dtype_name: str, verbose: bool = False) -> Any:
    """The same model in transformers: a GGUF through `gguf_file=`, else the Hugging Face folder."""
    import torch
    import transformers
    from packaging.version import Version
    from transformers import AutoModelForCausalLM

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype_name]
    # transformers renamed torch_dtype= to dtype= in 4.56.
    key = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
    kwargs: dict[str, Any] = {key: dtype}
    if resolved.gguf_file is not None:
        kwargs["gguf_file"] = resolved.gguf_file.name
    if not verbose:  # transformers' GGUF conversion shows a tqdm bar of its own
        os.environ.setdefault("TQDM_DISABLE", "1")
    return AutoModelForCausalLM.from_pretrained(str(resolved.path), **kwargs).eval()


def _hf_pad_id(model: Any) -> int:
    for value in (model.generation_config.pad_token_id, model.generation_config.eos_token_id,
                  model.config.eos_token_id):
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    return 0


def _hf_generate(model: Any, batch: list[BenchRequest], pad_id: int) -> int:
    """Greedy generate of one left-padded batch; returns the number of new tokens per row."""
    import torch

    width = max(r.prompt_len for r in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, r in enumerate(batch):
        input_ids[i, width - r.prompt_len:] = torch.tensor(r.prompt_token_ids)
        attention_mask[i, width - r.prompt_len:] = 1
    new_tokens = max(r.output_len for r in batch)
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=pad_id,
                             temperature=None, top_p=None, top_k=None)
    return int(out.shape[1] - width)


def run_hf(model: Any, requests: list[BenchRequest], batch_size: int = 16, warmup: bool = True) -> dict[str, Any]:
    """The requests through transformers' generate in static batches; rates counted as in the module doc."""
    pad_id = _hf_pad_id(model)
    if warmup:
        first = requests[0]
        _hf_generate(model, [BenchRequest(first.prompt_token_ids[:16], 2)], pad_id)
    elapsed = 0.0
    generated = 0
    for i in range(0, len(requests), batch_size):
        batch = requests[i:i + batch_size]
        start = time.perf_counter()
        per_row = _hf_generate(model, batch, pad_id)
        elapsed += time.perf_counter() - start
        generated += per_row * len(batch)
    counts = summarize(requests)
    result = _rates(len(requests), counts["input_tokens"], counts["output_tokens"], elapsed)
    result["padding_output_tokens"] = generated - counts["output_tokens"]
    result["batch_size"] = batch_size
    return result


# --------------------------------------------------------------------------------------------------
# Command
# --------------------------------------------------------------------------------------------------

def _report_rows(r: dict[str, Any]) -> list[tuple[str, Any]]:
    return [
        ("Requests", r["num_requests"]),
        ("Input tokens", r["input_tokens"]),
        ("Output tokens", r["output_tokens"]),
        ("Elapsed (s)", r["elapsed_s"]),
        ("Requests/s", r["requests_per_s"]),
        ("Input tok/s", r["input_tokens_per_s"]),
        ("Output tok/s", r["output_tokens_per_s"]),
        ("Total tok/s", r["total_tokens_per_s"]),
    ] + spec_decoding_rows(r.get("spec_decoding"))


def run_throughput(ns: argparse.Namespace) -> dict[str, Any]:
    """The whole benchmark from parsed flags; returns the results (also printed)."""
    from vlite.entrypoints.llm import LLM

    if ns.dataset_path:  # a bad file fails before the slow load
        requests: list[BenchRequest] | None = get_requests(ns)
    else:
        requests = None
    setup_profiler(ns)
    engine_args = engine_args_from_cli(ns)
    configure_quiet(getattr(ns, "verbose", False))
    llm = LLM(**asdict(engine_args))
    engine = llm.llm_engine
    if requests is None:
        requests = get_requests(ns, engine.get_tokenizer(), engine.input_processor.vocab_size)

    results: dict[str, Any] = {
        "benchmark": "throughput",
        "model": engine.resolved_model.name,
        "dtype": engine.model_config.torch_dtype_name,
        "args": jsonable_args(ns),
        "hardware": hardware_report(engine),
    }
    vlite_result = run_vlite(llm, requests, ns.temperature, ns.progress, ns.warmup)
    results["vlite"] = vlite_result
    print_hardware(results["hardware"])
    print_block(f"vlite throughput ({results['model']}, {results['dtype']})", _report_rows(vlite_result))
    finish_profiler(results, vlite_result["elapsed_s"])

    if ns.compare_hf:
        model = load_hf_model(engine.resolved_model, ns.hf_dtype, getattr(ns, "verbose", False))
        hf_result = run_hf(model, requests, ns.hf_batch_size, ns.warmup)
        hf_result["dtype"] = ns.hf_dtype
        results["hf"] = hf_result
        ratio = {k: vlite_result[k] / hf_result[k] if hf_result[k] else float("nan")
                 for k in ("requests_per_s", "output_tokens_per_s", "total_tokens_per_s")}
        results["vlite_over_hf"] = ratio
        rows = _report_rows(hf_result) + [
            ("Padding output tokens (not counted)", hf_result["padding_output_tokens"]),
            ("vlite/HF requests/s", ratio["requests_per_s"]),
            ("vlite/HF output tok/s", ratio["output_tokens_per_s"]),
            ("vlite/HF total tok/s", ratio["total_tokens_per_s"]),
        ]
        print_block(f"transformers generate (batch {ns.hf_batch_size}, {ns.hf_dtype}, greedy)", rows)
    write_json(ns.output_json, results)
    return results


def main(ns: argparse.Namespace) -> int:
    run_throughput(ns)
    return 0
