"""The flags of the `vlite` command line and their validators, shared by every subcommand and benchmark.

* `add_engine_args(parser)` adds the engine flags (vLLM's names), mirroring `EngineArgs`;
  `engine_args_from_cli(ns)` turns the parsed namespace back into an `EngineArgs`.
* `add_sampling_args` / `sampling_params`: the sampling flags of `generate` and `chat`.
* `add_common_args`: `-v/--verbose`.
* The validators (`positive_int`, `non_negative_int`, `positive_float`, `non_negative_float`,
  `parse_size`) are argparse `type=` functions: a bad value is argparse's usage error (exit 2) naming
  the flag. `parse_number` is their first half, for validators written elsewhere.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from dataclasses import fields
from typing import Any, Callable, Optional, TypeVar

from vlite.config import CONVERTS, QUANTIZATION_CHOICES, RUNNERS
from vlite.engine.arg_utils import EngineArgs
from vlite.sampling_params import RequestOutputKind, SamplingParams

_ENGINE_DEFAULTS = EngineArgs()

Number = TypeVar("Number", int, float)

# --------------------------------------------------------------------------------------------------
# Validators
# --------------------------------------------------------------------------------------------------

def parse_number(text: str, kind: Callable[[str], Number], what: str = "number", hint: str = "") -> Number:
    """`kind(text)`, or argparse's error `invalid <what> 'text'<hint>`."""
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid {what} {text!r}{hint}") from None


def positive_int(text: str) -> int:
    value = parse_number(text, int, "integer")
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = parse_number(text, int, "integer")
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be non-negative, got {value}")
    return value


def positive_float(text: str) -> float:
    """A finite number above 0."""
    value = parse_number(text, float)
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def non_negative_float(text: str) -> float:
    """A finite number, 0 or above."""
    value = parse_number(text, float)
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative number, got {text}")
    return value


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?)(i?)(b?)\s*$", re.IGNORECASE)
_SIZE_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def parse_size(text: str) -> int:
    """A byte count: `1073741824`, `512M`, `1G`, `1GiB`, `1.5G` (binary units), or `500MB` (decimal).

    A bare suffix (K, M, G, T, case-insensitive) and the IEC forms (KiB, MiB, ...) are powers of
    1024, as memory sizes usually are; only the SI forms with a `B` and no `i` (KB, MB, GB, TB)
    are powers of 1000.
    """
    match = _SIZE_RE.match(str(text))
    if not match:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}; use bytes or a suffix like 512M, 1G, 1GiB")
    number, unit, iec, byte = match.groups()
    unit = unit.lower()
    if iec and not unit:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}; use bytes or a suffix like 512M, 1G, 1GiB")
    base = 1000 if (byte and not iec and unit) else 1024
    value = int(float(number) * base ** _SIZE_POWERS[unit])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return value


# --------------------------------------------------------------------------------------------------
# Engine flags
# --------------------------------------------------------------------------------------------------

# CLI dest -> EngineArgs field, where the names differ.
_FIELD_FOR_DEST = {"kv_cache_memory": "kv_cache_memory_bytes"}


