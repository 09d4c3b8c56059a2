"""Typed, validated configuration: one frozen object per concern, built once from kwargs/CLI."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:  # the loaded facts' types; this module stays import-light (the API process loads no torch)
    import torch

    from vlite.layers.quantization import QuantizationPlan
    from vlite.model_arch import ModelArchConfig
    from vlite.model_loader import ResolvedModel
    from vlite.pooling.config import PoolerConfig

_DTYPES = ("auto", "float32", "bfloat16", "float16")
# Weight-only methods of vlite.layers.quantization; "none" forces dense weights.
QUANTIZATION_METHODS = ("int8", "int4")
QUANTIZATION_CHOICES = ("none", *QUANTIZATION_METHODS)
# vLLM's --runner and --convert: what the engine does with the model's hidden states.
RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed", "classify")


@functools.lru_cache(maxsize=1)
def cpu_flags() -> str:
    """The `flags` line of /proc/cpuinfo ("" where there is none); read once: the kernel loader and
    every quantized layer ask for it."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def cpu_supports_bf16() -> bool:
    """Native bf16 dot products (AVX512-BF16 or AMX): dense bf16 GEMMs pay only with them. With
    VLITE_CPU_ISA=avx2|portable the machine stands in for a CPU without them."""
    import os

    if os.environ.get("VLITE_CPU_ISA", "").strip().lower() in ("avx2", "portable"):
        return False
    flags = cpu_flags().split()
    return "avx512_bf16" in flags or "amx_bf16" in flags


@dataclass(frozen=True)
class ModelConfig:
    model: Optional[str] = None  # None: the bundled SmolLM2-135M-Instruct GGUF
    dtype: str = "auto"  # see resolve_dtype_name
    max_model_len: Optional[int] = None  # prompt + output tokens; None: the model's own limit
    seed: int = 0
    chat_template: Optional[str] = None
    # Weight-only "int8" / "int4", "none" (dense), or None: automatic (vlite.layers.quantization).
    quantization: Optional[str] = None
    # "generate" samples tokens; "pooling" returns embeddings / scores (encoders; decoders through `convert`);
    # "auto": pooling for encoder models, else generate.
    runner: str = "auto"
    convert: str = "auto"  # a decoder as a pooling model: "embed" (the default) or "classify"

    def __post_init__(self) -> None:
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {RUNNERS}, got {self.runner!r}")
        if self.convert not in CONVERTS:
            raise ValueError(f"convert must be one of {CONVERTS}, got {self.convert!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(f"quantization must be one of {QUANTIZATION_CHOICES} or None, "
                             f"got {self.quantization!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be at least 1, got {self.max_model_len}")

    @property
    def torch_dtype_name(self) -> str:
        if self.dtype == "auto":
            return "bfloat16" if cpu_supports_bf16() else "float32"
        return self.dtype


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16  # tokens per KV block
    kv_cache_memory_bytes: Optional[int] = None  # size of the KV pool; None: see kv_bytes()
    enable_prefix_caching: bool = True

    # Default pool: room for this many tokens (twice the default model's context), at most
    # DEFAULT_KV_CACHE_BYTES. Allocated up front, so it is most of the engine's memory.
    DEFAULT_KV_CACHE_TOKENS = 16384
    DEFAULT_KV_CACHE_BYTES = 512 * 1024 * 1024

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or not 1 <= self.block_size <= 1024:
            raise ValueError(f"block_size must be an integer in [1, 1024], got {self.block_size!r}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}")

    def kv_bytes(self, bytes_per_token: int) -> int:
        if self.kv_cache_memory_bytes is not None:
            return self.kv_cache_memory_bytes
        return min(self.DEFAULT_KV_CACHE_BYTES, self.DEFAULT_KV_CACHE_TOKENS * bytes_per_token)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # requests running at once
    max_num_batched_tokens: int = 2048  # token budget of one step
    max_model_len: int = 8192
    policy: str = "fcfs"  # "fcfs" or "priority"
    long_prefill_token_threshold: int = 0  # cap on one prefill chunk per step; 0: no cap
    max_num_partial_prefills: int = 1  # prompts that may be mid-prefill at once
    # False (encoder models: bidirectional attention over the whole prompt): a prompt runs in one step or waits.
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "max_num_partial_prefills"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least max_model_len "
                             f"({self.max_model_len}) where prompts are not chunked (encoder models)")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                f"long_prefill_token_threshold must be non-negative, got {self.long_prefill_token_threshold}")
        if str(self.policy).strip().lower() not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.policy!r}")


EXECUTOR_BACKENDS = ("uni", "mp", "ray")


