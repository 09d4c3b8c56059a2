"""A Qwen3.5 at the published shape of Qwen3.5-2B with random weights, as a Hugging Face folder, then as the GGUF
files people download: llama.cpp's converter (F16) and llama-quantize (Q4_K_M). The text it writes is noise; what a
model of that shape costs to load and run is what it is for (vlite and llama.cpp on the same file).

    python benchmarks/qwen35_shape.py OUT_DIR [--shape 2b|tiny] [--keep-hf]

prints the F16 and Q4_K_M paths. Needs llama.cpp's source tree and build (../shared/anchors/llamacpp.sh build).

The shape (Qwen/Qwen3.5-2B's config.json, text_config): hidden 2048, 24 layers (three Gated DeltaNet layers to each
full-attention one), 8 query heads over 2 KV heads of 256 (output-gated, a quarter of each head rotated, rope base
1e7), DeltaNet 16 key and 16 value heads of 128, conv kernel 4, MLP 6144, vocabulary 248,320, tied embeddings: about
1.9B parameters. Source: third-party code mirroring that config.json (hidden, layers, heads, MLP and vocabulary in two
independent copies; the DeltaNet heads in one, the same 16 x 128 as Qwen3.5-0.8B's and -4B's configs). The tokenizer
is the test suite's tiny BPE (tests/models/tiny.py), the vocabulary padded to 248,320 by the converter.

Weights are drawn in bfloat16, one safetensors shard at a time (peak memory about one shard, not the model):
matrices and embeddings N(0, 0.02) (initializer_range), RMSNorm weights 0 (they scale by 1 + weight) but the
DeltaNet's gated norm 1, A_log = log(U(1, 16)), dt_bias 1: activations stay finite. Measured on this 2-core machine:
see the end of the module's output (each step's seconds).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SHAPES = {
    "2b": dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
               intermediate_size=6144, vocab_size=248320, linear_num_key_heads=16, linear_num_value_heads=16,
               linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4),
    # a quick check of the script itself
    "tiny": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                 intermediate_size=512, vocab_size=1024, linear_num_key_heads=2, linear_num_value_heads=4,
                 linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4),
}
SHARD_BYTES = 1 << 30


def config(shape: str) -> object:
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        **SHAPES[shape], max_position_embeddings=262144, rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        initializer_range=0.02, eos_token_id=2, bos_token_id=None, architectures=["Qwen3_5ForCausalLM"])


def draw(name: str, shape: torch.Size, gen: torch.Generator) -> torch.Tensor:
    """One random weight (module docstring), bfloat16."""
    if name.endswith("linear_attn.norm.weight") or name.endswith("dt_bias"):
        return torch.ones(shape, dtype=torch.bfloat16)
    if name.endswith("norm.weight"):
        return torch.zeros(shape, dtype=torch.bfloat16)
    if name.endswith("A_log"):
        return torch.empty(shape).uniform_(1, 16, generator=gen).log().bfloat16()
    return (torch.randn(shape, generator=gen) * 0.02).bfloat16()


def write_folder(folder: Path, shape: str) -> None:
    """config.json, tokenizer files and the random weights in shards of ~1 GiB (model.safetensors.index.json)."""
    from safetensors.torch import save_file
    from transformers import Qwen3_5ForCausalLM

    from tests.models import tiny

    cfg = config(shape)
    folder.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(folder)
    tiny.tiny_tokenizer().save_pretrained(folder)
    with torch.device("meta"):
        shapes = {n: t.shape for n, t in Qwen3_5ForCausalLM(cfg).state_dict().items() if n != "lm_head.weight"}
    gen = torch.Generator().manual_seed(0)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    names = list(shapes)
    index: dict[str, str] = {}
    for name in names:
        if size >= SHARD_BYTES:
            _save(folder, shards[-1], len(shards), index, save_file)
            shards.append({})
            size = 0
        t = draw(name, shapes[name], gen)
        shards[-1][name] = t
        size += t.numel() * 2
    _save(folder, shards[-1], len(shards), index, save_file)
    total = sum(math.prod(s) for s in shapes.values())
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total * 2}, "weight_map": index}, indent=1))
    print(f"{folder}: {total / 1e9:.2f}B parameters in {len(shards)} shards", flush=True)


def _save(folder: Path, shard: dict, i: int, index: dict, save_file: Any) -> None:
    name = f"model-{i:05d}.safetensors"
    save_file(shard, str(folder / name), metadata={"format": "pt"})
    index.update({n: name for n in shard})
    shard.clear()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="2b")
    parser.add_argument("--keep-hf", action="store_true", help="keep the Hugging Face folder")
    args = parser.parse_args()

    from tests.models import tiny

    if tiny.llama_cpp_dir() is None:
        sys.exit("needs llama.cpp's source tree and build: bash ../shared/anchors/llamacpp.sh build")
    out, steps = args.out_dir, []
    folder = out / f"qwen35-{args.shape}-hf"
    t0 = time.time()
    write_folder(folder, args.shape)
    steps.append(("random weights", time.time() - t0))
    f16 = out / f"qwen35-{args.shape}-f16.gguf"
    t0 = time.time()
    tiny.llama_cpp_convert(folder, f16, "f16", "--no-mtp")
    steps.append(("convert F16", time.time() - t0))
    if not args.keep_hf:
        shutil.rmtree(folder)
    q4 = out / f"qwen35-{args.shape}-q4_k_m.gguf"
    t0 = time.time()
    if tiny.llama_cpp_quantize(f16, q4, "Q4_K_M") is None:
        sys.exit("needs llama.cpp's llama-quantize: bash ../shared/anchors/llamacpp.sh build")
    steps.append(("quantize Q4_K_M", time.time() - t0))
    for what, s in steps:
        print(f"{what}: {s:.0f} s")
    print(f"F16: {f16} ({f16.stat().st_size / 2**30:.2f} GiB)")
    print(f"Q4_K_M: {q4} ({q4.stat().st_size / 2**30:.2f} GiB)")


if __name__ == "__main__":
    main()
