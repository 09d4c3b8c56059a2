"""Gemma 3 (text): five sliding-window layers to one global, the sliding ones with their own rope base
and the global ones with linear rope scaling, per-head q/k RMSNorm, (1 + weight) norms before and
after attention and MLP, GELU-tanh, embeddings scaled by sqrt(hidden), head_dim wider than
hidden / heads, tied head; from a Hugging Face folder and from a GGUF file laid out as llama.cpp's
converter writes one; float32 greedy output token-identical to transformers on prompts longer than
the window, chunked prefill mixed with decodes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.models import tiny
from vlite.model_loader import load_model_weights, resolve_model
from vlite.model_loader.gguf_reader import GGUFReader

WINDOW = 24  # the prompts run to 290 tokens, prefilled in chunks of 32


@pytest.fixture(scope="module")
def hf_model() -> Any:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    # 6 layers: llama.cpp's fixed 5:1 pattern (layer 5 global), which a GGUF file does not spell out.
    # query_pre_attn_scalar = head_dim: what llama.cpp assumes for every Gemma 3 but the 27B.
    return tiny.build(Gemma3TextConfig, Gemma3ForCausalLM, seed=7, num_hidden_layers=6, head_dim=32,
                      query_pre_attn_scalar=32, sliding_window=WINDOW, hidden_activation="gelu_pytorch_tanh",
                      rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                                       "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})


def test_config_from_hf_folder(folder: Path) -> None:
    cfg, weights = load_model_weights(resolve_model(str(folder)), torch.float32)
    assert cfg.architecture == "gemma3" and cfg.qk_norm and cfg.head_dim == 32 and cfg.tie_word_embeddings
    assert cfg.layer_windows == (WINDOW,) * 5 + (0,) and cfg.kv_sliding_window is None
    assert (cfg.rope_theta, cfg.rope_scaling, cfg.rope_local_theta) == (1e6, {"rope_type": "linear", "factor": 2.0},
                                                                        1e4)
    assert cfg.norm_unit_offset and cfg.sandwich_norms and cfg.scale_embeddings
    assert cfg.hidden_act == "gelu_pytorch_tanh"
    assert weights["model.layers.5.post_feedforward_layernorm.weight"].shape == (64,)


def test_hf_folder_matches_transformers(folder: Path, prompt_ids: list[list[int]], refs: list[Any]) -> None:
    llm, completions = tiny.run_vlite(folder, prompt_ids)
    assert tiny.model_class_name(llm) == "Gemma3ForCausalLM"
    # the global layer reads every block: the cache frees none behind the window
    assert llm.llm_engine.engine_core.kv_cache_manager.sliding_window is None
    print(tiny.assert_parity(completions, refs))


def test_gguf_matches_transformers(hf_model: Any, tokenizer: Any, model_dir: Path, prompt_ids: list[list[int]],
                                   refs: list[Any]) -> None:
    path = tiny.write_gguf(hf_model, tokenizer, model_dir / "gemma3-f16.gguf", "gemma3", f16=True)
    cfg, weights = load_model_weights(resolve_model(str(path)), torch.float32)
    assert cfg.layer_windows == (WINDOW,) * 5 + (0,) and cfg.query_pre_attn_scalar == 32
    assert (cfg.rope_local_theta, cfg.rope_scaling) == (1e4, {"rope_type": "linear", "factor": 2.0})
    # the norms come back to the checkpoint's meaning (llama.cpp stored them with the 1 added)
    state = hf_model.state_dict()
    for name in ("model.layers.0.pre_feedforward_layernorm.weight", "model.layers.2.self_attn.k_norm.weight",
                 "model.norm.weight"):
        torch.testing.assert_close(weights[name], state[name], rtol=0, atol=1e-7)
    llm, completions = tiny.run_vlite(path, prompt_ids)
    assert tiny.model_class_name(llm) == "Gemma3ForCausalLM"
    print(tiny.assert_parity(completions, refs))


def _gguf_header(path: Path, n_layers: int, sliding_window: int | None, pattern: Any = None) -> Path:
    """A Gemma 3 GGUF header (no tensors): what the config is read from."""
    import gguf

    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_vocab_size(32)
    w.add_embedding_length(5376)
    w.add_feed_forward_length(64)
    w.add_block_count(n_layers)
    w.add_head_count(32)
    w.add_head_count_kv(16)
    w.add_key_length(128)
    if sliding_window is not None:
        w.add_sliding_window(sliding_window)
    if pattern is not None:
        w.add_sliding_window_pattern(pattern)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_layer_pattern_and_query_scale(tmp_path: Path) -> None:
    """llama.cpp's facts for Gemma 3 files: five sliding layers to one global unless the file lists
    them, local rope base 10000, queries scaled by head_dim ** -0.5 but by (hidden / heads) ** -0.5
    for the 27B (62 layers); no window key, no sliding layers."""
    import gguf

    from vlite.model_arch import ModelArchConfig
    from vlite.model_loader.gguf_config import arch_from_gguf_metadata

    def config(path: Path) -> ModelArchConfig:
        return arch_from_gguf_metadata(GGUFReader(str(path)))

    default = config(_gguf_header(tmp_path / "a.gguf", 7, 512))
    assert default.layer_windows == (512,) * 5 + (0, 512) and default.query_pre_attn_scalar == 128
    assert default.rope_local_theta == 1e4 and default.head_dim == 128
    listed = config(_gguf_header(tmp_path / "b.gguf", 3, 64, [True, False, False]))
    assert listed.layer_windows == (64, 0, 0)
    assert config(_gguf_header(tmp_path / "c.gguf", 2, None)).layer_windows == ()
    big = config(_gguf_header(tmp_path / "d.gguf", 62, 1024))
    assert big.query_pre_attn_scalar == 5376 / 32 and big.layer_windows[5] == 0 and big.layer_windows[6] == 1024


def test_gguf_end_of_turn_and_chat_template(tmp_path: Path) -> None:
    """A Gemma 3 file that names only <eos> (llama.cpp's converter writes no end-of-turn id): <end_of_turn>
    is found by its text and stops generation too; a file without a chat template gets Gemma 3's, one
    with its own keeps it; an end-of-turn id the file names is taken as is."""
    import gguf

    from vlite.model_loader.chat_templates import GEMMA3_CHAT_TEMPLATE
    from vlite.model_loader.gguf_config import arch_from_gguf_metadata
    from vlite.model_loader.tokenizer import _gguf_chat_template

    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<end_of_turnx>", "<start_of_turn>", "<end_of_turn>", "a"]

    def header(name: str, **kv: Any) -> Path:
        path = tmp_path / name
        w = gguf.GGUFWriter(str(path), "gemma3")
        for key, value in (("block_count", 1), ("embedding_length", 64), ("feed_forward_length", 64),
                           ("head_count", 2), ("vocab_size", len(tokens))):
            getattr(w, f"add_{key}")(value)
        w.add_token_list(tokens)
        w.add_eos_token_id(1)
        if "eot" in kv:
            w.add_eot_token_id(kv["eot"])
        if "template" in kv:
            w.add_chat_template(kv["template"])
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return path

    def eos(path: Path) -> tuple[int, ...]:
        return arch_from_gguf_metadata(GGUFReader(str(path))).eos_token_ids

    def template(path: Path) -> str | None:
        return _gguf_chat_template(GGUFReader(str(path)).fields)

    plain = header("plain.gguf")
    assert eos(plain) == (1, 6) and template(plain) == GEMMA3_CHAT_TEMPLATE
    named = header("named.gguf", eot=5, template="{{ messages[0]['content'] }}")
    assert eos(named) == (1, 5) and template(named) == "{{ messages[0]['content'] }}"


@pytest.mark.parametrize("cache", ["off", "on"])
def test_gguf_tokenizer_is_autotokenizers(hf_model: Any, tokenizer: Any, tmp_path: Path, monkeypatch: Any,
                                          cache: str) -> None:
    """The tokenizer vlite builds from a Gemma 3 file is the one AutoTokenizer builds, the Gemma class's own
    default special tokens (<mask>) included, at the first start and from the cache."""
    from transformers import AutoTokenizer

    from tests.model_loader.test_cache import same_tokenizer
    from vlite.model_loader import load_tokenizer

    path = tiny.write_gguf(hf_model, tokenizer, tmp_path / "gemma3.gguf", "gemma3", f16=True)
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    monkeypatch.setenv("VLITE_CACHE_DIR", "off" if cache == "off" else str(tmp_path / "cache"))
    for _ in range(2 if cache == "on" else 1):  # written, then read back
        tok = load_tokenizer(resolve_model(str(path)))
        same_tokenizer(tok, ref)
        assert tok.special_tokens_map["mask_token"] == "<mask>"


def test_sliding_groups_free_their_blocks(folder: Path, prompt_ids: list[list[int]], refs: list[Any]) -> None:
    """KV cache groups: the global layer in one, each sliding layer in its own (as many layers a group as the
    global kind has), all on one pool. A 290-token prompt then holds 19 blocks in the global group but about
    (window + chunk) / block_size in each sliding one: 60 blocks serve it where keeping every block would
    take 6 x 20. Same tokens as transformers."""
    from vlite import LLM, SamplingParams

    page = 2 * 16 * 2 * 32 * 4  # K and V of one layer's block: 16 tokens x 2 KV heads x 32 dims, float32
    llm = LLM(model=str(folder), dtype="float32", max_num_batched_tokens=tiny.STEP_TOKENS, block_size=16,
              kv_cache_memory_bytes=60 * page, max_num_seqs=1, max_model_len=320)
    kv = llm.llm_engine.engine_core.kv_cache_manager
    assert kv.num_blocks == 60 and [g.window for g in kv.groups] == [0] + [WINDOW] * 5
    params = SamplingParams(temperature=0.0, max_tokens=tiny.MAX_NEW, ignore_eos=True, logprobs=5)
    long = max(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]))
    out = llm.generate([{"prompt_token_ids": prompt_ids[long]}], params, use_tqdm=False)[0]
    print(tiny.assert_parity([out.outputs[0]], [refs[long]]))
    assert kv.get_num_free_blocks() == 60 and llm.llm_engine.engine_core.scheduler.num_preemptions == 0
