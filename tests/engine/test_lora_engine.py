"""LoRA through LLM / LLMEngine / EngineCore on a tiny Llama with peft adapters (the outputs' correctness is
tests/lora/test_lora_e2e.py): adapters per prompt, the adapter API, a bad adapter refused before any request
starts with the engine serving on, ids that cannot change meaning, a busy adapter kept, LoRA off refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.lora.peft_models import make_adapter
from tests.models import tiny
from vlite.lora.request import LoRARequest

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    from vlite import LLM

    root = tmp_path_factory.mktemp("lora_engine")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLITE_CACHE_DIR", str(root / "cache"))
        # the torch path of the LoRA layers: this tests the engine, not the kernels (whose LoRAMapping may be absent)
        mp.setenv("VLITE_CPU_KERNELS", "0")
        base = tiny.build(LlamaConfig, LlamaForCausalLM, seed=4)
        folder = tiny.save_hf(base, tiny.tiny_tokenizer(), root / "hf")
        adapters = {}
        for i, name in enumerate(("a", "b")):
            make_adapter(base, root / name, seed=i, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
            adapters[name] = LoRARequest(name, i + 1, str(root / name))
        llm = LLM(str(folder), dtype="float32", max_num_batched_tokens=64, kv_cache_memory_bytes=8 * 2**20,
                  enable_lora=True, max_loras=1, max_cpu_loras=3, max_lora_rank=8)
        yield llm, adapters, folder, root


PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16], [5, 6, 7, 8, 9]]


def _params() -> Any:
    from vlite import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def _idle(llm: Any) -> None:
    m = llm.get_metrics()
    assert m["num_free_kv_blocks"] == m["num_kv_blocks"] and not llm.llm_engine.has_unfinished_requests()


def test_generate_with_adapters_per_prompt(setup):
    llm, adapters, _, _ = setup
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    loras = [adapters["a"], None, adapters["b"], adapters["a"]]
    outs = llm.generate(prompts, _params(), use_tqdm=False, lora_request=loras)
    assert [len(o.outputs[0].token_ids) for o in outs] == [4] * 4
    assert llm.llm_engine.list_loras() == {1, 2}
    one = llm.generate(prompts[:2], _params(), use_tqdm=False, lora_request=adapters["a"])  # one for all
    assert one[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="lora_request has 3 entries for 4 prompts"):
        llm.generate(prompts, _params(), use_tqdm=False, lora_request=loras[:3])
    with pytest.raises(ValueError, match="must be a LoRARequest"):
        llm.generate(prompts[:1], _params(), use_tqdm=False, lora_request=["a"])
    _idle(llm)


def test_chat_takes_an_adapter(setup):
    llm, adapters, _, _ = setup
    if llm.get_tokenizer().chat_template is None:
        pytest.skip("the tiny tokenizer has no chat template")
    out = llm.chat([{"role": "user", "content": "hi"}], _params(), use_tqdm=False, lora_request=adapters["b"])
    assert len(out[0].outputs[0].token_ids) == 4


def test_adapter_api(setup):
    llm, adapters, _, root = setup
    engine = llm.llm_engine
    c = LoRARequest("c", 3, adapters["a"].lora_path)
    assert engine.add_lora(c) is True and engine.add_lora(c) is False
    assert 3 in engine.list_loras() and 3 in llm.list_loras()
    assert engine.pin_lora(3) is True
    assert engine.remove_lora(3) is True and 3 not in engine.list_loras()
    assert llm.remove_lora(3) is False
    with pytest.raises(ValueError, match="lora_int_id 1 is adapter 'a'"):
        engine.add_lora(LoRARequest("other", 1, str(root / "b")))
    with pytest.raises(ValueError, match="'a' is loaded with lora_int_id 1, not 9"):
        engine.add_lora(LoRARequest("a", 9, adapters["a"].lora_path))


def test_bad_adapter_refused_before_any_request_starts(setup):
    llm, adapters, _, root = setup
    engine = llm.llm_engine
    bad = LoRARequest("bad", 7, str(root / "missing"))
    with pytest.raises(ValueError, match="missing"):
        llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], _params(), use_tqdm=False,
                     lora_request=[adapters["a"], bad])
    with pytest.raises(ValueError, match="missing"):
        engine.add_request("x", {"prompt_token_ids": PROMPTS[0]}, _params(), lora_request=bad)
    assert "x" not in engine.output_processor.request_states and not engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="missing"):
        engine.add_lora(bad)
    assert 7 not in engine.list_loras()
    out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], _params(), use_tqdm=False, lora_request=adapters["b"])
    assert len(out[0].outputs[0].token_ids) == 4  # the engine serves on
    _idle(llm)


def test_busy_adapter_is_unloaded_after_its_requests(setup):
    """Removed while a request runs under it: the request finishes under it (same tokens as alone), then the
    adapter is unloaded; named again by a request, it is loaded again."""
    llm, adapters, _, _ = setup
    engine = llm.llm_engine
    alone = llm.generate([{"prompt_token_ids": PROMPTS[0]}], _params(), use_tqdm=False, lora_request=adapters["a"])
    engine.add_request("busy", {"prompt_token_ids": PROMPTS[0]}, _params(), lora_request=adapters["a"])
    engine.step()
    assert engine.remove_lora(1) is True
    assert 1 in engine.list_loras()  # still serving its request
    with pytest.raises(ValueError, match="still used by the requests"):  # its id is not given to another adapter
        engine.add_lora(LoRARequest("other", 1, adapters["b"].lora_path))
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert finished[0].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert 1 not in engine.list_loras() and engine.remove_lora(1) is False
    out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], _params(), use_tqdm=False, lora_request=adapters["a"])
    assert len(out[0].outputs[0].token_ids) == 4 and 1 in engine.list_loras()
    _idle(llm)


def test_max_loras_one_runs_adapters_in_turn(setup):
    llm, adapters, _, _ = setup
    engine = llm.llm_engine
    for i, lora in enumerate((adapters["a"], adapters["b"], None, adapters["a"])):
        engine.add_request(f"t{i}", {"prompt_token_ids": PROMPTS[i]}, _params(), lora_request=lora)
    sched = engine.engine_core.scheduler
    while engine.has_unfinished_requests():
        engine.step()
        assert len({r.lora_request.lora_int_id for r in sched.running if r.lora_request is not None}) <= 1
    stats = engine.engine_core.make_stats()
    assert stats.max_lora == 1 and stats.running_lora_adapters == {} and stats.waiting_lora_adapters == {}
    _idle(llm)


def test_lora_off_refuses_adapters(setup):
    _, adapters, folder, _ = setup
    from vlite import LLM
    from vlite.engine.arg_utils import EngineArgs

    llm = LLM(str(folder), dtype="float32", max_num_batched_tokens=64, kv_cache_memory_bytes=4 * 2**20)
    with pytest.raises(ValueError, match=r"lora_request 'a' given.*--enable-lora"):
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], _params(), use_tqdm=False, lora_request=adapters["a"])
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        llm.llm_engine.add_lora(adapters["a"])
    assert llm.llm_engine.list_loras() == set()
    with pytest.raises(ValueError, match="text generation only"):
        EngineArgs(model=str(folder), runner="pooling", enable_lora=True, dtype="float32",
                   kv_cache_memory_bytes=4 * 2**20).create_engine_config()


def test_worker_processes_refuse_a_bad_adapter_and_serve_on(setup):
    """TP=2 (mp executor): the adapter is refused on every rank as LoRAAdapterError, the workers stay up."""
    _, adapters, folder, root = setup
    from vlite import LLM
    from vlite.lora.peft_adapter import LoRAAdapterError

    llm = LLM(str(folder), dtype="float32", max_num_batched_tokens=64, kv_cache_memory_bytes=4 * 2**20,
              enable_lora=True, max_loras=2, max_lora_rank=8, tensor_parallel_size=2)
    try:
        engine = llm.llm_engine
        with pytest.raises(LoRAAdapterError, match="missing"):
            engine.add_lora(LoRARequest("bad", 7, str(root / "missing")))
        assert engine.add_lora(adapters["a"]) is True and engine.list_loras() == {1}
        out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], _params(), use_tqdm=False, lora_request=adapters["b"])
        assert len(out[0].outputs[0].token_ids) == 4 and engine.list_loras() == {1, 2}
    finally:
        llm.llm_engine.engine_core.shutdown()