@dataclass(frozen=True)
class ParallelConfig:
    """How many processes run the model and where (vlite.executor)."""

    tensor_parallel_size: int = 1
    # "uni": the model runs in the engine-core process; "mp": one worker process per rank on this
    # machine; "ray": one Ray actor per rank on a Ray cluster; None: uni for one rank, mp for more.
    distributed_executor_backend: Optional[str] = None
    # Engine cores behind one API server (each with its own executor); requests go to the least loaded.
    data_parallel_size: int = 1

    def __post_init__(self) -> None:
        dp = self.data_parallel_size
        if not isinstance(dp, int) or isinstance(dp, bool) or not 1 <= dp <= 64:
            raise ValueError(f"data_parallel_size must be an integer in [1, 64], got {dp!r}")
        tp = self.tensor_parallel_size
        if not isinstance(tp, int) or isinstance(tp, bool) or not 1 <= tp <= 64:
            raise ValueError(f"tensor_parallel_size must be an integer in [1, 64], got {tp!r}")
        backend = self.distributed_executor_backend
        if backend is not None and backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of {EXECUTOR_BACKENDS} or None, "
                             f"got {backend!r}")
        if backend == "uni" and tp > 1:
            raise ValueError(f"distributed_executor_backend 'uni' runs one rank; tensor_parallel_size={tp} needs "
                             f"'mp'")

    @property
    def backend(self) -> str:
        return self.distributed_executor_backend or ("uni" if self.tensor_parallel_size == 1 else "mp")


SPECULATIVE_METHODS = ("ngram",)
# Above this many draft tokens per request a verify step stops being nearly free on a CPU (the step's
# cost grows with its tokens) while a long run of n-gram proposals is rarely all accepted.
MAX_NUM_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, with vLLM's `speculative_config` keys.

    method "ngram" (prompt lookup): the longest n-gram (prompt_lookup_min..prompt_lookup_max tokens)
    ending a request's tokens that occurred before proposes the tokens that followed it.
    `max_num_batched_draft_tokens` caps a step's verify tokens (sampled requests plus their drafts):
    past it a CPU step is compute-bound, so drafts would cost as much as the tokens they save
    (None: vlite's default). `disable_by_batch_size` (vLLM's key): no drafts while more requests run.
    `draft_policy`: "adaptive" (default; vlite.spec_decode.draft_policy) drafts per request what pays at
    its acceptance so far, in steps where every sampled request has drafts; "always" drafts up to
    num_speculative_tokens whenever there is a match (vLLM's behaviour; for hardware where verifying is
    nearly free).
    """

    method: str = "ngram"
    num_speculative_tokens: int = 0
    prompt_lookup_min: Optional[int] = None
    prompt_lookup_max: Optional[int] = None
    max_num_batched_draft_tokens: Optional[int] = None
    disable_by_batch_size: Optional[int] = None
    draft_policy: str = "adaptive"

    # When neither bound is given: vLLM's (5, 5) for draft_policy "always", where every match drafts; with the
    # adaptive policy, which learns how right each matched length's drafts are and drafts none where they
    # do not pay, (2, 4), which finds a copy again 3 tokens sooner after an edit: copy prompts 1.90x -> 2.17x
    # (k = 8, 2 Zen 4 cores, docs/perf-log.md); only the speed differs, never the outputs.
    DEFAULT_PROMPT_LOOKUP = {"always": (5, 5), "adaptive": (2, 4)}
    DEFAULT_MAX_VERIFY_TOKENS = 16

    def __post_init__(self) -> None:
        name = "speculative_config"
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"{name}.method must be one of {SPECULATIVE_METHODS}, got {self.method!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_NUM_SPECULATIVE_TOKENS:
            raise ValueError(f"{name}.num_speculative_tokens must be an integer in [1, "
                             f"{MAX_NUM_SPECULATIVE_TOKENS}], got {k!r}")
        if self.draft_policy not in ("adaptive", "always"):
            raise ValueError(f"{name}.draft_policy must be 'adaptive' or 'always', got {self.draft_policy!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        for key, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 64):
                raise ValueError(f"{name}.{key} must be an integer in [1, 64], got {value!r}")
        if lo is None and hi is None:
            lo, hi = self.DEFAULT_PROMPT_LOOKUP[self.draft_policy]
        lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
        assert lo is not None and hi is not None
        if lo > hi:
            raise ValueError(f"{name}.prompt_lookup_min ({lo}) must not exceed prompt_lookup_max ({hi})")
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)
        for key in ("max_num_batched_draft_tokens", "disable_by_batch_size"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name}.{key} must be a positive integer or null, got {value!r}")

    @property
    def max_verify_tokens(self) -> int:
        return self.max_num_batched_draft_tokens or self.DEFAULT_MAX_VERIFY_TOKENS

    @classmethod
    def from_user(cls, value: object) -> Optional[SpeculativeConfig]:
        """From `speculative_config` as given: None, a SpeculativeConfig, a dict, or its JSON text (the CLI)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        value = json_object(value, "speculative_config")
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown} (known: {sorted(known)})")
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config.num_speculative_tokens is required")
        return cls(**value)


