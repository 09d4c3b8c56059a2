"""EngineArgs: the flat user-facing knobs (kwargs / CLI flags) -> validated configs + loaded model."""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any, Optional

from vlite.config import (CacheConfig, DeviceConfig, KVTransferConfig, LoadedEngineConfig, LoRAConfig, ModelConfig,
                          ParallelConfig, ReasoningConfig, SchedulerConfig, SpeculativeConfig, VliteConfig,
                          cpu_supports_bf16, resolve_dtype_name)
from vlite.model_loader import (ModelArchConfig, ResolvedModel, gguf_linear_type, load_model_arch, load_model_weights,
                                resolve_model)

if TYPE_CHECKING:  # torch loads only where the model runs (the engine-core process), not in the API process
    import torch

    from vlite.layers.quantization import QuantizationPlan
    from vlite.pooling.config import PoolerConfig

logger = logging.getLogger("vlite")



@dataclass
class EngineArgs:
    model: Optional[str] = None
    dtype: str = "auto"
    max_model_len: Optional[int] = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    kv_cache_memory_bytes: Optional[int] = None
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"
    long_prefill_token_threshold: int = 0
    max_num_partial_prefills: int = 1
    seed: int = 0
    chat_template: Optional[str] = None
    quantization: Optional[str] = None
    tensor_parallel_size: int = 1
    distributed_executor_backend: Optional[str] = None  # uni | mp; None: uni for one rank, mp for more
    data_parallel_size: int = 1  # engine cores behind one API server (vlite serve only)
    # vLLM's speculative_config: a dict, its JSON text, or a SpeculativeConfig; None: no speculation.
    speculative_config: Any = None
    device: str = "auto"
    enforce_eager: bool = False
    gpu_memory_utilization: float = 0.9
    num_threads: Optional[int] = None  # CPU threads running the model (None: VLITE_NUM_THREADS, else all cores)
    runner: str = "auto"  # "generate" | "pooling" | "auto" (pooling for encoder models)
    convert: str = "auto"  # a decoder as a pooling model: "embed" (default) | "classify"
    # Multi-LoRA serving (vLLM's names): requests may name an adapter (LoRARequest); see vlite.config.LoRAConfig.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: Optional[int] = None
    # A directory of KV blocks shared across restarts and servers (vlite.kv_connector); None: off.
    kv_offload_dir: Optional[str] = None
    kv_offload_size: float = 16.0  # GiB the directory may hold (least recently used blocks deleted past it)
    # A thinking model's reasoning parser (vlite.reasoning: deepseek_r1, qwen3, generic) and its tags (a dict or
    # JSON text with vLLM's reasoning_start_str / reasoning_end_str); see vlite.config.ReasoningConfig.
    reasoning_parser: Optional[str] = None
    reasoning_config: Any = None
    # The thinking_token_budget of requests that set none (llama.cpp's --reasoning-budget): -1 unlimited, 0 no
    # thinking, N at most N thinking tokens before the end tag is forced. Needs reasoning_parser.
    reasoning_budget: int = -1

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ValueError(f"unknown engine arguments: {unknown}")
        return cls(**kwargs)

    def create_engine_config(self) -> LoadedEngineConfig:
        """Resolve and load the model, then size everything that depends on it."""
        model_config = ModelConfig(model=self.model, dtype=self.dtype, max_model_len=self.max_model_len,
                                   seed=self.seed, chat_template=self.chat_template,
                                   quantization=self.quantization, runner=self.runner, convert=self.convert)
        cache_config = CacheConfig(block_size=self.block_size, kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                                   enable_prefix_caching=self.enable_prefix_caching)
        # Validate the scheduler knobs before the (slow) model load.
        SchedulerConfig(max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                        policy=self.scheduling_policy, long_prefill_token_threshold=self.long_prefill_token_threshold,
                        max_num_partial_prefills=self.max_num_partial_prefills)
        speculative_config = SpeculativeConfig.from_user(self.speculative_config)
        lora_config = self._lora_config(speculative_config)
        kv_transfer_config = KVTransferConfig.from_user(self.kv_offload_dir, self.kv_offload_size)
        reasoning_config = ReasoningConfig.from_user(self.reasoning_parser, self.reasoning_config)
        self._check_reasoning_budget()
        parallel_config = ParallelConfig(tensor_parallel_size=self.tensor_parallel_size,
                                         distributed_executor_backend=self.distributed_executor_backend,
                                         data_parallel_size=self.data_parallel_size)
        device_config = DeviceConfig(device=self.device, enforce_eager=self.enforce_eager,
                                     gpu_memory_utilization=self.gpu_memory_utilization,
                                     num_threads=self.num_threads)
        device = device_config.resolve()
        if device == "cuda" and self.quantization not in (None, "none"):
            raise ValueError(f"quantization={self.quantization!r} runs vlite's CPU kernels only; with device='cuda' "
                             "leave it unset or 'none' (weights are dense on the GPU)")
        if device == "cuda" and speculative_config is not None:
            raise ValueError("speculative_config runs on the CPU only so far (its rejection sampler is CPU code); "
                             "with device='cuda' leave it unset")
        if device == "cuda" and parallel_config.backend != "uni":
            raise ValueError("tensor_parallel_size / data_parallel_size > 1 run CPU worker processes only so far; "
                             "with device='cuda' leave them at 1")
        resolved = resolve_model(self.model)
        import torch

        from vlite.layers.quantization import QuantizationPlan, plan_quantization

        dtype_name = resolve_dtype_name(model_config, device, integer_kernels=(
            self.dtype == "auto" and device == "cpu" and not cpu_supports_bf16()
            and _on_integer_kernels(resolved, self.quantization)))
        model_config = replace(model_config, dtype=dtype_name)  # what runs, for reports and the engine
        torch_dtype = getattr(torch, dtype_name)
        if parallel_config.backend == "uni":
            arch, weights = load_model_weights(resolved, torch_dtype)
        else:  # the workers load the weights, each its own shard (vlite.worker.worker)
            arch, weights = load_model_arch(resolved, torch_dtype), {}
            from vlite.model_loader.tp_shard import plan_tp

            plan_tp(arch, parallel_config.tensor_parallel_size)  # a model TP cannot split fails here, not in a worker
        # On a GPU a quantized GGUF file is dequantized to dense weights at load, as quantization="none" does.
        quantization = (QuantizationPlan(None) if device == "cuda" else
                        plan_quantization(self.quantization, arch.source_quantization, torch_dtype,
                                          dtype_was_auto=self.dtype == "auto"))

        from vlite.core.kv_cache_interface import KVCacheConfig, kv_cache_groups

        pooler_config = _pooler_config(model_config, resolved, arch)
        if lora_config is not None and pooler_config is not None:
            raise ValueError(f"enable_lora: LoRA adapters apply to text generation only, and {resolved.name} runs "
                             f"as a pooling model (runner='pooling', embeddings and scores); leave --enable-lora off")
        if lora_config is not None and arch.architecture == "gemma4":  # LoRA's layout assumes one head size
            raise ValueError("enable_lora: gemma4 models (heads of two sizes, KV-shared layers) take no LoRA adapters "
                             "yet; leave --enable-lora off")
        # KV cache groups: sliding and full layers apart where the backend reads a block table per group (CPU)
        groups = kv_cache_groups(arch, self.block_size, torch.empty((), dtype=torch_dtype).element_size(),
                                 split_windows=device == "cpu") if arch.is_causal else ()
        bytes_per_block = KVCacheConfig(0, groups).block_bytes or 1
        state_slots, cached_state_slots, state_bytes = self._state_slots(arch, groups, cache_config, speculative_config,
                                                                         parallel_config, lora_config, device)
        if not arch.is_causal:  # encoders keep no KV cache: nothing to size
            kv_bytes = bytes_per_block
        elif device == "cuda" and cache_config.kv_cache_memory_bytes is None:
            from vlite.worker.gpu_memory import kv_cache_bytes_from_gpu_memory

            kv_bytes = kv_cache_bytes_from_gpu_memory(arch, weights, torch_dtype, device_config.gpu_memory_utilization,
                                                      self.max_num_batched_tokens, self.max_num_seqs)
        else:
            # recurrent-state models: the state slots come first, out of the same budget where one is given
            kv_bytes = (cache_config.kv_cache_memory_bytes - state_bytes if cache_config.kv_cache_memory_bytes
                        else cache_config.kv_bytes(bytes_per_block // self.block_size))
        num_blocks = kv_bytes // bytes_per_block
        if num_blocks < 1:
            states = (f" after {state_slots} recurrent-state slots of {state_bytes // state_slots} bytes"
                      if state_slots else "")
            raise ValueError(f"kv_cache_memory_bytes ({cache_config.kv_cache_memory_bytes or kv_bytes}) leaves less "
                             f"than one KV block ({bytes_per_block} bytes at block_size={self.block_size}){states}; "
                             f"raise it, or lower max_num_seqs")
        capacity = (KVCacheConfig(num_blocks, groups).max_tokens_per_request(self.max_num_batched_tokens)
                    if arch.is_causal else arch.longest_context)
        # LongRoPE: the default is the original context; a longer max_model_len selects the long factors
        max_model_len = self.max_model_len or min(arch.longest_context if not arch.is_causal
                                                  else arch.max_position_embeddings, capacity)
        if pooler_config is not None and pooler_config.max_seq_length and not self.max_model_len:
            max_model_len = min(max_model_len, pooler_config.max_seq_length)  # sentence-transformers' limit
        if max_model_len > arch.longest_context:
            raise ValueError(f"max_model_len ({max_model_len}) exceeds the model's limit "
                             f"({arch.longest_context})")
        if max_model_len > capacity:
            raise ValueError(f"max_model_len ({max_model_len}) does not fit in the KV cache ({capacity} tokens); "
                             f"raise kv_cache_memory_bytes or lower max_model_len")
        arch = arch.with_max_model_len(max_model_len)
        _log_longrope(arch, max_model_len)
        # Pooling from every token of a prompt (encoders; MEAN/CLS/MAX pooling) needs the whole prompt in one step,
        # computed there (no prefix served from the cache); LAST pooling needs only its final token.
        whole_prompts = not arch.is_causal or (pooler_config is not None and pooler_config.pooling_type != "LAST")
        if whole_prompts:
            cache_config = replace(cache_config, enable_prefix_caching=False)
        scheduler_config = SchedulerConfig(
            max_num_seqs=self.max_num_seqs, max_model_len=max_model_len, policy=self.scheduling_policy,
            max_num_batched_tokens=max(self.max_num_batched_tokens, max_model_len) if whole_prompts
            else self.max_num_batched_tokens,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            max_num_partial_prefills=self.max_num_partial_prefills, enable_chunked_prefill=not whole_prompts)
        logger.info("vlite: model %s on %s (%s, linear weights: %s), KV cache %d blocks x %d tokens = %d tokens "
                    "(%.1f MiB), max_model_len %d", resolved.name, device, dtype_name, quantization.describe(),
                    num_blocks, self.block_size, capacity,
                    num_blocks * bytes_per_block / 2**20, max_model_len)
        loaded = LoadedEngineConfig(
            config=VliteConfig(model_config, cache_config, scheduler_config, speculative_config=speculative_config,
                               parallel_config=parallel_config, device_config=device_config, lora_config=lora_config,
                               kv_transfer_config=kv_transfer_config, reasoning_config=reasoning_config),
            resolved=resolved, arch=arch, weights=weights, torch_dtype=torch_dtype, quantization=quantization,
            num_kv_blocks=num_blocks, eos_token_ids=tuple(arch.eos_token_ids), device=device,
            pooler_config=pooler_config, num_state_slots=state_slots, num_cached_state_slots=cached_state_slots,
            kv_cache_groups=groups)
        if kv_transfer_config is not None:
            from vlite.kv_connector.factory import model_id

            loaded.kv_model_id = model_id(loaded)
        return loaded

    def _state_slots(self, arch: Any, groups: tuple, cache_config: Any, speculative_config: Any, parallel_config: Any,
                     lora_config: Any, device: str) -> tuple[int, int, int]:
        """(state slots, of those the prefix cache's, their bytes) of a model with linear-attention layers, which
        keep a fixed-size recurrent state per request instead of KV blocks; the features that cannot run such
        layers yet are refused here, before any work."""
        if not arch.linear_layers:
            return 0, 0, 0
        from vlite.core.kv_cache_interface import KVCacheConfig, num_cached_state_slots

        name = f"{arch.architecture} (linear-attention layers)"
        if speculative_config is not None:
            raise ValueError(f"speculative_config: {name} cannot take back a recurrent state's rejected draft "
                             f"tokens; leave speculative decoding off for this model")
        if parallel_config.tensor_parallel_size > 1:
            raise ValueError(f"tensor_parallel_size > 1 does not split {name} yet; leave it at 1")
        if lora_config is not None:
            raise ValueError(f"enable_lora: {name} take no LoRA adapters yet; leave --enable-lora off")
        if device != "cpu":
            raise ValueError(f"{name} run on the CPU only so far; use device='cpu'")
        cached = num_cached_state_slots(self.max_num_seqs, cache_config.enable_prefix_caching)
        slots = self.max_num_seqs + cached
        return slots, cached, slots * KVCacheConfig(0, groups).state_slot_bytes

    def _check_reasoning_budget(self) -> None:
        budget = self.reasoning_budget
        if not isinstance(budget, int) or isinstance(budget, bool) or not -1 <= budget < 2**63:
            raise ValueError(f"reasoning_budget must be -1 (unlimited), 0 (no thinking) or a positive number of "
                             f"tokens, got {budget!r}")
        if budget >= 0 and self.reasoning_parser is None:
            raise ValueError("reasoning_budget needs reasoning_parser (--reasoning-parser): it forces the parser's "
                             "end tag")

    def _lora_config(self, speculative_config: Optional[SpeculativeConfig]) -> Optional[LoRAConfig]:
        """LoRAConfig with enable_lora, else None (checked before the model loads). Speculative decoding goes with
        it: its drafts come from n-gram prompt lookup (no draft model that would lack the adapter) and are
        verified by the target model under the request's adapter, so outputs stay the adapter's."""
        if not self.enable_lora:
            return None
        if speculative_config is not None and speculative_config.method != "ngram":
            raise ValueError(f"enable_lora with speculative method {speculative_config.method!r}: only n-gram "
                             f"drafting (a model-free proposer) runs with LoRA adapters")
        return LoRAConfig(max_loras=self.max_loras, max_lora_rank=self.max_lora_rank,
                          max_cpu_loras=self.max_cpu_loras)


def _pooler_config(model_config: ModelConfig, resolved: ResolvedModel, arch: ModelArchConfig
                   ) -> Optional[PoolerConfig]:
    """The pooling a `runner="pooling"` engine does (its folder's sentence-transformers pipeline, else vLLM's
    defaults), None for generation; a ValueError naming the runner where the model cannot run that way."""
    runner = model_config.runner
    if runner == "auto":
        runner = "generate" if arch.is_causal and not arch.classifier else "pooling"
    if runner == "generate":
        if not arch.is_causal or arch.classifier:
            kind = "a sequence classifier" if arch.classifier else "a pooling model"
            raise ValueError(f"{resolved.name} is {kind} ({arch.architecture}): it embeds or scores text and "
                             f"does not generate; run it with runner='pooling' (--runner pooling)")
        if model_config.convert not in ("auto", "none"):
            raise ValueError(f"convert={model_config.convert!r} needs runner='pooling'")
        return None
    if model_config.convert == "classify" and not arch.classifier:
        raise ValueError(f"convert='classify' needs a sequence-classification head, which {resolved.name} "
                         f"({arch.architecture}) does not have")
    from vlite.model_loader.sentence_transformers import pooler_config_from_folder
    from vlite.pooling.config import PoolerConfig, PoolingType

    if resolved.is_gguf:  # a GGUF file carries no pooling pipeline: vLLM's default for decoders
        return PoolerConfig(pooling_type=PoolingType.LAST)
    return pooler_config_from_folder(resolved.path, arch)


def _on_integer_kernels(resolved: ResolvedModel, quantization: Optional[str]) -> bool:
    """Whether dtype="auto" would run the linear layers on vlite's integer kernels: int8/int4 asked for,
    or a GGUF file's own quantized blocks (QuantizationPlan "gguf"), with the kernels available."""
    from vlite import _custom_ops
    from vlite.config import QUANTIZATION_METHODS
    from vlite.model_loader.gguf_quants import DENSE_TYPES

    if quantization == "none" or _custom_ops.load() is None:
        return False
    if quantization in QUANTIZATION_METHODS:
        return True
    linear_type = gguf_linear_type(resolved)
    return linear_type is not None and linear_type not in DENSE_TYPES


def _log_longrope(arch: ModelArchConfig, max_model_len: int) -> None:
    """Which LongRoPE factors this engine rotates with, and how to get the other ones."""
    scaling = arch.rope_scaling or {}
    if scaling.get("rope_type") != "longrope":
        return
    orig = scaling["original_max_position_embeddings"]
    if scaling.get("use_long_factor"):
        logger.info("vlite: LongRoPE with its long factors for every request (max_model_len %d is past the "
                    "original context of %d tokens)", max_model_len, orig)
    elif arch.longest_context > max_model_len:
        logger.info("vlite: LongRoPE with its short factors (max_model_len %d, within the original context of "
                    "%d tokens); --max-model-len above %d (up to %d) runs the long factors for every request",
                    max_model_len, orig, orig, arch.longest_context)


