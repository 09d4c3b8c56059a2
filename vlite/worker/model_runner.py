"""ModelRunner: SchedulerOutput -> model forward -> sampled tokens.

execute_model() follows the design's sub-steps: _update_states (sync the persistent batch),
_prepare_inputs (-> StepInputs: positions, query_start_loc, seq_lens, slot_mapping, logits_indices and the
attention metadata), the forward, and logits at logits_indices only. sample_tokens() then samples (the
SamplingMetadata from InputBatch.make_sampling_metadata; drafts verified by the rejection sampler), appends
the tokens to the batch and, with speculative decoding, has the Drafter propose the next step's drafts.

    query_start_loc for 3 requests scheduled with [1, 5, 1] tokens:  [0, 1, 6, 7]
    logits_indices = query_start_loc[1:] - 1                        = [0, 5, 6]
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import torch

from vlite.attention.backends import gdn_attn
from vlite.attention.backends.gdn_attn import GDNAttentionMetadata
from vlite.core.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, kv_cache_groups
from vlite.attention.selector import get_attn_backend
from vlite.config import SpeculativeConfig
from vlite.core.sched.output import ModelRunnerOutput, SchedulerOutput
from vlite.distributed.parallel_state import get_tp_group
from vlite.layers.quantization import QuantizationPlan
from vlite.model_loader import ModelArchConfig
from vlite.models.registry import build_model
from vlite.profiler import section
from vlite.sample.metadata import with_forced_tokens
from vlite.sample.rejection_sampler import rejection_sample
from vlite.sample.sampler import Sampler
from vlite.pooling.config import PoolerConfig
from vlite.pooling.pooler import Pooler
from vlite.pooling_params import PoolingParams
from vlite.sampling_params import SamplingParams
from vlite.layers.encoder import EncoderAttentionMetadata
from vlite.structured_output.backend_xgrammar import apply_step_bitmask
from vlite.utils import group_offsets, group_starts
from vlite.worker.device_inputs import DeviceInputs
from vlite.worker.input_batch import InputBatch
from vlite.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin
from vlite.worker.lora_model_runner_mixin import LoRAModelRunnerMixin
from vlite.worker.pooling import pooled_outputs, step_token_type_ids
from vlite.worker.state_cache import linear_state, save_states, start_state
from vlite.worker.prompt_logprobs import compute_prompt_logprobs

if TYPE_CHECKING:
    from vlite.config import LoadedEngineConfig, LoRAConfig
    from vlite.lora.request import LoRARequest
    from vlite.structured_output.manager import GrammarOutput


@dataclass
class CachedRequestState:
    """What the runner keeps of a request across steps, including across a preemption."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # Prompt positions whose logprobs were already reported (a preempted request recomputes them).
    num_prompt_logprobs_done: int = 0
    pooling_params: Optional[PoolingParams] = None  # a pooling request: pooled when its prompt is done
    token_type_ids: Optional[list[int]] = None  # cross-encoders' segments
    lora_request: Optional[LoRARequest] = None  # the adapter it runs under


@dataclass
class StepInputs:
    """A step's inputs, as _prepare_inputs derives them from the SchedulerOutput and the persistent
    batch: the forward's (on the model's device) and what sampling and prompt logprobs read on the
    host. The scheduled requests are in batch-row order."""

    req_ids: list[str]
    rows: np.ndarray  # [R] their InputBatch rows
    num_scheduled: np.ndarray  # [R] tokens each computes in this step
    query_start_loc: np.ndarray  # [R + 1] where each request's tokens start in the step's T tokens
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attn_metadata: Any  # the attention backend's, built once for every layer
    logits_indices: torch.Tensor  # rows of the hidden states that get logits: each sampling request's last
    sample_req_ids: list[str]  # the requests that sample a token (a prompt chunk that ends its prompt, decodes)
    sample_rows: np.ndarray
    # Speculative decoding (None without drafts): logits are taken at a request's last 1 + its drafts
    # positions, the drafts verified against them after the forward.
    num_drafts: Optional[np.ndarray] = None  # [len(sample_req_ids)]
    draft_token_ids: Optional[np.ndarray] = None  # all of them, flat, requests in order
    token_type_ids: Optional[torch.Tensor] = None  # [T] cross-encoders' segments; None: all 0