def json_object(value: object, name: str) -> dict:
    """A dict given as one or as its JSON text (a CLI flag); anything else is an error naming `name`."""
    import json

    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} must be a JSON object: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a dict (JSON object), got {type(value).__name__}")
    return value


@dataclass(frozen=True)
class ReasoningConfig:
    """A thinking model's reasoning block (vLLM's ReasoningConfig): the parser that splits its output
    (`--reasoning-parser`), and optionally the tags (`--reasoning-config`, vLLM's reasoning_start_str /
    reasoning_end_str, plus implicit_start: reasoning without a start tag). The engine constrains only the
    answer with structured outputs; the server and LLM.chat return the reasoning apart."""

    reasoning_parser: str
    reasoning_start_str: Optional[str] = None
    reasoning_end_str: Optional[str] = None
    implicit_start: Optional[bool] = None

    def __post_init__(self) -> None:
        self.parser_class()  # an unknown name or a bad tag fails here, before the model loads

    def parser_class(self) -> type:
        """The ReasoningParser subclass (vlite.reasoning) these settings name."""
        from vlite.reasoning import resolve_reasoning_parser

        extra = {k: v for k, v in (("reasoning_start_str", self.reasoning_start_str),
                                   ("reasoning_end_str", self.reasoning_end_str),
                                   ("implicit_start", self.implicit_start)) if v is not None}
        return resolve_reasoning_parser(self.reasoning_parser, extra)

    @classmethod
    def from_user(cls, parser: Optional[str], config: object = None) -> Optional[ReasoningConfig]:
        """From `reasoning_parser` and `reasoning_config` (a dict or its JSON text); None without a parser."""
        settings = json_object(config, "reasoning_config") if config is not None else {}
        if parser is None:
            if settings:
                raise ValueError("reasoning_config needs reasoning_parser (e.g. \"generic\" with both strings)")
            return None
        from vlite.reasoning import resolve_reasoning_parser

        resolve_reasoning_parser(parser, settings)  # an unknown key or a bad value is an error naming it
        return cls(parser, **settings)


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving (vLLM's --enable-lora): `max_loras` distinct adapters in one step (the scheduler's
    limit and the runner's slots), `max_lora_rank` the largest rank an adapter may have, `max_cpu_loras` the
    adapters kept loaded in memory (least recently used evicted; None: max_loras)."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: Optional[int] = None

    def __post_init__(self) -> None:
        for key in ("max_loras", "max_lora_rank", "max_cpu_loras"):
            value = getattr(self, key)
            if key == "max_cpu_loras" and value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{key} must be a positive integer, got {value!r}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})")

    @property
    def cpu_loras(self) -> int:
        """How many adapters stay loaded: max_cpu_loras, or max_loras when not given."""
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


@dataclass(frozen=True)
class KVTransferConfig:
    """KV blocks kept outside the engine (vLLM's KVTransferConfig): here a directory of block files, the
    "offloading" connector (vlite.kv_connector), so a prefix outlives the process and is shared by the
    servers pointed at the same directory. `offload_size_bytes`: the directory's quota (least recently
    used files deleted past it)."""

    offload_dir: str
    offload_size_bytes: int = 16 * 2**30

    def __post_init__(self) -> None:
        if not isinstance(self.offload_dir, str) or not self.offload_dir.strip():
            raise ValueError(f"kv_offload_dir must be a directory path, got {self.offload_dir!r}")
        size = self.offload_size_bytes
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"kv_offload_size must be positive, got {size!r} bytes")

    @classmethod
    def from_user(cls, offload_dir: Optional[str], offload_size_gib: float) -> Optional[KVTransferConfig]:
        """From the engine arguments (a size in GiB); None without a directory."""
        if offload_dir is None:
            return None
        if isinstance(offload_size_gib, bool) or not isinstance(offload_size_gib, (int, float)) \
                or not offload_size_gib > 0:
            raise ValueError(f"kv_offload_size must be a positive number of GiB, got {offload_size_gib!r}")
        return cls(os.path.abspath(os.path.expanduser(offload_dir)), max(1, int(offload_size_gib * 2**30)))


DEVICES = ("auto", "cpu", "cuda")


NUM_THREADS_ENV = "VLITE_NUM_THREADS"


