"""The Triton attention backend behind the model's layers: a tiny random Gemma 2 (GQA, a sliding-window
layer and a global one, attention-logit soft-capping) runs the same two steps through both backends from
the same runner inputs, and must give the CPU backend's hidden states and KV caches.

    step 1: A's first 12 prompt tokens, B's 5-token prompt             (fresh chunks)
    step 2: A's next 18 tokens (past the window of 8), B's first decode, C's 3-token prompt

Under TRITON_INTERPRET=1 on the CPU (the kernels' own tests cover the shapes one by one).
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.e2e.prompts import prompts_of_lengths
from tests.models import tiny
from vlite.attention.selector import TorchSDPABackend, get_attn_backend
from vlite.layers.quantization import QuantizationPlan
from vlite.model_loader import load_model_weights, resolve_model
from vlite.models.registry import build_model

BLOCK_SIZE = 16


def test_gemma2_steps_match_cpu_backend(tmp_path: Path, triton_device) -> None:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from vlite.attention.backends.triton_attn import TritonAttentionBackend

    hf = tiny.build(Gemma2Config, Gemma2ForCausalLM, seed=3, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                    attn_logit_softcapping=1.5, final_logit_softcapping=4.0, hidden_activation="gelu_pytorch_tanh")
    hf.save_pretrained(tmp_path)
    arch, weights = load_model_weights(resolve_model(str(tmp_path)), torch.float32)
    model = build_model(arch, weights, QuantizationPlan(None), torch.float32).to(triton_device)
    assert arch.attention_windows == (0, 8)
    assert get_attn_backend(torch.device("cuda")) is TritonAttentionBackend
    shape = TorchSDPABackend.get_kv_cache_shape(8, BLOCK_SIZE, arch.num_key_value_heads, arch.head_dim)
    devices = {TorchSDPABackend: torch.device("cpu"), TritonAttentionBackend: triton_device}
    caches = {b: [torch.zeros(shape, device=d) for _ in range(arch.num_hidden_layers)] for b, d in devices.items()}
    gen = torch.Generator().manual_seed(0)
    steps = [[(0, 12, [5, 2]), (0, 5, [7])],
             [(12, 18, [5, 2]), (5, 1, [7]), (0, 3, [1])]]
    for reqs in steps:
        inputs = tiny.step_inputs(reqs, BLOCK_SIZE)
        ids = torch.randint(0, tiny.VOCAB_SIZE, (len(inputs["positions"]),), generator=gen)
        hidden = {}
        for backend, kv in caches.items():
            dev = devices[backend]
            md = backend.build_metadata(*(inputs[k].to(dev) for k in ("query_start_loc", "seq_lens", "block_table",
                                                                      "slot_mapping")),
                                        BLOCK_SIZE, arch.attention_windows, max(n for _, n, _ in reqs))
            with torch.inference_mode():
                model.to(dev)
                hidden[backend] = model(ids.to(dev), inputs["positions"].to(dev), kv, md).cpu()
        torch.testing.assert_close(hidden[TritonAttentionBackend], hidden[TorchSDPABackend], atol=1e-4, rtol=1e-4)
    # Layer 0's K/V come from the same inputs: written bit for bit. Later layers' differ in the last bits
    # of the attention before them (another summation order).
    first, *rest = zip(caches[TorchSDPABackend], caches[TritonAttentionBackend])
    assert torch.equal(first[0].cpu(), first[1].cpu())
    for a, b in rest:
        torch.testing.assert_close(b.cpu(), a.cpu(), atol=1e-4, rtol=1e-4)


def test_engine_on_triton_backend_matches_transformers(tmp_path: Path, triton_device, monkeypatch) -> None:
    """The whole engine (runner inputs, chunked prefill mixed with decodes, block size 16) on the Triton
    backend: float32 greedy output token-identical to transformers on a tiny Llama (near-tie rule)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = tiny.build(LlamaConfig, LlamaForCausalLM, seed=5)
    tok = tiny.tiny_tokenizer()
    folder = tiny.save_hf(hf, tok, tmp_path / "llama")
    prompts = prompts_of_lengths(tok, [1, 4, 19, 63])
    refs = tiny.references(hf, prompts)
    monkeypatch.setenv("VLITE_ATTENTION_BACKEND", "TRITON_ATTN")
    monkeypatch.setenv("VLITE_CACHE_DIR", str(tmp_path / "cache"))
    llm, completions = tiny.run_vlite(folder, prompts, device=triton_device.type)
    assert llm.llm_engine.engine_core.model_runner.attn_backend.name == "TRITON_ATTN"
    print(tiny.assert_parity(completions, refs))
    if triton_device.type == "cpu":  # speculative decoding is CPU-only: its verify chunks through the kernel
        spec_llm, spec = tiny.run_vlite(folder, prompts, speculative_config={"num_speculative_tokens": 3,
                                                                              "prompt_lookup_min": 1,
                                                                              "draft_policy": "always"})
        stats = spec_llm.llm_engine.engine_core.scheduler.spec_decoding_stats
        assert stats.num_accepted_tokens > 0, stats  # verify chunks ran, with drafts kept
        assert [c.token_ids for c in spec] == [c.token_ids for c in completions]