@dataclass
class _StepState:
    req_ids: list[str]  # sampled requests, in order
    rows: np.ndarray  # their batch rows
    logits: torch.Tensor  # one row per sampled request, or 1 + its drafts' rows with speculative decoding
    prompt_logprobs: dict  # req_id -> lists, computed in execute_model
    pooler_output: dict  # req_id -> pooled output, computed in execute_model
    num_drafts: Optional[np.ndarray] = None  # [len(req_ids)] draft tokens verified per request; None: none
    draft_token_ids: Optional[np.ndarray] = None  # all of them, flat, requests in order
    forced_token_ids: dict[str, int] = field(default_factory=dict)  # thinking budgets: last row's only token


class ModelRunner(LoRAModelRunnerMixin, KVConnectorModelRunnerMixin):
    device = torch.device("cpu")  # set per instance in __init__

    @classmethod
    def from_loaded(cls, loaded: LoadedEngineConfig) -> ModelRunner:
        """The runner of `loaded`'s model (whatever part of it `loaded.arch` and `loaded.weights` hold), as every
        executor builds it: in the engine-core process or in each tensor-parallel worker."""
        cfg = loaded.config
        if cfg.device_config.num_threads is not None:  # --threads / VLITE_NUM_THREADS: this process's pool
            torch.set_num_threads(cfg.device_config.num_threads)
        runner = cls(loaded.arch, loaded.weights, loaded.torch_dtype, loaded.num_kv_blocks,
                     cfg.cache_config.block_size, cfg.scheduler_config.max_num_seqs, cfg.scheduler_config.max_model_len,
                     loaded.eos_token_ids, loaded.quantization, cfg.speculative_config, device=loaded.device,
                     enforce_eager=cfg.device_config.enforce_eager, pooler_config=loaded.pooler_config,
                     lora_config=cfg.lora_config, num_state_slots=loaded.num_state_slots,
                     kv_groups=loaded.kv_cache_groups or None)
        runner.init_kv_connector(loaded, runner.tp.rank if runner.tp is not None else 0)
        return runner

    def __init__(self, arch: ModelArchConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 num_blocks: int, block_size: int, max_num_reqs: int, max_model_len: int,
                 eos_token_ids: tuple[int, ...], quantization: QuantizationPlan = QuantizationPlan(None),
                 speculative_config: Optional[SpeculativeConfig] = None, device: str = "cpu",
                 enforce_eager: bool = False, pooler_config: Optional[PoolerConfig] = None,
                 lora_config: Optional[LoRAConfig] = None, num_state_slots: int = 0,
                 kv_groups: Optional[tuple[KVCacheGroupSpec, ...]] = None) -> None:
        """`kv_groups`: the KV cache groups (vlite.core.kv_cache_interface; None: one group of every attention
        layer, as backends that read one block table run)."""
        self.arch = arch
        # Weights and KV caches live on `device`; per-step arrays are built on the CPU and sent in one copy.
        self.device = torch.device(device)
        self.attn_backend = get_attn_backend(self.device)
        self._to_device = DeviceInputs(self.device)
        self.dtype = dtype
        self.block_size = block_size
        self.vocab_size = arch.vocab_size
        self.quantization = quantization
        self.model = build_model(arch, weights, quantization, dtype).eval().to(self.device)  # the registry's class
        self._init_lora(self.model, lora_config, dtype, self.device)  # LoRA layers, where adapters are served
        self.tp = get_tp_group()  # tensor parallelism: rank 0 samples, the others take its tokens
        self.attention_windows = arch.attention_windows  # one attention-metadata view per window, each step
        self.attn_backend.load_kernels()
        # Prompt tokens as decode rows below this position (where the backend's decode kernel takes the
        # layer's attention), so that what a request generates does not depend on how its prompt was
        # chunked (torch_sdpa.PREFILL_DECODE_ROWS_BELOW).
        # Every layer's head size counts (Gemma 4's full layers have their own).
        shapes = {(arch.layer_kv_heads(i), arch.layer_head_dim(i)) for i in arch.attention_layers}
        self.prefill_decode_rows_below = min(self.attn_backend.prefill_decode_rows_below(
            dtype, size, arch.attn_logit_softcapping) for _, size in shapes) if shapes else 0
        # Cascade attention (a prefix every running request shares, attended once for the step): where the
        # backend's kernels take this model's attention; each step then asks its cost model.
        self.cascade_heads = ((arch.num_attention_heads, arch.num_key_value_heads, 0, arch.head_dim)
                              if self.attn_backend.supports_cascade(dtype, arch.head_dim, arch.attn_logit_softcapping)
                              and not arch.linear_layers and len(shapes) == 1 else None)
        # Encoders attend within each whole sequence of a step and keep no KV cache.
        self.is_encoder = not arch.is_causal
        groups = KVCacheConfig(num_blocks, kv_groups or kv_cache_groups(arch, block_size, 0, split_windows=False))
        # One block table per attention group; layer j of every group of a head shape shares that shape's j-th K/V
        # buffer (a block is held by one group at a time). KV-shared layers (Gemma 4) get their source layer's
        # buffer; linear-attention layers their (conv, delta-rule) state slots instead.
        self.kv_group_layers = [] if self.is_encoder else [g.layer_indices for g in groups.attention_groups]
        self.kv_group_windows = groups.group_windows
        # Shapes from this worker's arch (a tensor-parallel rank's KV heads), counts from the groups.
        attn_groups = () if self.is_encoder else groups.attention_groups
        shape_of = [(arch.layer_kv_heads(g.layer_indices[0]), arch.layer_head_dim(g.layer_indices[0]))
                    for g in attn_groups]
        counts: dict[tuple[int, int], int] = {}
        for g, shape in zip(attn_groups, shape_of):
            counts[shape] = max(counts.get(shape, 0), len(g.layer_indices))
        buffers = {(heads, size): [torch.zeros(self.attn_backend.get_kv_cache_shape(num_blocks, block_size, heads, size),
                                               dtype=dtype, device=self.device) for _ in range(n)]
                   for (heads, size), n in counts.items()}
        self.kv_caches: list[Any] = [None] * (0 if self.is_encoder else arch.num_hidden_layers)
        for g, shape in zip(attn_groups, shape_of):
            for j, layer in enumerate(g.layer_indices):
                self.kv_caches[layer] = buffers[shape][j]
        for i in () if self.is_encoder else arch.attention_layers:
            self.kv_caches[i] = self.kv_caches[arch.kv_source(i)]
        for i in arch.linear_layers:
            self.kv_caches[i] = linear_state(arch, num_state_slots, self.device)
        self.state_caches = [self.kv_caches[i] for i in arch.linear_layers]
        if self.state_caches:
            gdn_attn.load_kernels()
        # pooling models: hidden states -> each finished prompt's output (vlite.pooling)
        self.pooler = (Pooler(pooler_config, getattr(self.model, "classify", None))
                       if pooler_config is not None else None)
        max_blocks_per_req = -(-(max_model_len + 1) // block_size)
        self._input_batch_args = (max_num_reqs, max_model_len, max_blocks_per_req, arch.vocab_size,
                                  eos_token_ids, self.device, max(1, len(self.kv_group_layers)))
        self.input_batch = InputBatch(*self._input_batch_args)
        self.requests: dict[str, CachedRequestState] = {}
        self.sampler = Sampler()
        self.drafter = None  # speculative decoding: drafts for the next step, proposed after sampling
        # A request verifying drafts runs its 1 + k query tokens as decode rows (each sees the keys up to
        # its position): the decode kernels and the fused decode layer then take the step as they would
        # 1 + k decodes, where a causal prefill chunk would leave the fast path.
        self.max_decode_query_len = 1
        if speculative_config is not None:
            from vlite.spec_decode.drafter import Drafter
            from vlite.spec_decode.verify_cost import measure_verify_cost

            self.max_decode_query_len = 1 + speculative_config.num_speculative_tokens
            key = (repr(arch), dtype, repr(quantization), str(self.device))  # what the costs depend on
            self.drafter = Drafter(speculative_config,
                                   lambda max_tokens: measure_verify_cost(self, max_tokens, num_blocks, key))
        self._step: _StepState | None = None
        # Fault injection for reliability tests: a step computing this token id raises.
        fault = os.environ.get("VLITE_FAULT_INJECT_TOKEN_ID")
        self._fault_token_id = int(fault) if fault else None
        self.cuda_graphs = None  # all-decode steps replayed from CUDA graphs (vlite.worker.cuda_graphs)
        # Mixture layers read expert counts back to the host (not capturable): they run eagerly.
        if (self.device.type == "cuda" and not enforce_eager and not arch.num_experts and lora_config is None
                and not arch.linear_layers):
            from vlite.worker.cuda_graphs import CUDAGraphRunner

            self.cuda_graphs = CUDAGraphRunner(self.model, self.kv_caches, self.attn_backend, block_size,
                                               self.attention_windows, max_num_reqs, max_blocks_per_req, self.device)
            self.cuda_graphs.capture()

    def reset(self) -> None:
        """Forget the batch after a step raised: the scheduler re-sends every request as new.

        Request states are kept (what prompt logprobs were reported).
        """
        self.input_batch = InputBatch(*self._input_batch_args)
        self._step = None

    # ---- execute_model -------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        self._kv_connector_start_step(scheduler_output)  # KV loads run in the background from here
        with section("prepare_inputs"):
            self._update_states(scheduler_output)
            self._step = None
            if scheduler_output.total_num_scheduled_tokens == 0:
                return
            inputs = self._prepare_inputs(scheduler_output)
            if self._fault_token_id is not None and bool((inputs.input_ids == self._fault_token_id).any()):
                raise RuntimeError(f"injected fault: token id {self._fault_token_id} scheduled")
        with section("forward"):  # the paged_attention calls inside are timed as "attention"
            hidden = self._forward(inputs)
            save_states(self.state_caches, scheduler_output.state_saves)
            logits = self.model.compute_logits(hidden[inputs.logits_indices]) if inputs.sample_req_ids else None
            prompt_logprobs = compute_prompt_logprobs(hidden, inputs, self.input_batch, self.requests, self.model,
                                                      self.vocab_size, self.device)
            pooled = (pooled_outputs(self.pooler, hidden, inputs, scheduler_output, self.requests)
                      if self.pooler is not None else {})
        self._step = _StepState(inputs.sample_req_ids, inputs.sample_rows, logits, prompt_logprobs, pooled,
                                inputs.num_drafts, inputs.draft_token_ids, scheduler_output.forced_token_ids)
        self._kv_connector_after_forward(scheduler_output)  # blocks completed in this step, copied out now

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        """The model's hidden states for the step: a CUDA-graph replay for all-decode steps, else eager."""
        graphs = self.cuda_graphs
        size = (graphs.padded_size(len(inputs.rows), int(inputs.query_start_loc[-1]),
                                   inputs.attn_metadata.common_prefix_len) if graphs else None)
        if inputs.token_type_ids is not None:
            return self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn_metadata,
                              token_type_ids=inputs.token_type_ids)
        if size is None:
            return self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn_metadata)
        md = inputs.attn_metadata
        return graphs.run(size, inputs.input_ids, inputs.positions, md.slot_mapping, md.seq_lens, md.block_table)

    def _start_state(self, new: Any, row: int) -> None:
        """A joining request's state slot: zeros, or the saved state its prefix-cache hit ends with."""
        self.input_batch.state_slot[row] = new.state_slot
        if new.state_slot >= 0:
            start_state(self.state_caches, new.state_slot, new.state_restore_from)

    def _update_states(self, so: SchedulerOutput) -> None:
        batch = self.input_batch
        for req_id in so.finished_req_ids:
            batch.remove_request(req_id)
            self.requests.pop(req_id, None)
        for req_id in so.preempted_req_ids:
            batch.remove_request(req_id)  # keep the state: it resumes
        for new in so.scheduled_new_reqs:
            state = self.requests.get(new.req_id)
            if state is None:
                state = CachedRequestState(new.req_id, new.prompt_token_ids, new.sampling_params,
                                           pooling_params=new.pooling_params, token_type_ids=new.token_type_ids,
                                           lora_request=new.lora_request)
                self.requests[new.req_id] = state
            row = batch.add_request(new.req_id, new.prompt_token_ids + new.output_token_ids,
                                    len(new.prompt_token_ids), new.num_computed_tokens, new.block_ids,
                                    state.sampling_params)
            if self.state_caches:
                self._start_state(new, row)
        cached = so.scheduled_cached_reqs
        for req_id, new_block_ids, num_computed, num_blocks in zip(cached.req_ids, cached.new_block_ids,
                                                                    cached.num_computed_tokens,
                                                                    cached.num_blocks_before):
            row = batch.req_id_to_index[req_id]
            batch.num_blocks[row] = num_blocks  # fewer when blocks of rejected drafts were freed
            if new_block_ids:
                batch.append_block_ids(row, new_block_ids)
            batch.num_computed_tokens[row] = num_computed
        for req_id, drafts in so.scheduled_spec_decode_tokens.items():
            # Inputs after the request's tokens; its verified tokens overwrite them after sampling.
            row = batch.req_id_to_index[req_id]
            n = int(batch.num_tokens[row])
            batch.token_ids[row, n:n + len(drafts)] = drafts

    def _prepare_inputs(self, so: SchedulerOutput) -> StepInputs:
        batch = self.input_batch
        req_ids = list(so.num_scheduled_tokens)
        rows = np.fromiter((batch.req_id_to_index[r] for r in req_ids), dtype=np.int64, count=len(req_ids))
        order = np.argsort(rows, kind="stable")
        rows = rows[order]
        req_ids = [req_ids[i] for i in order]
        num_scheduled = np.fromiter((so.num_scheduled_tokens[r] for r in req_ids), dtype=np.int64,
                                    count=len(req_ids))
        if self.lora_manager is not None:
            self.lora_manager.set_active([self.requests[r].lora_request for r in req_ids], num_scheduled)

        query_start_loc = np.zeros(len(req_ids) + 1, dtype=np.int64)
        np.cumsum(num_scheduled, out=query_start_loc[1:])
        req_indices = np.repeat(np.arange(len(req_ids)), num_scheduled)
        token_rows = rows[req_indices]
        num_computed = batch.num_computed_tokens[rows]
        positions = num_computed[req_indices] + group_offsets(num_scheduled)
        input_ids = batch.token_ids[token_rows, positions]
        block_numbers = batch.block_table[token_rows, positions // self.block_size]
        slot_mapping = block_numbers * self.block_size + positions % self.block_size
        seq_lens = num_computed + num_scheduled

        sample_mask = np.fromiter((r in so.sample_req_ids for r in req_ids), dtype=bool, count=len(req_ids))
        logits_indices = (query_start_loc[1:] - 1)[sample_mask]
        sample_req_ids = [r for r, m in zip(req_ids, sample_mask) if m]
        num_drafts = draft_token_ids = precise_rows = None
        spec = so.scheduled_spec_decode_tokens
        if spec:
            drafts_per_req = np.fromiter((len(spec.get(r, ())) for r in req_ids), dtype=np.int64, count=len(req_ids))
            # Logits at the last 1 + m positions of a request verifying m drafts.
            num_drafts = drafts_per_req[sample_mask]
            counts = num_drafts + 1
            first = np.repeat(logits_indices - num_drafts, counts)
            logits_indices = first + group_offsets(counts)
            draft_token_ids = np.fromiter((t for r in sample_req_ids for t in spec.get(r, ())), dtype=np.int64)
            # the kernels' precision as for the step's rows without drafts (QuantizedLinear.forward)
            precise_rows = int(num_scheduled.sum()) - len(draft_token_ids)
            # decode rows: the verify chunks only (1 + drafts tokens), not a prompt chunk as short; where
            # every chunk is one, the step's longest says so (the metadata's all-decode-rows fast path)
            verify_lens = 1 + drafts_per_req
            max_decode_query_len = (int(num_scheduled.max()) if bool((num_scheduled <= verify_lens).all())
                                    else torch.from_numpy(verify_lens))
        else:
            max_decode_query_len = 1

        # the blocks the step's sequences span, not max_model_len's worth per row (copied every step)
        table_width = max(1, -(-int(seq_lens.max()) // self.block_size))
        dev = self._to_device(dict(input_ids=input_ids, positions=positions, query_start_loc=query_start_loc,
                                   seq_lens=seq_lens, block_table=batch.block_table[rows, :table_width],
                                   slot_mapping=slot_mapping,
                                   logits_indices=logits_indices))
        if self.is_encoder:  # whole sequences, bidirectional, no KV cache
            attn_metadata = EncoderAttentionMetadata(query_start_loc, int(num_scheduled.max()))
        else:
            attn_metadata = self.attn_backend.build_metadata(
                dev["query_start_loc"], dev["seq_lens"], dev["block_table"], dev["slot_mapping"], self.block_size,
                self.kv_group_windows[:1] if len(self.kv_group_layers) > 1 else self.attention_windows,
                max_query_len=int(num_scheduled.max()),
                max_decode_query_len=max_decode_query_len, decode_rows_below=self.prefill_decode_rows_below,
                precise_rows=precise_rows,
                common_prefix_len=self._cascade_prefix_len(so.num_common_prefix_blocks, rows, num_computed,
                                                           num_scheduled))
        if len(self.kv_group_layers) > 1:  # the other groups' block tables: their own slots, a view per layer
            attn_metadata.layer_views = self._group_views(attn_metadata, rows, token_rows, positions, query_start_loc,
                                                          seq_lens, table_width, num_scheduled, precise_rows)
        if self.state_caches:
            attn_metadata.gdn = GDNAttentionMetadata.build(batch.state_slot[rows], query_start_loc)
        inputs = StepInputs(req_ids, rows, num_scheduled, query_start_loc, dev["input_ids"], dev["positions"],
                            attn_metadata, dev["logits_indices"], sample_req_ids, rows[sample_mask], num_drafts,
                            draft_token_ids)
        if self.pooler is not None and getattr(self.model, "token_type_embeddings", None) is not None:
            inputs.token_type_ids = step_token_type_ids(inputs, num_computed, self.requests, self.device)
        return inputs

    def _group_views(self, md: Any, rows: np.ndarray, token_rows: np.ndarray, positions: np.ndarray,
                     query_start_loc: np.ndarray, seq_lens: np.ndarray, table_width: int, num_scheduled: np.ndarray,
                     precise_rows: Optional[int]) -> dict[int, Any]:
        """The step as each layer of attention groups 1.. sees it (its group's block table and slots), by layer."""
        views = {}
        bs, qsl, lens = self.block_size, torch.from_numpy(query_start_loc), torch.from_numpy(seq_lens)
        for g in range(1, len(self.kv_group_layers)):
            table = self.input_batch.block_tables[g]
            slots = table[token_rows, positions // bs] * bs + positions % bs
            view = self.attn_backend.build_metadata(
                qsl, lens, torch.from_numpy(table[rows, :table_width]), torch.from_numpy(slots), bs,
                (self.kv_group_windows[g],), max_query_len=int(num_scheduled.max()),
                decode_rows_below=self.prefill_decode_rows_below, precise_rows=precise_rows)
            views.update(dict.fromkeys(self.kv_group_layers[g], view))
        return views

    def _cascade_prefix_len(self, num_common_prefix_blocks: int, rows: np.ndarray, num_computed: np.ndarray,
                            num_scheduled: np.ndarray) -> int:
        """Tokens of the step's shared prefix to attend once for all its rows (vLLM's cascade prefix length),
        or 0: the scheduler's common blocks, cut to what every request had computed before this step
        (a request's new keys are its own) in whole blocks, when the backend's cost model says it pays."""
        if not num_common_prefix_blocks or self.cascade_heads is None:
            return 0
        bs = self.block_size
        length = min(num_common_prefix_blocks * bs, int(num_computed.min())) // bs * bs
        if not length or not self.attn_backend.use_cascade_attention(length, num_scheduled, *self.cascade_heads):
            return 0
        table = self.input_batch.block_table[rows, :length // bs]
        # the scheduler counts blocks every running request holds: the same ids at the same places
        return length if bool((table == table[:1]).all()) else 0

    # ---- sample_tokens -------------------------------------------------------------------

    @torch.inference_mode()
    def sample_tokens(self, grammar_output: GrammarOutput | None = None) -> ModelRunnerOutput:
        return self._kv_connector_output(self._sample_tokens(grammar_output))

    def _sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        step = self._step
        if step is None or not step.req_ids:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[],
                                     prompt_logprobs=step.prompt_logprobs if step is not None else {},
                                     pooler_output=step.pooler_output if step is not None else {})
        if self.tp is not None and not self.tp.is_driver:
            return self._take_driver_tokens(step)
        batch = self.input_batch
        rows = step.rows
        if step.num_drafts is None:
            metadata = with_forced_tokens(batch.make_sampling_metadata(rows), step.req_ids, None,
                                          step.forced_token_ids, step.logits.device)
            if grammar_output is not None:
                with section("grammar_mask"):
                    apply_step_bitmask(step.logits, step.req_ids, step.num_drafts, grammar_output)
            out = self.sampler(step.logits, metadata)
            counts = np.ones(len(rows), dtype=np.int64)
            token_lists = [[t] for t in out.sampled_token_ids.tolist()]
            lt = out.logprobs_tensors
            num_drafts = num_accepted = np.zeros(len(rows), dtype=np.int64)
        else:
            counts = step.num_drafts + 1
            # Logits row i of request b scores the token after its first i drafts.
            offsets = group_offsets(counts)
            metadata = with_forced_tokens(batch.make_sampling_metadata(np.repeat(rows, counts), offsets),
                                          step.req_ids, step.num_drafts, step.forced_token_ids, step.logits.device)
            if grammar_output is not None:
                with section("grammar_mask"):
                    apply_step_bitmask(step.logits, step.req_ids, step.num_drafts, grammar_output)
            assert step.draft_token_ids is not None
            verified = rejection_sample(step.logits, metadata, step.num_drafts, step.draft_token_ids)
            token_lists = verified.output_token_ids
            counts = verified.num_accepted + 1
            lt = verified.logprobs_tensors
            num_drafts, num_accepted = step.num_drafts, verified.num_accepted

        # Append the new tokens to the persistent batch: they are the next step's inputs.
        tokens = [t for out in token_lists for t in out]
        if self.tp is not None:  # the other ranks append the same ones (_take_driver_tokens)
            if step.num_drafts is not None:
                self.tp.broadcast(torch.as_tensor(counts, dtype=torch.int64))
            self.tp.broadcast(torch.tensor(tokens, dtype=torch.int64))
        self._append_tokens(rows, counts, tokens)

        result = ModelRunnerOutput(req_ids=step.req_ids, sampled_token_ids=token_lists,
                                   prompt_logprobs=step.prompt_logprobs, pooler_output=step.pooler_output)
        if lt is not None:
            ids, lps, ranks = lt.token_ids.tolist(), lt.logprobs.tolist(), lt.ranks.tolist()
            num_logprobs = batch.num_logprobs[rows]
            starts = group_starts(counts)
            for i, req_id in enumerate(step.req_ids):
                n = int(num_logprobs[i])
                if n >= 0:
                    lo, hi = int(starts[i]), int(starts[i] + counts[i])
                    result.logprobs[req_id] = ([x[:n + 1] for x in ids[lo:hi]], [x[:n + 1] for x in lps[lo:hi]],
                                               ranks[lo:hi])
        if self.drafter is not None:
            with section("propose"):
                result.spec_token_ids = self.drafter.propose(batch, step.req_ids, rows, num_drafts, num_accepted)
        self._step = None
        return result

    def _take_driver_tokens(self, step: _StepState) -> ModelRunnerOutput:
        """A rank other than 0 under tensor parallelism: rank 0's new tokens (sampled, or verified drafts),
        appended to the batch as the next step's inputs (one sampler, so seeded and random sampling
        agree on every rank)."""
        tp = self.tp
        counts = (np.ones(len(step.rows), dtype=np.int64) if step.num_drafts is None
                  else tp.broadcast(torch.empty(len(step.rows), dtype=torch.int64)).numpy())
        tokens = tp.broadcast(torch.empty(int(counts.sum()), dtype=torch.int64)).numpy()
        self._append_tokens(step.rows, counts, tokens)
        self._step = None
        return ModelRunnerOutput(req_ids=[], sampled_token_ids=[], prompt_logprobs={})

    def _append_tokens(self, rows: np.ndarray, counts: np.ndarray, tokens: Any) -> None:
        """Append each row's new tokens (`counts[i]` of the flat `tokens` for rows[i]): the next step's inputs."""
        batch = self.input_batch
        if len(rows) == 1:  # a single stream: a slice, where the fancy indexing below costs ~60 us
            row, n = int(rows[0]), int(batch.num_tokens[rows[0]])
            batch.token_ids[row, n:n + int(counts[0])] = tokens
            batch.num_tokens[row] = n + int(counts[0])
            return
        token_rows = np.repeat(rows, counts)
        within = group_offsets(counts)
        batch.token_ids[token_rows, batch.num_tokens[token_rows] + within] = tokens
        batch.num_tokens[rows] += counts