def add_engine_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the engine flags (one per `EngineArgs` field, vLLM's names) to `parser`."""
    d = _ENGINE_DEFAULTS
    group = parser.add_argument_group("engine options")
    group.add_argument("--model", default=d.model, metavar="MODEL",
                       help="a .gguf file, a folder (Hugging Face safetensors or one .gguf) or a Hugging Face "
                            "repo id; default: the bundled SmolLM2-135M-Instruct")
    group.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16"],
                       help="weight and activation dtype; auto picks bfloat16 on a GPU, where the CPU has native "
                            "bf16, and for quantized weights (the integer kernels), else float32 "
                            "(default: %(default)s)")
    group.add_argument("--quantization", "-q", default=d.quantization, choices=QUANTIZATION_CHOICES,
                       help="weight-only quantization of the linear layers: int8 (per channel) or int4 (groups "
                            "of 32; LM head int8) for every step, or none (dense --dtype weights). Default: "
                            "automatic: a Q4_1 GGUF model in bfloat16 keeps its own 4-bit weights for steps of "
                            "at most 16 tokens (memory-bound decoding) and dense weights above; else dense")
    group.add_argument("--runner", default=d.runner, choices=RUNNERS,
                       help="generate: sample text; pooling: embeddings and scores (/v1/embeddings, /score, "
                            "/rerank); auto: pooling for encoder models (BERT, RoBERTa), else generate "
                            "(default: %(default)s)")
    group.add_argument("--convert", default=d.convert, choices=CONVERTS,
                       help="with --runner pooling, what a decoder model becomes: embed (last-token pooling, "
                            "normalized, or its sentence-transformers pipeline) (default: %(default)s)")
    group.add_argument("--max-model-len", type=positive_int, default=d.max_model_len, metavar="N",
                       help="most tokens (prompt + output) of one request; default: the model's limit, capped by "
                            "the KV cache")
    group.add_argument("--max-num-seqs", type=positive_int, default=d.max_num_seqs, metavar="N",
                       help="most requests running at once (default: %(default)s)")
    group.add_argument("--max-num-batched-tokens", type=positive_int, default=d.max_num_batched_tokens,
                       metavar="N", help="token budget of one engine step (default: %(default)s)")
    group.add_argument("--block-size", type=positive_int, default=d.block_size, metavar="N",
                       help="tokens per KV cache block (default: %(default)s)")
    group.add_argument("--kv-cache-memory", type=parse_size, default=d.kv_cache_memory_bytes, metavar="BYTES",
                       help="size of the KV cache pool in bytes; accepts suffixes: 512M, 1G, 1GiB (powers of "
                            "1024), 500MB (powers of 1000); default: room for 16,384 tokens, at most 512MiB (360MiB "
                            "for the default model in bfloat16)")
    group.add_argument("--seed", type=int, default=d.seed, metavar="SEED",
                       help="random seed of the engine, and so of sampling (default: %(default)s)")
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                       default=d.enable_prefix_caching,
                       help="reuse the KV cache of shared prompt prefixes (default: on)")
    group.add_argument("--scheduling-policy", default=d.scheduling_policy, choices=["fcfs", "priority"],
                       help="order of waiting requests: first come first served, or by priority "
                            "(default: %(default)s)")
    group.add_argument("--long-prefill-token-threshold", type=non_negative_int,
                       default=d.long_prefill_token_threshold, metavar="N",
                       help="cap on the tokens of one prompt prefilled in one step; 0: no cap "
                            "(default: %(default)s)")
    group.add_argument("--max-num-partial-prefills", type=positive_int, default=d.max_num_partial_prefills,
                       metavar="N", help="prompts that may be partway through prefill at once (default: %(default)s)")
    group.add_argument("--tensor-parallel-size", "-tp", type=positive_int, default=d.tensor_parallel_size,
                       metavar="N", help="ranks each layer's weights and KV cache are split over, one worker "
                                         "process each (default: %(default)s)")
    group.add_argument("--data-parallel-size", "-dp", type=positive_int, default=d.data_parallel_size, metavar="N",
                       help="engine cores (each a whole copy of the model, with its own tensor parallelism) behind "
                            "one API server; each request goes to the least loaded (default: %(default)s)")
    group.add_argument("--distributed-executor-backend", default=d.distributed_executor_backend,
                       choices=["uni", "mp", "ray"],
                       help="where the model runs: uni (in the engine-core process), mp (worker processes on "
                            "this machine, torch.distributed/gloo between them); default: uni for one rank, "
                            "mp for more; ray: one Ray actor per rank, on the cluster RAY_ADDRESS names or a local "
                            "one (needs the ray extra)")
    group.add_argument("--speculative-config", default=d.speculative_config, metavar="JSON",
                       help='speculative decoding, as a JSON object with vLLM\'s keys, e.g. \'{"method": "ngram", '
                            '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\' '
                            "(n-gram prompt lookup; default: off)")
    group.add_argument("--enable-lora", action="store_true", default=d.enable_lora,
                       help="serve LoRA adapters: a request may name one (PEFT folders; generation models only)")
    group.add_argument("--max-loras", type=positive_int, default=d.max_loras, metavar="N",
                       help="with --enable-lora, most distinct adapters in one step (default: %(default)s)")
    group.add_argument("--max-lora-rank", type=positive_int, default=d.max_lora_rank, metavar="R",
                       help="with --enable-lora, the largest adapter rank accepted (default: %(default)s)")
    group.add_argument("--max-cpu-loras", type=positive_int, default=d.max_cpu_loras, metavar="N",
                       help="with --enable-lora, adapters kept loaded, least recently used evicted (at least "
                            "--max-loras; default: --max-loras)")
    group.add_argument("--kv-offload-dir", default=d.kv_offload_dir, metavar="PATH",
                       help="keep computed KV blocks as files in this directory, so a prompt prefix is reused after "
                            "a restart and by other servers pointed at it (default: off)")
    group.add_argument("--kv-offload-size", type=positive_float, default=d.kv_offload_size, metavar="GIB",
                       help="with --kv-offload-dir, GiB the directory may hold; the least recently used blocks "
                            "are deleted past it (default: %(default)s)")
    group.add_argument("--chat-template", default=d.chat_template, metavar="TEMPLATE",
                       help="a Jinja chat template, as a file path or a literal template string; "
                            "default: the model's own")
    group.add_argument("--reasoning-parser", default=d.reasoning_parser, metavar="NAME",
                       help="a thinking model's reasoning parser: its output's thinking block goes to `reasoning`, "
                            "apart from the answer, and structured outputs constrain the answer only. deepseek_r1, "
                            "qwen3 (also QwQ, SmolLM3, Phi-4-reasoning), openai_gptoss (gpt-oss's harmony analysis "
                            "channel), or generic with --reasoning-config")
    group.add_argument("--reasoning-config", default=d.reasoning_config, metavar="JSON",
                       help='the reasoning block\'s tags, vLLM\'s keys: \'{"reasoning_start_str": "<think>", '
                            '"reasoning_end_str": "</think>"}\' (needed by --reasoning-parser generic; overrides a '
                            'named parser\'s), and "implicit_start": true where output is reasoning without a '
                            'start tag')
    group.add_argument("--reasoning-budget", type=int, default=d.reasoning_budget, metavar="N",
                       help="with --reasoning-parser, the thinking_token_budget of requests that set none: after N "
                            "thinking tokens the end tag is forced; -1 unlimited, 0 no thinking (default: "
                            "%(default)s)")
    group.add_argument("--device", default=d.device, choices=["auto", "cpu", "cuda"],
                       help="where the model runs; auto: CUDA when torch sees a GPU, else the CPU "
                            "(default: %(default)s)")
    group.add_argument("--enforce-eager", action="store_true", default=d.enforce_eager,
                       help="CUDA: run every step eagerly, without the CUDA graphs captured for decode steps")
    group.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization, metavar="F",
                       help="CUDA: share of the GPU's memory for the engine (weights, activations, KV cache); "
                            "the KV cache gets the rest unless --kv-cache-memory is given (default: %(default)s)")
    group.add_argument("--threads", dest="num_threads", type=positive_int, default=d.num_threads, metavar="N",
                       help="CPU threads running the model (each rank's under tensor parallelism; default: "
                            "VLITE_NUM_THREADS, else every core)")
    return parser


