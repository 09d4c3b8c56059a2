"""Tiny random models for the per-architecture parity tests: built from a `transformers` config,
saved as a Hugging Face folder or written as a GGUF file the way llama.cpp lays one out, and run by
vlite and transformers on the same prompts.

The weights are random but not transformers' near-zero defaults: biases and norm weights are drawn
too (a bias of zeros or a norm of ones would let a model that drops them pass), and every value is
rounded to float16 so that a GGUF file with F16 matrices holds exactly the weights transformers runs.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tests.e2e.prompts import corpus, prompts_of_lengths
from tests.e2e.reference import ATOL, Reference, compare_greedy, hf_greedy

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
EOS_ID, ALT_EOS_ID = 2, 0  # config.json's eos, and the one generation_config.json adds (as Qwen2.5 does)
VOCAB_SIZE = 320
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Very different lengths, so that one generate() mixes chunked prefills with other requests' decodes.
PROMPT_LENGTHS = [1, 4, 19, 63, 170, 290]
MAX_NEW = 20
STEP_TOKENS = 32  # max_num_batched_tokens: the 290-token prompt takes ten steps


def tiny_tokenizer() -> Any:
    """A byte-level BPE of VOCAB_SIZE tokens learned from Python sources, split like Qwen2's."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tok = Tokenizer(models.BPE())
    # The split a GGUF file's tokenizer.ggml.pre = "qwen2" stands for: both forms then encode alike.
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([corpus()], trainer)
    assert tok.get_vocab_size() == VOCAB_SIZE
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=CHAT_TEMPLATE)


def prompts(tokenizer: Any) -> list[list[int]]:
    return prompts_of_lengths(tokenizer, PROMPT_LENGTHS)


def build(config_cls: type, model_cls: type, seed: int = 0, **overrides: Any) -> Any:
    """A transformers model of 2 layers, hidden 64, 4 query heads over 2 KV heads, random weights."""
    kwargs: dict[str, Any] = dict(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, eos_token_id=EOS_ID,
        bos_token_id=None, initializer_range=0.08)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = randomize(model_cls(config_cls(**kwargs)).eval(), seed, "norm", f16_exact=True)
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig(eos_token_id=[EOS_ID, ALT_EOS_ID], pad_token_id=ALT_EOS_ID)
    return model


