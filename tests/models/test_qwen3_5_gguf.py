"""Qwen3.5 (dense, MoE) and Qwen3-Next from GGUF files as llama.cpp's own converter writes them (qwen35, qwen35moe,
qwen3next; vlite/model_loader/gguf_hybrid.py): every tensor back in the Hugging Face folder's names, order and
values, float32 greedy output token-identical to transformers from F16 files, quantized files (llama-quantize's
Q8_0 and Q4_K_M) loaded packed and generating; files whose layer pattern or DeltaNet shapes disagree with their
metadata refused from the header, naming the tensor and the key.

Needs llama.cpp's source tree (and for the quantized files its build) from ../shared/anchors/llamacpp.sh; skips
where they are missing."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.models import tiny
from tests.models.test_qwen3_5 import _build
from vlite.layers.gated_deltanet import GatedDeltaNet
from vlite.layers.packed import PackedTensors
from vlite.model_loader import load_model_weights, resolve_model
from vlite.model_loader.gguf_loader import gguf_arch
from vlite.model_loader.gguf_reader import GGUFReader
from vlite.models.qwen3_next import ungroup_projections

pytestmark = pytest.mark.skipif(tiny.llama_cpp_dir() is None, reason="needs llama.cpp's source tree "
                                "(../shared/anchors/llamacpp.sh build, or LLAMACPP_DIR)")


@pytest.fixture(scope="module", params=["qwen35", "qwen35moe", "qwen3next"])
def hf_model(request: pytest.FixtureRequest) -> Any:
    return _build(request.param, gguf=True)


@pytest.fixture(scope="module")
def folder(hf_model: Any, tokenizer: Any, model_dir: Path) -> Path:
    """The model's folder; Qwen3.5's with a multi-token-prediction block (mtp.*), as the released ones have."""
    path = tiny.save_hf(hf_model, tokenizer, model_dir / f"hf-{hf_model.config.model_type}")
    return _with_mtp_block(path) if hf_model.config.model_type == "qwen3_5_text" else path


@pytest.fixture(scope="module")
def f16_file(folder: Path, model_dir: Path) -> Path:
    """llama.cpp's F16 file; an MTP block, where there is one, kept (after the model's: nextn_predict_layers)."""
    mtp = "mtp_num_hidden_layers" in json.loads((folder / "config.json").read_text())
    return tiny.llama_cpp_convert(folder, model_dir / f"{folder.name}-f16.gguf", "f16", *(() if mtp else ("--no-mtp",)))


@pytest.fixture(scope="module")
def prompts(prompt_ids: list[list[int]]) -> list[list[int]]:
    """Three of the suite's prompts (4 to 63 tokens: chunked prefills beside decodes); the Hugging Face tests
    run the rest."""
    return prompt_ids[1:4]


@pytest.fixture(scope="module")
def refs(hf_model: Any, prompts: list[list[int]]) -> list[Any]:
    return tiny.references(hf_model, prompts)


def _hf_weights(folder: Path) -> tuple[Any, dict[str, torch.Tensor]]:
    """The folder's config and weights, Qwen3-Next's grouped DeltaNet projections in Qwen3.5's four (as its GGUF
    file gives them)."""
    cfg, weights = load_model_weights(resolve_model(str(folder)), torch.float32)
    if cfg.linear_grouped_projections:
        weights = ungroup_projections(cfg, weights)
        cfg = dataclasses.replace(cfg, linear_grouped_projections=False)
    return cfg, weights


def _with_mtp_block(folder: Path) -> Path:
    """The folder with a multi-token-prediction block as Qwen3.5's checkpoints hold one (mtp.fc, its norms, a
    full-attention decoder layer: a copy of the model's last), which the Hugging Face loader skips."""
    from safetensors.torch import load_file, save_file

    weights = load_file(folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    last, hidden = f"model.layers.{config['num_hidden_layers'] - 1}.", config["hidden_size"]
    weights.update({"mtp.layers.0." + n[len(last):]: w.clone() for n, w in weights.items() if n.startswith(last)})
    weights["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden, generator=torch.Generator().manual_seed(0)).half() / 8
    weights.update({f"mtp.{n}.weight": torch.ones(hidden) for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden",
                                                                      "norm")})
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 1}, indent=2))
    return folder


def _dense(w: Any) -> torch.Tensor:
    return w.dequantize(torch.float32) if isinstance(w, PackedTensors) else w.float()


