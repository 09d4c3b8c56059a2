"""`vlite bench lora`: what serving LoRA adapters costs beside the base model, on the same prompts.

Writes `--num-adapters` random PEFT adapters (rank `--lora-rank` on `--target-modules`) for the model, then runs,
alternating `--num-iters` times, on two engines made from the same flags (one without LoRA, one with
`--enable-lora --max-loras N`):

    batch     `--num-prompts` random requests (`--input-len` in, exactly `--output-len` out) through
              LLMEngine.step(): output tok/s of the base engine, of the LoRA engine with the adapters
              taking turns over the requests (mixed), and of the LoRA engine on base requests
    stream    one request alone (2 x `--output-len` tokens, three times a round): decode tok/s (1 / mean
              inter-token latency), base vs one adapter

and reports each figure's median and, as the ratios to the base engine's, the median of the paired ratios (issue
46's targets: mixed >= 0.7x, one adapter single stream >= 0.85x).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from vlite.benchmarks.datasets import allowed_token_ids, random_requests, tokenizer_special_ids
from vlite.benchmarks.utils import add_output_args, hardware_report, jsonable_args, print_hardware, write_json
from vlite.entrypoints.cli.args import add_common_args, add_engine_args, positive_int
from vlite.entrypoints.cli.engine import load_engine

HELP = "LoRA adapters beside the base model: batch throughput (mixed adapters) and single-stream decode"
DESCRIPTION = __doc__.split("\n\n")[0] if __doc__ else HELP
MODULES = {"all": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
           "attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "qv": ("q_proj", "v_proj")}


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("benchmark options")
    group.add_argument("--num-adapters", type=positive_int, default=3, metavar="N",
                       help="adapters taking turns over the batch's requests (default: %(default)s)")
    group.add_argument("--lora-rank", type=positive_int, default=16, metavar="R", help="(default: %(default)s)")
    group.add_argument("--target-modules", choices=sorted(MODULES), default="all",
                       help="modules the adapters modify: all 7 projections, attention's 4, or q and v "
                            "(default: %(default)s)")
    group.add_argument("--num-prompts", type=positive_int, default=32, metavar="N", help="(default: %(default)s)")
    group.add_argument("--input-len", type=positive_int, default=64, metavar="N", help="(default: %(default)s)")
    group.add_argument("--output-len", type=positive_int, default=64, metavar="N", help="(default: %(default)s)")
    group.add_argument("--num-iters", type=positive_int, default=3, metavar="N",
                       help="rounds of every measurement, alternating engines (default: %(default)s)")
    add_output_args(parser, profile=False)
    add_common_args(parser)
    add_engine_args(parser)


def write_random_adapter(folder: Path, cfg: Any, rank: int, modules: tuple[str, ...], seed: int,
                         b_scale: float = 0.01) -> Path:
    """A PEFT LoRA folder for a model of `cfg` (vlite.model_arch.ModelArchConfig), random A and B (N(0, b_scale))
    on `modules` of every decoder layer (by default values of a trained adapter's order: the update a few percent
    of the layer's)."""
    import torch
    from safetensors.torch import save_file

    from vlite.lora.layout import module_specs

    specs = module_specs(cfg)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_hidden_layers):
        for name in modules:
            spec = specs[name]
            key = f"base_model.model.model.layers.{layer}.{spec.parent}.{name}"
            a = torch.randn(rank, spec.in_features, generator=gen) / spec.in_features ** 0.5
            tensors[f"{key}.lora_A.weight"] = a
            tensors[f"{key}.lora_B.weight"] = torch.randn(spec.out_features, rank, generator=gen) * b_scale
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(modules), "bias": "none"}))
    return folder


def _run(engine: Any, prompts: list[list[int]], output_len: int, loras: list[Optional[Any]], tag: str
         ) -> tuple[float, list[float]]:
    """The batch to completion: (seconds, the first request's token stamps)."""
    from vlite.sampling_params import RequestOutputKind, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    first, stamps = f"{tag}-0", []
    t0 = time.perf_counter()
    for i, (prompt, lora) in enumerate(zip(prompts, loras)):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": prompt}, params, lora_request=lora)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == first:
                stamps.extend([time.perf_counter() - t0] * len(out.outputs[0].token_ids))
    return time.perf_counter() - t0, stamps


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def _load_unload_rss(engine: Any, adapters: list[Any]) -> dict[str, float]:
    """The engine process's RSS (MB) before loading the adapters, with them loaded, and after removing them."""
    import gc

    gc.collect()
    before = _rss_mb()
    for a in adapters:
        engine.add_lora(a)
    manager = engine.engine_core.model_runner.lora_manager
    weights = sum(m.num_bytes() for _, m in manager.adapters.values()) / 2**20
    loaded = _rss_mb()
    for a in adapters:
        engine.remove_lora(a.lora_int_id)
    gc.collect()
    return {"rss_before_mb": before, "rss_loaded_mb": loaded, "rss_unloaded_mb": _rss_mb(), "adapter_weights_mb": weights}