def randomize(model: Any, seed: int, norm_marker: str, f16_exact: bool = False) -> Any:
    """Biases ~N(0, 0.3) and norm weights (parameters whose name holds `norm_marker`) in [0.5, 1.5), away from
    the 0 and 1 they start at, so that a loader mixing them up fails; `f16_exact`: every value rounded to what
    float16 holds (GGUF F16 files then carry the very same weights)."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
            elif norm_marker in name:
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            if f16_exact:
                p.copy_(p.half().float())
    return model


def save_hf(model: Any, tokenizer: Any, folder: Path, max_shard_size: str | None = None) -> Path:
    """A Hugging Face folder: config.json, generation_config.json, safetensors (sharded with an index
    when max_shard_size is given), tokenizer files."""
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(folder, **kwargs)
    tokenizer.save_pretrained(folder)
    return folder


# llama.cpp's converter, per GGUF architecture: Q/K rows in interleaved-rotary order (ggml's "normal" rotary),
# Gemma's RMSNorm weights stored with the 1 of (1 + weight) added, the sliding window written (Phi-3: 0 for none).
_GGUF_QK_PERMUTED = {"llama", "smollm3"}
_GGUF_NORM_PLUS_ONE = {"gemma2", "gemma3"}
_GGUF_SLIDING_WINDOW = {"gemma2", "gemma3", "phi3"}


def write_gguf(model: Any, tokenizer: Any, path: Path, arch: str, f16: bool = True, quant: str | None = None) -> Path:
    """The model as llama.cpp's converter lays it out: tensor names from the gguf package's own map
    for `arch`, its metadata keys, matrices in F16 (or F32), vectors in F32, no lm_head when tied, a
    byte-level BPE tokenizer with the chat template. What llama.cpp fixes per family is not written (Gemma's
    layer pattern, local rope base and query scaling; SmolLM3's NoPE layers); what the converter writes is:
    sliding window, logit soft-capping, rotary dims of partial rotary, the global layers' rope scaling,
    LongRoPE's factors as tensors with its original context and attention factor; fused tensors stay fused.
    `quant` ("Q4_0", "Q8_0": types the gguf package quantizes): the matrices in that type instead."""
    import gguf

    cfg = model.config
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)  # Gemma 3: per layer type
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    arch_enum = {name: a for a, name in gguf.MODEL_ARCH_NAMES.items()}[arch]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(float(rope["rope_theta"]))
    if rope.get("rope_type", "default") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(rope["factor"]))
    partial = rope.get("partial_rotary_factor") or getattr(cfg, "partial_rotary_factor", None) or 1.0
    if partial != 1.0:
        w.add_rope_dimension_count(int(partial * head_dim))
    if rope.get("rope_type") == "longrope":
        orig = rope.get("original_max_position_embeddings") or cfg.original_max_position_embeddings
        scale = cfg.max_position_embeddings / orig
        w.add_rope_scaling_orig_ctx_len(orig)
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0)
        for kind in ("long", "short"):
            w.add_tensor(f"rope_factors_{kind}.weight", np.asarray(rope[f"{kind}_factor"], dtype=np.float32))
    if arch in _GGUF_SLIDING_WINDOW:
        w.add_sliding_window(getattr(cfg, "sliding_window", None) or 0)
    for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(cfg, cap, None):
            getattr(w, f"add_{cap}")(float(getattr(cfg, cap)))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    n_experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
    if n_experts:  # mixtures: the counts and the experts' width (Qwen3-MoE's differs from its dense layers')
        w.add_expert_count(n_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        if getattr(cfg, "moe_intermediate_size", None):
            w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if head_dim != cfg.hidden_size // cfg.num_attention_heads:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if f16 else gguf.LlamaFileType.ALL_F32)

    vocab = tokenizer.backend_tokenizer.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in SPECIAL_TOKENS else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_eos_token_id(EOS_ID)
    w.add_pad_token_id(ALT_EOS_ID)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)

    names = gguf.get_tensor_name_map(arch_enum, cfg.num_hidden_layers)
    dense_names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if ".mlp.experts." in name or name.endswith(".mlp.gate.weight"):
            for gguf_name, data in _gguf_experts(name, t.detach().numpy()):
                w.add_tensor(gguf_name, data.astype(np.float16 if f16 else np.float32))
            continue
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None and n_experts:  # a dense layer among mixtures: Llama's ffn_* names
            gguf_name = dense_names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        data = t.detach().numpy()
        if arch in _GGUF_QK_PERMUTED and name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias",
                                                         "k_proj.bias")):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            data = _llama_cpp_rotary_order(data, heads)
        if arch in _GGUF_NORM_PLUS_ONE and name.endswith("norm.weight"):
            data = data + 1
        if quant is not None and data.ndim == 2:
            qtype = gguf.GGMLQuantizationType[quant]
            w.add_tensor(gguf_name, gguf.quants.quantize(data.astype(np.float32), qtype), raw_dtype=qtype)
            continue
        w.add_tensor(gguf_name, data.astype(np.float16 if f16 and data.ndim == 2 else np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _gguf_experts(name: str, data: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """A mixture layer's tensors as llama.cpp's converter writes them: the router as ffn_gate_inp, the
    experts stacked [experts, rows, K] (transformers 5 keeps gate and up fused, gate first)."""
    layer = name.split(".")[2]
    if name.endswith(".mlp.gate.weight"):
        return [(f"blk.{layer}.ffn_gate_inp.weight", data)]
    if name.endswith("gate_up_proj"):
        half = data.shape[1] // 2
        return [(f"blk.{layer}.ffn_gate_exps.weight", data[:, :half]),
                (f"blk.{layer}.ffn_up_exps.weight", data[:, half:])]
    assert name.endswith("down_proj"), name
    return [(f"blk.{layer}.ffn_down_exps.weight", data)]


def _llama_cpp_rotary_order(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's Q/K row order for Llama (each head's rotate-half halves interleaved)."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def step_inputs(reqs: list[tuple[int, int, list[int]]], block_size: int,
                width: int | None = None) -> dict[str, torch.Tensor]:
    """One step's runner inputs for (num_computed, num_scheduled, block ids) per request, laid out as
    ModelRunner._prepare_inputs lays them out (block-table rows padded with 0 to `width` columns)."""
    width = width or max(len(b) for _, _, b in reqs)
    qsl, pos, slots, seq_lens = [0], [], [], []
    for computed, n, blocks in reqs:
        p = np.arange(computed, computed + n)
        pos.append(p)
        slots.append(np.asarray(blocks)[p // block_size] * block_size + p % block_size)
        qsl.append(qsl[-1] + n)
        seq_lens.append(computed + n)
    table = [b + [0] * (width - len(b)) for _, _, b in reqs]
    arrays = dict(query_start_loc=np.array(qsl), seq_lens=np.array(seq_lens), block_table=np.array(table),
                  slot_mapping=np.concatenate(slots), positions=np.concatenate(pos))
    return {k: torch.from_numpy(v.astype(np.int64)) for k, v in arrays.items()}


def reference_device() -> str:
    """Where transformers' references run: VLITE_TEST_DEVICE (scripts/gpu_check.py sets cuda), else the CPU.
    vlite itself runs on device="auto": the GPU where there is one."""
    import os

    return os.environ.get("VLITE_TEST_DEVICE", "cpu")


def references(model: Any, prompt_ids: list[list[int]], max_new: int = MAX_NEW) -> list[Reference]:
    model.to(reference_device())
    try:
        return [hf_greedy(model, p, max_new) for p in prompt_ids]
    finally:
        model.to("cpu")  # the tests save and convert it from the CPU


def run_vlite(model_path: Path, prompt_ids: list[list[int]], **llm_kwargs: Any) -> tuple[Any, list[Any]]:
    """vlite in float32 on all prompts in one generate() call, small steps (chunked prefill + decodes)."""
    from vlite import LLM, SamplingParams

    kwargs = dict(dtype="float32", max_num_batched_tokens=STEP_TOKENS, kv_cache_memory_bytes=16 * 2**20)
    kwargs.update(llm_kwargs)
    llm = LLM(model=str(model_path), **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False)
    return llm, [o.outputs[0] for o in outputs]


def assert_parity(completions: list[Any], refs: list[Reference]) -> list[dict]:
    """Token-identical to transformers (a divergence only right after a near-tie of the reference),
    top-5 logprobs within ATOL; and at most one prompt may stop early at such a near-tie, so a test
    whose comparisons all end at the first token cannot pass."""
    reports = []
    for completion, ref in zip(completions, refs):
        assert len(completion.token_ids) == MAX_NEW and completion.finish_reason == "length"
        reports.append(compare_greedy(completion.token_ids, completion.logprobs, ref, ATOL))
    assert sum(r["diverged_at"] is not None for r in reports) <= 1, reports
    return reports


def model_class_name(llm: Any) -> str:
    return type(llm.llm_engine.engine_core.model_runner.model).__name__


def teacher_forced_agreement(llm: Any, prompt_ids: list[list[int]], refs: list[Reference]
                             ) -> tuple[float, float, float]:
    """Score each reference continuation in one prefill (prompt_logprobs): the share of positions
    whose top-1 is the reference's token, and the median and largest |logprob gap| of that token.
    For lower-precision runs, whose greedy paths may part at any close call."""
    from vlite import SamplingParams

    seqs = [{"prompt_token_ids": p + r.token_ids} for p, r in zip(prompt_ids, refs)]
    outputs = llm.generate(seqs, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    matched, gaps = 0, []
    for prompt, ref, out in zip(prompt_ids, refs, outputs):
        for j, token in enumerate(ref.token_ids):
            entry = out.prompt_logprobs[len(prompt) + j]
            matched += next(t for t, lp in entry.items() if lp.rank == 1) == token
            gaps.append(abs(entry[token].logprob - float(ref.logprobs[j][token])))
    gaps.sort()
    return matched / len(gaps), gaps[len(gaps) // 2], gaps[-1]


# llama.cpp's own converter and quantizer, for the families whose GGUF layout is best taken from the tool that writes
# the files people download (Qwen3.5, Qwen3-Next): the source tree and build of ../shared/anchors/llamacpp.sh
# (LLAMACPP_DIR, default ~/.cache/vlite-anchors/llama-cpp-python-*). Tests skip where it is missing.
_CONVERT = """
import runpy, sys
tree = sys.argv.pop(1)
sys.path[:0] = [tree + "/gguf-py", tree]
import conversion.base
# The tiny tokenizer's pre-tokenizer is no released model's, so the converter's fingerprint table does not know it;
# it is Qwen2's split (tiny_tokenizer). Nothing else of the converter is touched.
conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
# Gemma 4's converter reads only a Llama-style BPE (gguf.LlamaHfVocab): the tiny byte-level BPE goes in as GPT-2's,
# as for every other family (the tensors and model metadata are what the tests compare).
import conversion.gemma
conversion.gemma.Gemma4Model.set_vocab = conversion.base.TextModel._set_vocab_gpt2
sys.argv[0] = tree + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def llama_cpp_dir() -> Path | None:
    """The llama.cpp anchor's folder (vendor/llama.cpp: the source tree; build/bin: its tools), None if absent."""
    import glob
    import os

    found = [os.environ["LLAMACPP_DIR"]] if os.environ.get("LLAMACPP_DIR") else sorted(
        glob.glob(os.path.expanduser("~/.cache/vlite-anchors/llama-cpp-python-*")))
    for d in found:
        if (Path(d) / "vendor" / "llama.cpp" / "conversion" / "base.py").exists():
            return Path(d)
    return None


def llama_cpp_convert(folder: Path, out: Path, outtype: str = "f16", *args: str) -> Path:
    """A Hugging Face folder as llama.cpp's convert_hf_to_gguf.py writes it (`outtype`: f32, f16, bf16, q8_0)."""
    import subprocess
    import sys

    root = llama_cpp_dir()
    assert root is not None, "llama.cpp's source tree (../shared/anchors/llamacpp.sh build)"
    run = subprocess.run([sys.executable, "-c", _CONVERT, str(root / "vendor" / "llama.cpp"), str(folder),
                          "--outfile", str(out), "--outtype", outtype, *args], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    return out


def llama_cpp_quantize(src: Path, out: Path, qtype: str) -> Path | None:
    """`src` quantized by llama.cpp's llama-quantize (Q4_K_M, Q8_0, ...); None where the tool is not built."""
    import os
    import subprocess

    root = llama_cpp_dir()
    tool = None if root is None else root / "build" / "bin" / "llama-quantize"
    if tool is None or not tool.exists():
        return None
    env = {**os.environ, "LD_LIBRARY_PATH": f"{tool.parent}:{os.environ.get('LD_LIBRARY_PATH', '')}"}
    run = subprocess.run([str(tool), str(src), str(out), qtype, "1"], capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    return out