def test_f16_file_is_the_hf_folder(hf_model: Any, folder: Path, f16_file: Path) -> None:
    """The same config, and every tensor equal to the folder's of that name (F16 holds tiny.build's weights exactly;
    A_log comes back from llama.cpp's -exp(A_log) to within float32 rounding)."""
    hf_cfg, hf = _hf_weights(folder)
    cfg, weights = load_model_weights(resolve_model(str(f16_file)), torch.float32)
    assert cfg.architecture == hf_cfg.architecture and cfg.source_quantization == "F16"
    differ = {f.name for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != getattr(hf_cfg, f.name)}
    # GGUF stores the epsilon in float32, and only the config's EOS id (not generation_config.json's)
    assert differ <= {"source_quantization", "rms_norm_eps", "eos_token_ids"}, differ
    assert cfg.rms_norm_eps == pytest.approx(hf_cfg.rms_norm_eps) and cfg.linear_layers == (0, 1, 2)
    if cfg.architecture == "qwen35":  # the MTP block: llama.cpp's block 4 (blk.4.nextn.eh_proj, ...), skipped
        reader = GGUFReader(str(f16_file))
        assert reader.fields["qwen35.block_count"].contents() == 5
        assert "blk.4.nextn.eh_proj.weight" in {t.name for t in reader.tensors}
    assert weights.keys() == hf.keys()
    for name, w in weights.items():
        assert w.shape == hf[name].shape and w.dtype == torch.float32, name
        if name.endswith(".A_log"):
            torch.testing.assert_close(w, hf[name], rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(w, hf[name]), name


def test_f16_file_matches_transformers(f16_file: Path, prompts: list[list[int]], refs: list[Any]) -> None:
    llm, completions = tiny.run_vlite(f16_file, prompts)
    model = llm.llm_engine.engine_core.model_runner.model
    assert [type(layer.linear_attn) for layer in model.layers[:3]] == [GatedDeltaNet] * 3
    print(tiny.assert_parity(completions, refs))


def _assert_quantized(path: Path, folder: Path, prompts: list[list[int]], max_error: float) -> Any:
    """A quantized file loads with its projections packed, each (dequantized) within `max_error` (relative) of the
    folder's weight of that name (a row or column out of place would be ~1.4), and generates."""
    _, hf = _hf_weights(folder)
    cfg, weights = load_model_weights(resolve_model(str(path)), torch.float32)
    assert cfg.source_quantization is not None and weights.keys() == hf.keys()
    packed = [n for n, w in weights.items() if isinstance(w, PackedTensors)]
    assert any(".linear_attn.in_proj_qkv." in n for n in packed) and any(".self_attn.q_proj." in n for n in packed)
    for name, w in weights.items():
        err = float((_dense(w) - hf[name]).norm() / hf[name].norm())
        assert err < max_error, (name, type(w), err)
    llm, completions = tiny.run_vlite(path, prompts)
    assert all(len(c.token_ids) == tiny.MAX_NEW for c in completions)
    return cfg, weights


def test_q8_0_file_loads_and_generates(folder: Path, f16_file: Path, model_dir: Path,
                                       prompts: list[list[int]]) -> None:
    """llama-quantize's Q8_0. The value heads (16 wide) are narrower than a block: Qwen3.5's out_proj, whose input
    columns move with its heads, is dequantized; every row reorder stays packed."""
    path = tiny.llama_cpp_quantize(f16_file, model_dir / f"{folder.name}-q8_0.gguf", "Q8_0")
    if path is None:
        pytest.skip("needs llama.cpp's llama-quantize (../shared/anchors/llamacpp.sh build)")
    cfg, weights = _assert_quantized(path, folder, prompts[1:2], 0.02)
    tiled = cfg.architecture != "qwen3next"  # qwen3next files keep Hugging Face's head order
    assert isinstance(weights["model.layers.0.linear_attn.out_proj.weight"], PackedTensors) != tiled


def test_q4_k_m_file_loads_and_generates(tokenizer: Any, model_dir: Path, prompt_ids: list[list[int]]) -> None:
    """A Qwen3.5 wide enough for K-quants (hidden 256, value heads 64 wide) as llama-quantize's Q4_K_M: out_proj's
    columns move in whole 32-input blocks (its K-quant blocks of 256 converted, the values kept)."""
    import transformers as t

    model = tiny.build(t.Qwen3_5TextConfig, t.Qwen3_5ForCausalLM, seed=24, hidden_size=256, intermediate_size=256,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_hidden_layers=4,
                       linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                       linear_value_head_dim=64, linear_conv_kernel_dim=4, initializer_range=0.04)
    folder = tiny.save_hf(model, tokenizer, model_dir / "hf-qwen35-wide")
    f16 = tiny.llama_cpp_convert(folder, model_dir / "qwen35-wide-f16.gguf", "f16", "--no-mtp")
    path = tiny.llama_cpp_quantize(f16, model_dir / "qwen35-wide-q4_k_m.gguf", "Q4_K_M")
    if path is None:
        pytest.skip("needs llama.cpp's llama-quantize (../shared/anchors/llamacpp.sh build)")
    cfg, weights = _assert_quantized(path, folder, prompt_ids[2:3], 0.15)
    assert cfg.source_quantization == "mixed"
    out_proj = weights["model.layers.0.linear_attn.out_proj.weight"]
    assert isinstance(out_proj, PackedTensors) and out_proj.fmt in ("q4", "q8")  # a K-quant in 32-input blocks
    assert weights["model.layers.0.linear_attn.in_proj_qkv.weight"].fmt in ("q4_k", "q5_k", "q6_k")


# Bad files: the converted F16 file with its metadata edited. (edit, what the error names)
_BAD = {
    "pattern_flags": ({"attention.recurrent_layers": [True, True, False, False]},
                      r"tensor blk\.2\.ssm_\w+ is a Gated DeltaNet .* but {arch}\.attention\.recurrent_layers makes "
                      r"layer 2 a full-attention layer"),
    "pattern_all_linear": ({"attention.recurrent_layers": [True, True, True, True]},
                           r"tensor blk\.3\.attn_\w+\.weight is full attention's, but {arch}\.attention\.recurrent_"
                           r"layers makes layer 3 a Gated DeltaNet"),
    "pattern_interval": ({"attention.recurrent_layers": None, "full_attention_interval": 2},
                         r"blk\.1\.ssm_\w+ .* but {arch}\.full_attention_interval \(2\) makes layer 1 a full-"),
    "conv_kernel": ({"ssm.conv_kernel": 3},
                    r"tensor blk\.0\.ssm_conv1d\.weight has shape \[128, 4\], the metadata \({arch}\.ssm\.conv_kernel=3"
                    r".*\) needs \[128, 3\]"),
    "key_heads": ({"ssm.group_count": 1}, r"tensor blk\.0\.[\w.]+ has shape .*ssm\.group_count=1"),
    "value_heads": ({"ssm.time_step_rank": 8}, r"tensor blk\.0\.[\w.]+ has shape .*ssm\.time_step_rank=8"),
    "inner_size": ({"ssm.inner_size": 63}, r"{arch}\.ssm\.inner_size \(63\) must be {arch}\.ssm\.time_step_rank"),
    "missing_key": ({"ssm.state_size": None}, r"GGUF metadata key {arch}\.ssm\.state_size is missing"),
}


@pytest.mark.parametrize("case", list(_BAD))
def test_header_disagreeing_with_tensors_is_refused(f16_file: Path, model_dir: Path, case: str) -> None:
    """Refused from the header (gguf_arch reads no tensor data), naming the tensor and the key."""
    import gguf

    edits, pattern = _BAD[case]
    arch = gguf.GGUFReader(str(f16_file)).fields["general.architecture"].contents()
    path = _edited(f16_file, model_dir / f"{arch}-{case}.gguf", {f"{arch}.{k}": v for k, v in edits.items()})
    with pytest.raises(ValueError, match=pattern.format(arch=arch)):
        gguf_arch(path)
    with pytest.raises(ValueError, match=pattern.format(arch=arch)):
        load_model_weights(resolve_model(str(path)), torch.float32)


def test_older_qwen3next_files_with_ssm_in(folder: Path, f16_file: Path, model_dir: Path) -> None:
    """Qwen3-Next files from before the converter split in_proj_qkvz hold it as is, as ssm_in (llama.cpp still reads
    them): the same weights come out."""
    from safetensors.torch import load_file

    cfg, weights = load_model_weights(resolve_model(str(f16_file)), torch.float32)
    if cfg.architecture != "qwen3next":
        pytest.skip("ssm_in: qwen3next files only")
    hf = load_file(folder / "model.safetensors")
    tensors: dict[str, Any] = {f"blk.{i}.{n}.weight": None for i in cfg.linear_layers for n in ("attn_qkv", "attn_gate")}
    tensors.update({f"blk.{i}.ssm_in.weight": hf[f"model.layers.{i}.linear_attn.in_proj_qkvz.weight"].half().numpy()
                    for i in cfg.linear_layers})
    path = _edited(f16_file, model_dir / "qwen3next-ssm-in.gguf", {}, tensors)
    _, legacy = load_model_weights(resolve_model(str(path)), torch.float32)
    assert legacy.keys() == weights.keys() and all(torch.equal(legacy[n], w) for n, w in weights.items())


def _edited(src: Path, out: Path, edits: dict[str, Any], tensors: dict[str, Any] | None = None) -> Path:
    """A copy of a GGUF file with metadata keys replaced (None: removed; a list: of bools) and tensors replaced or
    added (`tensors`: name -> array, None: removed)."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    writer = gguf.GGUFWriter(str(out), reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in edits:
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub)
    for name, value in edits.items():
        if isinstance(value, list):
            writer.add_key_value(name, value, gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.BOOL)
        elif value is not None:
            writer.add_uint32(name, value)
    tensors = dict(tensors or {})
    for t in reader.tensors:
        if t.name not in tensors:
            writer.add_tensor(t.name, np.asarray(t.data), raw_shape=[int(d) for d in reversed(t.shape.tolist())],
                              raw_dtype=t.tensor_type)
    for name, array in tensors.items():
        if array is not None:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