@dataclass(frozen=True)
class DeviceConfig:
    device: str = "auto"  # "auto": CUDA when torch sees a GPU, else the CPU
    enforce_eager: bool = False  # CUDA: no CUDA graphs (every step runs eagerly)
    # CUDA: the share of the GPU's memory the engine may hold (weights, activations, KV cache); the KV
    # cache gets what is left of it. Ignored on the CPU and where kv_cache_memory_bytes is given.
    gpu_memory_utilization: float = 0.9
    # CPU threads of the process that runs the model (each rank's, under tensor parallelism): None reads
    # VLITE_NUM_THREADS, else torch's default (the machine's cores; a rank: its share of them)
    num_threads: Optional[int] = None

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.num_threads is None and os.environ.get(NUM_THREADS_ENV, "").strip():
            value = os.environ[NUM_THREADS_ENV].strip()
            if not value.isdigit():
                raise ValueError(f"{NUM_THREADS_ENV} must be a positive integer, got {value!r}")
            object.__setattr__(self, "num_threads", int(value))
        n = self.num_threads
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"num_threads must be a positive integer, got {n!r}")
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {u!r}")

    def resolve(self) -> str:
        """"cpu" or "cuda"; device="cuda" without a GPU torch can use is an error here, before any work."""
        if self.device == "cpu":
            return "cpu"
        import torch

        if torch.cuda.is_available():
            return "cuda"
        if self.device == "auto":
            return "cpu"
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise ValueError(f"device='cuda' but torch sees no GPU (torch {torch.__version__} is {build}); "
                         "use device='cpu' or 'auto', or install torch's CUDA build (README, GPU)")


def resolve_dtype_name(model_config: ModelConfig, device: str, integer_kernels: bool = False) -> str:
    """dtype="auto": bfloat16 on a GPU; on a CPU bfloat16 where it has native bf16 or where the linear
    layers run on vlite's integer kernels (`integer_kernels`: quantized weights), else float32.

    The kernels quantize activations to int8 whatever their dtype, so on an AVX2 CPU bf16 costs
    nothing there and halves the KV cache; float32 activations would carry an int8 residual row that
    doubles the integer work of every multi-token step (AVX2 path, default model: wl32 +10-15%,
    speculative copy decoding +16-19%; docs/perf-log.md). Dense models stay float32 there: a
    dense bf16 GEMM without native bf16 is emulated."""
    if model_config.dtype == "auto" and (device == "cuda" or integer_kernels):
        return "bfloat16"
    return model_config.torch_dtype_name


@dataclass(frozen=True)
class VliteConfig:
    model_config: ModelConfig = field(default_factory=ModelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    speculative_config: Optional[SpeculativeConfig] = None
    device_config: DeviceConfig = field(default_factory=DeviceConfig)
    lora_config: Optional[LoRAConfig] = None  # None: LoRA off (requests naming an adapter are refused)
    kv_transfer_config: Optional[KVTransferConfig] = None  # None: no KV store outside the engine
    reasoning_config: Optional[ReasoningConfig] = None  # None: outputs are not split into reasoning and answer


@dataclass
class LoadedEngineConfig:
    """Configs plus the facts found while loading (not written back into the frozen configs)."""

    config: VliteConfig
    resolved: ResolvedModel
    arch: ModelArchConfig
    weights: dict[str, torch.Tensor] = field(repr=False)
    torch_dtype: torch.dtype
    quantization: QuantizationPlan
    num_kv_blocks: int
    eos_token_ids: tuple[int, ...]
    device: str = "cpu"  # where the model runs: "cpu" or "cuda" (DeviceConfig.resolve)
    pooler_config: Optional[PoolerConfig] = None  # a pooling model's (runner "pooling"); None: generation
    # With kv_transfer_config: what the stored KV blocks were computed by (vlite.kv_connector.factory.model_id);
    # blocks of another model, dtype, block size or quantization never match it.
    kv_model_id: Optional[str] = None
    # Recurrent-state models (linear-attention layers): state slots, one per request that may run plus
    # `num_cached_state_slots` for the prefix cache's saved states (vlite.core.mamba_manager); 0: none.
    num_state_slots: int = 0
    num_cached_state_slots: int = 0
    # The model's KV cache groups (vlite.core.kv_cache_interface.KVCacheGroupSpec): each attention group's layers
    # and window, the recurrent-state group; () where the model keeps no KV cache.
    kv_cache_groups: tuple = ()

    @property
    def kv_group_windows(self) -> tuple[int, ...]:
        """Each attention group's window (the KV cache manager's groups)."""
        from vlite.core.kv_cache_interface import KVCacheConfig

        return KVCacheConfig(self.num_kv_blocks, self.kv_cache_groups).group_windows or (0,)

    @property
    def kv_capacity_tokens(self) -> int:
        if not self.arch.is_causal:  # encoders keep no KV cache: a prompt is bounded by max_model_len alone
            return self.config.scheduler_config.max_model_len
        return self.num_kv_blocks * self.config.cache_config.block_size
