"""A Gemma 4 at the published shape of Gemma 4 E2B (text model) with random weights, written directly as the GGUF file
llama.cpp's converter lays out (F16), then quantized by llama-quantize (Q4_K_M): the file people download, for
vlite and llama.cpp to decode on. Its text is noise; its cost is the model's.

    python benchmarks/gemma4_shape.py OUT_DIR [--shape e2b|tiny]

prints the F16 and Q4_K_M paths. Needs llama.cpp's build (../shared/anchors/llamacpp.sh build).

The shape (google/gemma-4-E2B's text_config, as third-party code mirrors it in several independent copies):
hidden 1536, 35 layers (every fifth a full-attention layer: 4, 9, ..., 34), 8 query heads over 1 KV head of 256
on sliding layers (window 512) and of 512 on full ones (a quarter of each half rotated, base 1e6), the last 20
layers KV-shared with twice as wide MLPs (12288, else 6144), per-layer inputs of 256 per layer over the whole
vocabulary of 262,144, tied embeddings, final logits soft-capped at 30: about 5.1B parameters, 2.3B of them the
per-layer input table. The tokenizer is the test suite's tiny BPE (tests/models/tiny.py) padded with unused
control tokens to 262,144.

Matrices are N(0, 0.02), norm weights and layer scales 1 (Gemma 4's norms scale by the weight itself). To keep memory
and time small, every matrix reads a window of one random pool of 2^26 values at its own offset (its rows are no
copies of each other's); the quantizer and both engines do the work a real file costs them.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SHAPES = {
    "e2b": dict(hidden=1536, layers=35, heads=8, kv_heads=1, head_dim=256, global_head_dim=512, ff=6144,
                vocab=262144, ple=256, shared=20, window=512, full_every=5),
    "tiny": dict(hidden=256, layers=10, heads=4, kv_heads=1, head_dim=64, global_head_dim=128, ff=512,
                 vocab=1024, ple=32, shared=5, window=64, full_every=5),  # a quick check of the script itself
}
POOL = 1 << 26


class PoolMatrix:
    """A float16 [rows, cols] matrix read from the random pool from `offset` on, wrapping around: what GGUFWriter
    writes (shape, dtype, nbytes, tofile) without holding the matrix."""

    def __init__(self, pool: np.ndarray, rows: int, cols: int, offset: int) -> None:
        self.pool, self.shape, self.offset = pool, (rows, cols), offset % len(pool)
        self.dtype = np.dtype(np.float16)
        self.nbytes = rows * cols * 2

    def tofile(self, f: BinaryIO) -> None:
        left, at = self.shape[0] * self.shape[1], self.offset
        while left:
            n = min(left, len(self.pool) - at)
            self.pool[at:at + n].tofile(f)
            left, at = left - n, (at + n) % len(self.pool)


def write_f16(path: Path, s: dict[str, Any]) -> None:
    import gguf

    from tests.models import tiny

    n, full = s["layers"], [(i + 1) % s["full_every"] == 0 for i in range(s["layers"])]
    first_shared = n - s["shared"]
    w = gguf.GGUFWriter(str(path), "gemma4")
    w.add_context_length(131072)
    w.add_embedding_length(s["hidden"])
    w.add_block_count(n)
    w.add_feed_forward_length([s["ff"] * (2 if i >= first_shared else 1) for i in range(n)])
    w.add_head_count(s["heads"])
    w.add_head_count_kv([s["kv_heads"]] * n)
    w.add_rope_freq_base(1e6)
    w.add_rope_freq_base_swa(1e4)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_key_length(s["global_head_dim"])
    w.add_value_length(s["global_head_dim"])
    w.add_key_length_swa(s["head_dim"])
    w.add_value_length_swa(s["head_dim"])
    w.add_rope_dimension_count(s["global_head_dim"])
    w.add_rope_dimension_count_swa(s["head_dim"])
    w.add_final_logit_softcapping(30.0)
    w.add_sliding_window(s["window"])
    w.add_sliding_window_pattern([not f for f in full])
    w.add_shared_kv_layers(s["shared"])
    w.add_embedding_length_per_layer_input(s["ple"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    tok = tiny.tiny_tokenizer()
    vocab = tok.backend_tokenizer.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    tokens += [f"<unused{i}>" for i in range(s["vocab"] - len(tokens))]
    import json

    merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in tiny.SPECIAL_TOKENS or t.startswith("<unused")
                       else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_eos_token_id(tiny.EOS_ID)
    w.add_add_bos_token(False)

    pool = (np.random.default_rng(0).standard_normal(POOL, dtype=np.float32) * 0.02).astype(np.float16)
    offset = [0]

    def matrix(name: str, rows: int, cols: int) -> None:
        w.add_tensor(name, PoolMatrix(pool, rows, cols, offset[0]))
        offset[0] += 7919 * 13 + rows  # each matrix its own window of the pool

    def ones(name: str, size: int) -> None:
        w.add_tensor(name, np.ones(size, dtype=np.float32))

    h, hd, ghd, ple = s["hidden"], s["head_dim"], s["global_head_dim"], s["ple"]
    rotated = int(ghd * 0.25 / 2)
    w.add_tensor("rope_freqs.weight", np.array([1.0] * rotated + [1e30] * (ghd // 2 - rotated), dtype=np.float32))
    matrix("token_embd.weight", s["vocab"], h)
    matrix("per_layer_token_embd.weight", s["vocab"], n * ple)
    matrix("per_layer_model_proj.weight", n * ple, h)
    ones("per_layer_proj_norm.weight", ple)
    ones("output_norm.weight", h)
    for i in range(n):
        p, d = f"blk.{i}.", ghd if full[i] else hd
        for norm in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm", "post_norm"):
            ones(p + norm + ".weight", h)
        ones(p + "layer_output_scale.weight", 1)
        ones(p + "attn_q_norm.weight", d)
        matrix(p + "attn_q.weight", s["heads"] * d, h)
        matrix(p + "attn_output.weight", h, s["heads"] * d)
        if i < first_shared:
            ones(p + "attn_k_norm.weight", d)
            matrix(p + "attn_k.weight", s["kv_heads"] * d, h)
            matrix(p + "attn_v.weight", s["kv_heads"] * d, h)
        ff = s["ff"] * (2 if i >= first_shared else 1)
        matrix(p + "ffn_gate.weight", ff, h)
        matrix(p + "ffn_up.weight", ff, h)
        matrix(p + "ffn_down.weight", h, ff)
        matrix(p + "inp_gate.weight", ple, h)
        matrix(p + "proj.weight", h, ple)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="e2b")
    args = parser.parse_args()

    from tests.models import tiny

    args.out_dir.mkdir(parents=True, exist_ok=True)
    f16, q4 = (args.out_dir / f"gemma4-{args.shape}-{t}.gguf" for t in ("f16", "q4_k_m"))
    t0 = time.time()
    write_f16(f16, SHAPES[args.shape])
    print(f"F16: {f16} ({f16.stat().st_size / 2**30:.2f} GiB, {time.time() - t0:.0f} s)", flush=True)
    t0 = time.time()
    if tiny.llama_cpp_quantize(f16, q4, "Q4_K_M") is None:
        sys.exit("needs llama.cpp's llama-quantize: bash ../shared/anchors/llamacpp.sh build")
    print(f"Q4_K_M: {q4} ({q4.stat().st_size / 2**30:.2f} GiB, {time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