def load_chat_template(value: Optional[str]) -> Optional[str]:
    """`--chat-template`: the contents of the file if `value` names one, else `value` itself."""
    if value is None:
        return None
    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as f:
                return f.read()
        except OSError as e:
            raise ValueError(f"cannot read chat template {value!r}: {e.strerror}") from None
    if "{" not in value and ("/" in value or value.endswith((".jinja", ".j2", ".txt"))):
        # Looks like a path, not a template: say so rather than using it as a literal template.
        raise ValueError(f"chat template file {value!r} does not exist")
    return value


def engine_args_from_cli(ns: argparse.Namespace) -> EngineArgs:
    """The `EngineArgs` named by the engine flags in `ns` (see `add_engine_args`)."""
    kwargs: dict[str, Any] = {}
    names = {f.name for f in fields(EngineArgs)}
    for dest, value in vars(ns).items():
        name = _FIELD_FOR_DEST.get(dest, dest)
        if name in names:
            kwargs[name] = value
    kwargs["chat_template"] = load_chat_template(kwargs.get("chat_template"))
    return EngineArgs.from_kwargs(**kwargs)


# --------------------------------------------------------------------------------------------------
# Sampling and common flags
# --------------------------------------------------------------------------------------------------

def add_common_args(parser: argparse.ArgumentParser) -> None:
    """`-v/--verbose`, which every subcommand takes (before or after its name)."""
    # SUPPRESS: don't overwrite a -v given before the subcommand name.
    parser.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                        help="show the engine's log and the libraries' warnings while loading")


def add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int, temperature: float) -> None:
    """The sampling flags of `generate` and `chat`, with their own defaults for `--max-tokens` and `--temperature`."""
    group = parser.add_argument_group("sampling options")
    group.add_argument("--max-tokens", type=positive_int, default=max_tokens, metavar="N",
                       help="most tokens to generate per reply (default: %(default)s)")
    group.add_argument("--temperature", type=float, default=temperature, metavar="T",
                       help="sampling temperature; 0 is greedy (default: %(default)s)")
    group.add_argument("--top-p", type=float, default=1.0, metavar="P",
                       help="nucleus sampling: keep the most likely tokens up to this total probability "
                            "(default: %(default)s)")
    group.add_argument("--top-k", type=int, default=0, metavar="K",
                       help="keep only the K most likely tokens; 0 or -1 disables (default: %(default)s)")
    group.add_argument("--ignore-eos", action="store_true",
                       help="keep generating past the end-of-sequence token, up to --max-tokens")


def sampling_params(ns: argparse.Namespace) -> SamplingParams:
    """The `SamplingParams` of the sampling flags (streamed as deltas); raises ValueError for bad values."""
    return SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k,
                          ignore_eos=ns.ignore_eos, output_kind=RequestOutputKind.DELTA)