def run_lora(ns: argparse.Namespace) -> dict[str, Any]:
    from vlite.lora.request import LoRARequest

    base = load_engine(argparse.Namespace(**{**vars(ns), "enable_lora": False}))
    lora = load_engine(argparse.Namespace(**{**vars(ns), "enable_lora": True, "max_loras": ns.num_adapters,
                                             "max_lora_rank": max(ns.lora_rank, getattr(ns, "max_lora_rank", 0))}))
    cfg = lora.engine_core.model_runner.arch
    pool = allowed_token_ids(base.input_processor.vocab_size, tokenizer_special_ids(base.get_tokenizer()))
    tmp = tempfile.TemporaryDirectory(prefix="vlite-bench-lora-")
    adapters = [LoRARequest(f"bench{i}", i + 1, str(write_random_adapter(Path(tmp.name) / f"a{i}", cfg, ns.lora_rank,
                                                                        MODULES[ns.target_modules], seed=i)))
                for i in range(ns.num_adapters)]
    memory = _load_unload_rss(lora, adapters)
    for a in adapters:
        lora.add_lora(a)
    n, out_len = ns.num_prompts, ns.output_len
    figures: dict[str, list[float]] = {k: [] for k in ("batch_base", "batch_mixed", "batch_lora_engine_base",
                                                       "stream_base", "stream_adapter")}
    for it in range(-1, ns.num_iters):  # round -1 warms both engines up
        prompts = [r.prompt_token_ids for r in random_requests(n + 1, ns.input_len, 1, 0.0, 1000 + it, token_ids=pool)]
        batch, single = prompts[:n], prompts[n:]
        mixed = [adapters[i % len(adapters)] for i in range(n)]
        # the stream pair three times a round: a short single stream is the noisiest figure here
        runs = [("batch_base", base, batch, [None] * n), ("batch_mixed", lora, batch, mixed),
                ("batch_lora_engine_base", lora, batch, [None] * n)] + 3 * [("stream_base", base, single, [None]),
                                                                          ("stream_adapter", lora, single, [adapters[0]])]
        for key, engine, ps, loras in runs:
            seconds, stamps = _run(engine, ps, 2 * out_len if key.startswith("stream") else out_len, loras,
                                   f"{key}{it}")
            engine.reset_prefix_cache()
            if it < 0:
                continue
            if key.startswith("batch"):
                figures[key].append(len(ps) * out_len / seconds)
            else:
                figures[key].append((len(stamps) - 1) / (stamps[-1] - stamps[0]))
    tmp.cleanup()
    med = {k: statistics.median(v) for k, v in figures.items()}
    # each ratio the median of the runs' paired ratios (the same round, minutes apart at most: the VM drifts)
    paired = {key: statistics.median(a / b for a, b in zip(figures[key], figures[ref]))
              for key, ref in (("batch_mixed", "batch_base"), ("batch_lora_engine_base", "batch_base"),
                               ("stream_adapter", "stream_base"))}
    results = {
        "benchmark": "lora", "model": base.resolved_model.name, "dtype": base.model_config.torch_dtype_name,
        "args": jsonable_args(ns), "hardware": hardware_report(base), "runs": figures, "median": med,
        "mixed_vs_base": paired["batch_mixed"],
        "lora_engine_base_vs_base": paired["batch_lora_engine_base"],
        "single_adapter_vs_base": paired["stream_adapter"],
        "memory": memory,
    }
    print(f"vlite lora: {results['model']} ({results['dtype']}), {ns.num_adapters} adapters of rank {ns.lora_rank} on "
          f"{ns.target_modules} modules; batch {n} x ({ns.input_len} in, {out_len} out); {ns.num_iters} rounds")
    print_hardware(results["hardware"])
    print(f"batch, output tok/s: base {med['batch_base']:.1f}, {ns.num_adapters} adapters mixed "
          f"{med['batch_mixed']:.1f} ({results['mixed_vs_base']:.3f}x), LoRA engine on base requests "
          f"{med['batch_lora_engine_base']:.1f} ({results['lora_engine_base_vs_base']:.3f}x)")
    print(f"single stream, decode tok/s: base {med['stream_base']:.1f}, one adapter {med['stream_adapter']:.1f} "
          f"({results['single_adapter_vs_base']:.3f}x)")
    print(f"memory: {ns.num_adapters} adapters' weights {memory['adapter_weights_mb']:.1f} MiB; process RSS "
          f"{memory['rss_before_mb']:.1f} MiB -> loaded {memory['rss_loaded_mb']:.1f} -> removed "
          f"{memory['rss_unloaded_mb']:.1f}")
    write_json(ns.output_json, results)
    return results


def main(ns: argparse.Namespace) -> int:
    run_lora(ns)
    return 0
